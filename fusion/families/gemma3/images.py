"""Gemma 3's image processor, in torch: each image resized to the tower's square (896 x 896
for the published models), rescaled and normalised, as transformers 5.24's
``Gemma3ImageProcessorPil`` computes it, bit for bit; with pan-and-scan on, an image of a
pronounced aspect ratio is also cut into 2 to ``pan_and_scan_max_num_crops`` crops along its
long side, each processed as an image of its own after the original. The text each image
stands for in a prompt, as ``Gemma3Processor`` writes it, and Gemma 3's
:class:`~fusion.preprocessing.VisionLanguageProcessor` (:class:`Gemma3Processor`).
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusion.families.processor import SquareImagesProcessor
from fusion.hf.config import ConfigReader
from fusion.media.images import (
    STANDARD_MEAN,
    STANDARD_STD,
    as_uint8_image,
    check_pixels,
    default_max_pixels,
    rescale_normalize,
    to_rgb,
)
from fusion.media.resize import BILINEAR, FILTER_NAMES, resize

# The tokenizer's markers of an image's rows (Gemma 3's tokenizer_config.json).
START_OF_IMAGE, IMAGE_SOFT_TOKEN, END_OF_IMAGE = (
    "<start_of_image>",
    "<image_soft_token>",
    "<end_of_image>",
)
# What Gemma3Processor passes its image processor where preprocessor_config.json says null.
PAN_AND_SCAN_DEFAULTS = {
    "do_pan_and_scan": False,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """Images -> ``pixel_values`` [n, 3, height, width] and each image's crop count, as
    transformers' ``Gemma3ImageProcessorPil`` computes them: RGB (alpha over white), optional
    pan-and-scan crops (``do_pan_and_scan``: the image first, then its crops), each resized to
    ``height`` x ``width`` (``resample``, bilinear by default), rescaled and normalised
    (mean and std 0.5).

    Build it with :meth:`from_config` from ``preprocessor_config.json``.
    """

    height: int = 224
    width: int = 224
    resample: int = BILINEAR
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = STANDARD_MEAN
    image_std: tuple[float, ...] = STANDARD_STD
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
    max_pixels: int | None = field(default=None, repr=False)  # None: default_max_pixels()

    @classmethod
    def for_image_size(cls, image_size: int) -> "Gemma3ImageProcessor":
        """Gemma 3's defaults for a tower taking ``image_size`` square images."""
        return cls(height=image_size, width=image_size)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], where: str = "preprocessor_config.json"
    ) -> "Gemma3ImageProcessor":
        """From a ``Gemma3ImageProcessor`` config (the pan-and-scan keys left out or null take
        the processor's defaults, as ``Gemma3Processor`` fills them in).

        Raises:
            TypeError: ``config`` not a mapping.
            ValueError: a value of the wrong type or range, or a size other than height and
                width, named with its key.
        """
        filled = dict(config) if isinstance(config, Mapping) else config
        if isinstance(filled, dict):  # Gemma3Processor's defaults where a config leaves null
            for key, default in PAN_AND_SCAN_DEFAULTS.items():
                if filled.get(key) is None:
                    filled[key] = default
        read = ConfigReader.for_image_processor(filled, where)
        size = read.size("size", filled.get("size", {"height": 224, "width": 224}))
        if set(size) != {"height", "width"}:
            raise read.fail("size", f"expected height and width, got {size}")
        return cls(
            height=size["height"],
            width=size["width"],
            resample=read.resample("resample", BILINEAR, FILTER_NAMES),
            do_resize=read.flag("do_resize", True),
            do_rescale=read.flag("do_rescale", True),
            rescale_factor=read.number("rescale_factor", 1 / 255),
            do_normalize=read.flag("do_normalize", True),
            image_mean=read.triple("image_mean", STANDARD_MEAN),
            image_std=read.triple("image_std", STANDARD_STD, positive=True),
            do_pan_and_scan=read.flag("do_pan_and_scan"),
            pan_and_scan_min_crop_size=read.integer("pan_and_scan_min_crop_size"),
            pan_and_scan_max_num_crops=read.integer("pan_and_scan_max_num_crops", low=2),
            pan_and_scan_min_ratio_to_activate=read.number(
                "pan_and_scan_min_ratio_to_activate", None, 0.0
            ),
        )

    def crop_boxes(self, height: int, width: int) -> list[tuple[int, int, int, int]]:
        """The pan-and-scan crops of an image of this size, (top, left, height, width) each,
        clipped to the image as slicing clips them; none when pan-and-scan is off, the image
        is not elongated enough, or the crops would be smaller than the minimum."""
        if not self.do_pan_and_scan:
            return []
        long, short = max(height, width), min(height, width)
        if long / short < self.pan_and_scan_min_ratio_to_activate:
            return []
        count = math.floor(long / short + 0.5)  # the aspect ratio, half rounded up
        count = min(long // self.pan_and_scan_min_crop_size, count)
        count = min(self.pan_and_scan_max_num_crops, max(2, count))
        rows, cols = (1, count) if width >= height else (count, 1)
        crop_h, crop_w = math.ceil(height / rows), math.ceil(width / cols)
        if min(crop_h, crop_w) < self.pan_and_scan_min_crop_size:
            return []
        return [
            (top, left, min(crop_h, height - top), min(crop_w, width - left))
            for top in range(0, crop_h * rows, crop_h)
            for left in range(0, crop_w * cols, crop_w)
        ]

    def output_sizes(self, height: int, width: int) -> list[tuple[int, int]]:
        """The (height, width) of what an image of this size gives: the image, then each of
        its crops (arithmetic only)."""
        parts = [(height, width)] + [(h, w) for _, _, h, w in self.crop_boxes(height, width)]
        return [(self.height, self.width) if self.do_resize else part for part in parts]

    def process(self, image: object, name: str = "image") -> tuple[torch.Tensor, int]:
        """One image (uint8 tensor [1, 3 or 4, h, w], or a Pillow image) -> float32
        [1 + crops, 3, H, W] (the image, then its crops) and its crop count.

        Raises:
            TypeError, ValueError: an image of a type, dtype, shape or mode that cannot be
                taken (see :func:`fusion.preprocessing.as_uint8_image`); an image, or a part
                it would be resized to, of more than ``max_pixels`` pixels (checked first).
        """
        image = as_uint8_image(image, name)
        height, width = image.shape[1:]
        limit = self.max_pixels or default_max_pixels()
        check_pixels([(height, width), *self.output_sizes(height, width)], limit, name)
        image = to_rgb(image)
        boxes = self.crop_boxes(height, width)
        parts = [image] + [image[:, top : top + h, left : left + w] for top, left, h, w in boxes]
        factor = self.rescale_factor if self.do_rescale else 1.0
        mean, std = (self.image_mean, self.image_std) if self.do_normalize else (None, None)
        processed = [
            rescale_normalize(
                resize(part, (self.height, self.width), self.resample) if self.do_resize else part,
                factor,
                mean,
                std,
            )
            for part in parts
        ]
        return torch.stack(processed), len(boxes)

    def __call__(self, images: Sequence[object]) -> tuple[torch.Tensor, list[int]]:
        """Images -> ``pixel_values`` [n, 3, H, W] (each image, then its crops) and each
        image's crop count (transformers' ``num_crops``).

        Raises:
            TypeError: ``images`` not a sequence.
            ValueError: an image that cannot be taken (named by its index), or sizes that
                differ (``do_resize`` off and images of different sizes).
        """
        if not isinstance(images, Sequence) or isinstance(images, str | bytes):
            raise TypeError(f"images: expected a sequence of images, got {type(images).__name__}")
        results = [self.process(image, f"images[{i}]") for i, image in enumerate(images)]
        if not results:
            return torch.empty(0, 3, self.height, self.width), []
        sizes = {tuple(pixels.shape[1:]) for pixels, _ in results}
        if len(sizes) > 1:
            raise ValueError(f"images: processed to different sizes {sorted(sizes)}; set do_resize")
        return torch.cat([pixels for pixels, _ in results]), [crops for _, crops in results]


def gemma3_image_text(rows: int, crops: int = 0) -> str:
    """The text one image stands for in a prompt, as ``Gemma3Processor`` writes it: blank
    lines, ``<start_of_image>``, ``rows`` x ``<image_soft_token>``, ``<end_of_image>``, blank
    lines; with pan-and-scan crops, the original's and each crop's after a sentence saying so.
    """
    one = f"\n\n{START_OF_IMAGE}{IMAGE_SOFT_TOKEN * rows}{END_OF_IMAGE}\n\n"
    if not crops:
        return one
    return (
        f"Here is the original image {one} and here are some crops to help you see better "
        + " ".join([one] * crops)
    )


class Gemma3Processor(SquareImagesProcessor):
    """:class:`~fusion.preprocessing.VisionLanguageProcessor` of Gemma 3: each
    ``<start_of_image>`` in a prompt (the marker its chat template writes) becomes
    :func:`gemma3_image_text` of its image, and each image its
    :class:`Gemma3ImageProcessor` images (the image, then its pan-and-scan crops, each
    ``tokens_per_image`` rows)."""

    kind = "gemma3"
    image_processor_type = Gemma3ImageProcessor
    marker = START_OF_IMAGE
    placeholder = IMAGE_SOFT_TOKEN
    rows_key = "image_seq_length"

    @staticmethod
    def tower_image_size(encoder: Any) -> int:
        return encoder.vision_tower.image_size

    def _steps(self, height: int, width: int) -> tuple[list[tuple[int, int]], int, int]:
        processor = self.image_processor
        crops = len(processor.crop_boxes(height, width))
        return [(height, width), *processor.output_sizes(height, width)], crops, 1

    def _tiles(self, images: Sequence[object]) -> torch.Tensor:
        return self.image_processor(images)[0]

    def _image_text(self, height: int, width: int, tiles: int) -> str:
        return gemma3_image_text(self.tokens_per_image, tiles - 1)

    @classmethod
    def _tower_setting(
        cls, processor: Any, side: int, where: str
    ) -> tuple[str, tuple[int | None, int | None]]:
        if not processor.do_resize:
            raise ValueError(
                f"{where}: do_resize: false gives images of their own sizes; the vision tower "
                f"takes {side} x {side}"
            )
        return "size", (processor.height, processor.width)
