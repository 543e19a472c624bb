"""Idefics3 / SmolVLM's image processor (resize, split into tiles plus a global image), and
the prompt text each image expands to, in torch; their
:class:`~fusion.preprocessing.VisionLanguageProcessor` (:class:`Idefics3Processor`)."""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusion.families.processor import IMAGE_TOKEN, SquareImagesProcessor
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
from fusion.media.resize import (
    FILTER_NAMES,
    LANCZOS,
    resize,
    resize_pillow_image,
    resizes_as_pillow_image,
)

MAX_IMAGE_SIDE = 4096  # Idefics3's cap on either side after the first resize
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"


@dataclass(frozen=True)
class TiledImage:
    """One processed image: ``tiles`` [k, 3, s, s] float32 (the crops in row-major order,
    then the global image; just the image when it was not split) and the grid of crops
    (``rows``, ``cols``; both 0 when not split)."""

    tiles: torch.Tensor
    rows: int
    cols: int


@dataclass(frozen=True)
class Idefics3ImageProcessor:
    """Images -> tiles as Hugging Face's ``Idefics3ImageProcessor`` / ``SmolVLMImageProcessor``
    compute them (their Pillow backend).

    Each image is made RGB (alpha over white), its longest edge resized to ``longest_edge``
    (the other keeping the aspect ratio, rounded up to even; no side above 4096). With
    ``do_image_splitting``, both sides are then rounded up to multiples of
    ``max_image_size`` (resized again), cut into ``max_image_size`` squares, and the whole image
    resized to one more square (the global image); an image no larger than one square is kept
    whole. Without splitting, each image is resized to one square. Tiles are rescaled and
    normalised.

    Build it with :meth:`from_config` from ``preprocessor_config.json``, or
    :meth:`for_image_size` with Idefics3's defaults.
    """

    max_image_size: int = 364
    longest_edge: int | None = 4 * 364
    height: int | None = None
    width: int | None = None
    resample: int = LANCZOS
    do_resize: bool = True
    do_image_splitting: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = STANDARD_MEAN
    image_std: tuple[float, ...] = STANDARD_STD
    max_pixels: int | None = field(default=None, repr=False)  # None: default_max_pixels()

    @classmethod
    def for_image_size(cls, image_size: int) -> "Idefics3ImageProcessor":
        """Idefics3's defaults for a tower taking ``image_size`` square tiles: images resized
        to a longest edge of 4 tiles."""
        return cls(max_image_size=image_size, longest_edge=4 * image_size)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], where: str = "preprocessor_config.json"
    ) -> "Idefics3ImageProcessor":
        """From an ``Idefics3ImageProcessor`` or ``SmolVLMImageProcessor`` config.

        Raises:
            TypeError: ``config`` not a mapping.
            ValueError: a value of the wrong type or range, named with its key.
        """
        read = ConfigReader.for_image_processor(config, where)
        tile = read.size("max_image_size", config.get("max_image_size", {"longest_edge": 364}))
        if "longest_edge" not in tile:
            raise read.fail("max_image_size", f"expected longest_edge, got {tile}")
        size = read.size("size", config.get("size", {"longest_edge": 4 * 364}))
        if "longest_edge" in size:
            target: dict[str, int | None] = {"longest_edge": size["longest_edge"]}
        elif "height" in size and "width" in size:
            target = {"longest_edge": None, "height": size["height"], "width": size["width"]}
        else:
            raise read.fail("size", f"expected longest_edge, or height and width, got {size}")
        return cls(
            max_image_size=tile["longest_edge"],
            **target,
            resample=read.resample("resample", LANCZOS, FILTER_NAMES),
            do_resize=read.flag("do_resize", True),
            do_image_splitting=read.flag("do_image_splitting", True),
            do_rescale=read.flag("do_rescale", True),
            rescale_factor=read.number("rescale_factor", 1 / 255),
            do_normalize=read.flag("do_normalize", True),
            image_mean=read.triple("image_mean", STANDARD_MEAN),
            image_std=read.triple("image_std", STANDARD_STD, positive=True),
        )

    def _first_size(self, height: int, width: int) -> tuple[int, int]:
        if self.longest_edge is None:
            if self.height is None or self.width is None:
                raise ValueError("height, width: expected both when longest_edge is None")
            return self.height, self.width
        # Longest edge to longest_edge, the other scaled and rounded up to even ...
        longest, ratio = self.longest_edge, width / height
        if width >= height:
            width, height = longest, int(longest / ratio)
            height += height % 2
        else:
            height, width = longest, int(longest * ratio)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        # ... then both within the 4096 cap.
        ratio = width / height
        if width >= height and width > MAX_IMAGE_SIDE:
            width, height = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / ratio)
        elif height > width and height > MAX_IMAGE_SIDE:
            height, width = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE * ratio)
        return max(height, 1), max(width, 1)

    def _tiled_size(self, height: int, width: int) -> tuple[int, int]:
        tile, ratio = self.max_image_size, width / height
        if width >= height:
            width = math.ceil(width / tile) * tile
            height = math.ceil(int(width / ratio) / tile) * tile
        else:
            height = math.ceil(height / tile) * tile
            width = math.ceil(int(height * ratio) / tile) * tile
        return height, width

    def steps(self, height: int, width: int) -> tuple[list[tuple[int, int]], int, int]:
        """For an image of this size, arithmetic only: its (height, width) as given and after
        each resize, and the grid of crops (``rows``, ``cols``; both 0 when not split): it
        gives ``rows * cols + 1`` tiles when split, else one."""
        sizes = [(height, width)]
        if self.do_resize:
            sizes.append(self._first_size(height, width))
        tile = self.max_image_size
        if not self.do_image_splitting:
            return [*sizes, (tile, tile)], 0, 0
        sizes.append(self._tiled_size(*sizes[-1]))
        height, width = sizes[-1]
        if height > tile or width > tile:
            return sizes, height // tile, width // tile
        return sizes, 0, 0

    def process(self, image: object, name: str = "image") -> TiledImage:
        """One image (uint8 tensor [1, 3 or 4, h, w], or a Pillow image) -> its tiles.

        Raises:
            TypeError, ValueError: an image of a type, dtype, shape or mode that cannot be
                taken (see :func:`fusion.preprocessing.as_uint8_image`); an image that is, or
                would be resized to, more than ``max_pixels`` pixels (checked first).
        """
        limit = self.max_pixels or default_max_pixels()
        if self.do_resize and resizes_as_pillow_image(image, self.resample):
            # The large decoded image goes to Pillow's resize as it is (no tensor copy first).
            height, width = image.height, image.width  # type: ignore[attr-defined]
            check_pixels(self.steps(height, width)[0], limit, name)
            image = resize_pillow_image(image, self._first_size(height, width), self.resample)
        else:
            image = as_uint8_image(image, name)
            check_pixels(self.steps(*image.shape[1:])[0], limit, name)
            image = to_rgb(image)
            if self.do_resize:
                image = resize(image, self._first_size(*image.shape[1:]), self.resample)
        tile = self.max_image_size
        rows = cols = 0
        if not self.do_image_splitting:
            tiles = [resize(image, (tile, tile), self.resample)]
        else:
            image = resize(image, self._tiled_size(*image.shape[1:]), self.resample)
            height, width = image.shape[1:]
            if height > tile or width > tile:
                rows, cols = height // tile, width // tile
                tiles = [
                    image[:, r * tile : (r + 1) * tile, c * tile : (c + 1) * tile]
                    for r in range(rows)
                    for c in range(cols)
                ]
                tiles.append(resize(image, (tile, tile), self.resample))
            else:
                tiles = [image]
        factor = self.rescale_factor if self.do_rescale else 1.0
        mean, std = (self.image_mean, self.image_std) if self.do_normalize else (None, None)
        # Written straight into the stacked tiles (all tiles are the same size).
        pixels = torch.empty(len(tiles), *tiles[0].shape, dtype=torch.float32)
        for tile_pixels, out in zip(tiles, pixels, strict=True):
            rescale_normalize(tile_pixels, factor, mean, std, out=out)
        return TiledImage(pixels, rows, cols)

    def __call__(self, images: Sequence[object]) -> list[TiledImage]:
        """Each image's :class:`TiledImage`, in order.

        Raises:
            TypeError: ``images`` not a sequence.
            ValueError: an image that cannot be taken (named by its index).
        """
        if not isinstance(images, Sequence) or isinstance(images, str | bytes):
            raise TypeError(f"images: expected a sequence of images, got {type(images).__name__}")
        return [self.process(image, f"images[{i}]") for i, image in enumerate(images)]


def idefics3_image_text(rows: int, cols: int, tokens_per_tile: int) -> str:
    """The text an image marker expands to, as Idefics3's and SmolVLM's processors write it:
    per crop ``<fake_token_around_image><row_r_col_c>`` and ``tokens_per_tile`` ``<image>``
    tokens, a newline after each row of crops, then a blank line and the global image
    ``<fake_token_around_image><global-img><image>...<fake_token_around_image>``; an image not
    split (``rows == cols == 0``) is just the global part."""
    run = IMAGE_TOKEN * tokens_per_tile
    whole = f"{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TOKEN}{run}{FAKE_IMAGE_TOKEN}"
    if rows == 0 and cols == 0:
        return whole
    grid = "".join(
        "".join(f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{whole}"


class Idefics3Processor(SquareImagesProcessor):
    """:class:`~fusion.preprocessing.VisionLanguageProcessor` of Idefics3 and SmolVLM: each
    ``<image>`` becomes its grid of tiles (:func:`idefics3_image_text`), each image the
    :class:`Idefics3ImageProcessor` tiles."""

    kind = "idefics3"
    image_processor_type = Idefics3ImageProcessor
    rows_key, rows_per = "image_seq_len", "tile"

    @staticmethod
    def tower_image_size(encoder: Any) -> int:
        return encoder.vision_model.image_size

    def _steps(self, height: int, width: int) -> tuple[list[tuple[int, int]], int, int]:
        return self.image_processor.steps(height, width)

    def _tiles(self, images: Sequence[object]) -> torch.Tensor:
        tiled = self.image_processor(images)
        if not tiled:
            return torch.empty(0, 3, self.image_size, self.image_size)
        return torch.cat([t.tiles for t in tiled])

    def _image_text(self, height: int, width: int, tiles: int) -> str:
        _, rows, cols = self._steps(height, width)
        return idefics3_image_text(rows, cols, self.tokens_per_image)

    @classmethod
    def _tower_setting(
        cls, processor: Any, side: int, where: str
    ) -> tuple[str, tuple[int | None, int | None]]:
        return "max_image_size.longest_edge", (processor.max_image_size,) * 2
