"""LLaVA's image processor (CLIP's, optionally padding to a square first), in torch, and
LLaVA's :class:`~fusion.preprocessing.VisionLanguageProcessor` (:class:`LlavaProcessor`)."""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fusion._validation import is_int
from fusion.families.directory import VlmImageLayout
from fusion.families.llava.builders import rows_per_image
from fusion.families.processor import IMAGE_TOKEN, SquareImagesProcessor
from fusion.hf.config import ConfigReader
from fusion.hf.errors import CheckpointError
from fusion.media.images import (
    CLIP_MEAN,
    CLIP_STD,
    as_uint8_image,
    check_pixels,
    default_max_pixels,
    rescale_normalize,
    to_rgb,
)
from fusion.media.resize import BICUBIC, FILTER_NAMES, resize


@dataclass(frozen=True)
class ClipImageProcessor:
    """Images -> ``pixel_values`` [n, 3, crop_height, crop_width] as Hugging Face's
    ``CLIPImageProcessor`` / ``LlavaImageProcessor`` compute them (their Pillow backend):
    RGB (alpha over white), optionally padded to a square with the mean colour (``do_pad``,
    LLaVA's), shortest edge resized to ``shortest_edge`` (or to ``height`` x ``width``),
    centre crop (padding with zeros where the image is smaller), rescale, normalise.

    Build it with :meth:`from_config` from ``preprocessor_config.json``, or
    :meth:`for_image_size` with CLIP's defaults.
    """

    shortest_edge: int | None = 224
    height: int | None = None
    width: int | None = None
    crop_height: int = 224
    crop_width: int = 224
    resample: int = BICUBIC
    do_resize: bool = True
    do_center_crop: bool = True
    do_pad: bool = False
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    max_pixels: int | None = field(default=None, repr=False)  # None: default_max_pixels()

    @classmethod
    def for_image_size(cls, image_size: int) -> "ClipImageProcessor":
        """CLIP's defaults for a tower taking ``image_size`` square images."""
        return cls(shortest_edge=image_size, crop_height=image_size, crop_width=image_size)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], where: str = "preprocessor_config.json"
    ) -> "ClipImageProcessor":
        """From a ``CLIPImageProcessor`` or ``LlavaImageProcessor`` config (``do_pad`` is
        LLaVA's: ignored for an ``image_processor_type`` of CLIP, as transformers does).

        Raises:
            TypeError: ``config`` not a mapping.
            ValueError: a value of the wrong type or range, or a size given in neither
                supported form (``shortest_edge``, or ``height`` and ``width``), named with its
                key.
        """
        read = ConfigReader.for_image_processor(config, where)
        size = read.size("size", config.get("size", {"shortest_edge": 224}))
        if "shortest_edge" in size and ("height" not in size or "width" not in size):
            resize_to: dict[str, int | None] = {"shortest_edge": size["shortest_edge"]}
        elif "height" in size and "width" in size:
            resize_to = {"shortest_edge": None, "height": size["height"], "width": size["width"]}
        else:
            raise read.fail("size", f"expected shortest_edge, or height and width, got {size}")
        crop = config.get("crop_size", {"height": 224, "width": 224})
        if is_int(crop):
            crop = {"height": crop, "width": crop}
        crop = read.size("crop_size", crop)
        if "height" not in crop or "width" not in crop:
            raise read.fail("crop_size", f"expected height and width, got {crop}")
        return cls(
            **resize_to,
            crop_height=crop["height"],
            crop_width=crop["width"],
            resample=read.resample("resample", BICUBIC, FILTER_NAMES),
            do_resize=read.flag("do_resize", True),
            do_center_crop=read.flag("do_center_crop", True),
            # CLIP's own processor saves do_pad but never pads; LLaVA's pads.
            do_pad=read.flag("do_pad", False) and not _is_clip_type(config),
            do_rescale=read.flag("do_rescale", True),
            rescale_factor=read.number("rescale_factor", 1 / 255),
            do_normalize=read.flag("do_normalize", True),
            image_mean=read.triple("image_mean", CLIP_MEAN),
            image_std=read.triple("image_std", CLIP_STD, positive=True),
        )

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of this size comes out with."""
        return self.steps(height, width)[-1]

    def steps(self, height: int, width: int) -> list[tuple[int, int]]:
        """The (height, width) of an image of this size as given, then after each step that
        changes it (pad, resize, crop): arithmetic only."""
        sizes = [(height, width)]
        if self.do_pad:
            side = max(height, width)
            sizes.append((side, side))
        if self.do_resize:
            sizes.append(self._resized(*sizes[-1]))
        if self.do_center_crop:
            sizes.append((self.crop_height, self.crop_width))
        return sizes

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        if self.shortest_edge is None:
            if self.height is None or self.width is None:
                raise ValueError("height, width: expected both when shortest_edge is None")
            return self.height, self.width
        short, long = min(height, width), max(height, width)
        new_long = int(self.shortest_edge * long / short)
        if width <= height:
            return new_long, self.shortest_edge
        return self.shortest_edge, new_long

    def process(self, image: object, name: str = "image") -> torch.Tensor:
        """One image (uint8 tensor [1, 3 or 4, h, w], or a Pillow image) -> float32 [3, H, W].

        Raises:
            TypeError, ValueError: an image of a type, dtype, shape or mode that cannot be
                taken (see :func:`fusion.preprocessing.as_uint8_image`); an image that is, or
                would be padded or resized to, more than ``max_pixels`` pixels (checked first).
        """
        image = as_uint8_image(image, name)
        check_pixels(self.steps(*image.shape[1:]), self.max_pixels or default_max_pixels(), name)
        image = to_rgb(image)
        if self.do_pad:
            image = _pad_to_square(image, tuple(int(m * 255) for m in self.image_mean))
        if self.do_resize:
            image = resize(image, self._resized(*image.shape[1:]), self.resample)
        if self.do_center_crop:
            image = _center_crop(image, self.crop_height, self.crop_width)
        factor = self.rescale_factor if self.do_rescale else 1.0
        if self.do_normalize:
            return rescale_normalize(image, factor, self.image_mean, self.image_std)
        return rescale_normalize(image, factor, None, None)

    def __call__(self, images: Sequence[object]) -> torch.Tensor:
        """Images -> ``pixel_values`` [n, 3, H, W] (all come out the same size).

        Raises:
            TypeError: ``images`` not a sequence.
            ValueError: an image that cannot be taken (named by its index), or sizes that
                differ after processing (no centre crop and no fixed size).
        """
        if not isinstance(images, Sequence) or isinstance(images, str | bytes):
            raise TypeError(f"images: expected a sequence of images, got {type(images).__name__}")
        processed = [self.process(image, f"images[{i}]") for i, image in enumerate(images)]
        sizes = {tuple(p.shape) for p in processed}
        if len(sizes) > 1:
            raise ValueError(
                f"images: processed to different sizes {sorted(sizes)}; set do_center_crop or "
                "a fixed height and width"
            )
        if not processed:
            return torch.empty(0, 3, *self.output_size(1, 1))
        return torch.stack(processed)


def _is_clip_type(config: Mapping[str, Any]) -> bool:
    kind = config.get("image_processor_type")
    return isinstance(kind, str) and kind.startswith("CLIPImageProcessor")


def _pad_to_square(image: torch.Tensor, color: tuple[int, ...]) -> torch.Tensor:
    _, height, width = image.shape
    if height == width:
        return image
    side = max(height, width)
    # Laid out [side, side, 3] as Pillow's images are (resizing reads it without a copy); the
    # image copied once and only the bands around it filled with the colour.
    fill = torch.tensor(color, dtype=torch.uint8)
    out = torch.empty(side, side, 3, dtype=torch.uint8)
    if width > height:
        top = (side - height) // 2
        rows = out.view(side, side * 3)
        rows[:top] = rows[top + height :] = fill.repeat(side)
        out[top : top + height] = image.permute(1, 2, 0)
    else:
        left = (side - width) // 2
        out[:, :left] = out[:, left + width :] = fill
        out[:, left : left + width] = image.permute(1, 2, 0)
    return out.permute(2, 0, 1)


def _center_crop(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    _, in_height, in_width = image.shape
    top, left = (in_height - height) // 2, (in_width - width) // 2
    if top >= 0 and left >= 0:
        return image[:, top : top + height, left : left + width]
    # Smaller than the crop: centred on zeros, then cropped (as Hugging Face pads).
    pad_h, pad_w = max(height - in_height, 0), max(width - in_width, 0)
    top_pad, left_pad = math.ceil(pad_h / 2), math.ceil(pad_w / 2)
    padded = F.pad(image, (left_pad, pad_w - left_pad, top_pad, pad_h - top_pad))
    top, left = top + top_pad, left + left_pad
    return padded[:, top : top + height, left : left + width]


class LlavaProcessor(SquareImagesProcessor):
    """:class:`~fusion.preprocessing.VisionLanguageProcessor` of LLaVA: each ``<image>``
    becomes the image token once per row, ``tokens_per_image`` times, and each image one
    :class:`ClipImageProcessor` crop."""

    kind = "llava"
    image_processor_type = ClipImageProcessor

    @staticmethod
    def tower_image_size(encoder: Any) -> int:
        return encoder.vision_tower.image_size

    def _steps(self, height: int, width: int) -> tuple[list[tuple[int, int]], int, int]:
        return self.image_processor.steps(height, width), 0, 0

    def _tiles(self, images: Sequence[object]) -> torch.Tensor:
        return self.image_processor(images)

    def _image_text(self, height: int, width: int, tiles: int) -> str:
        return IMAGE_TOKEN * self.tokens_per_image

    @classmethod
    def _tower_setting(
        cls, processor: Any, side: int, where: str
    ) -> tuple[str, tuple[int | None, int | None]]:
        if processor.do_center_crop:
            return "crop_size", (processor.crop_height, processor.crop_width)
        if processor.do_resize and processor.shortest_edge is None:
            return "size", (processor.height, processor.width)
        raise ValueError(
            f"{where}: do_center_crop: false, with a size other than height and width, "
            f"gives images of varying sizes; the vision tower takes {side} x {side}"
        )

    @classmethod
    def _check_processor_config(
        cls, config: dict[str, Any], file: Path, layout: VlmImageLayout
    ) -> None:
        patch = config.get("patch_size")
        if patch is None:
            return
        extra = config.get("num_additional_image_tokens", 0)
        strategy = config.get("vision_feature_select_strategy", "default")
        for key, value, low in (
            ("patch_size", patch, 1),
            ("num_additional_image_tokens", extra, 0),
        ):
            if not is_int(value, low, (1 << 16) - 1):
                raise CheckpointError(file, key, f"expected an integer >= {low}, got {value!r}")
        if strategy not in ("default", "full"):
            expected = f"expected 'default' or 'full', got {strategy!r}"
            raise CheckpointError(file, "vision_feature_select_strategy", expected)
        rows = rows_per_image((layout.image_size // patch) ** 2, strategy, extra)
        if rows != layout.tokens_per_image:
            raise CheckpointError(
                file,
                "patch_size",
                f"{patch} (with num_additional_image_tokens={extra}, "
                f"vision_feature_select_strategy={strategy!r}) gives {rows} rows per image, but "
                f"the model gives {layout.tokens_per_image}",
            )
