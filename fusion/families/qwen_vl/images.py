"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's image processor (smart resize, images cut into
patches and flattened, still images repeated over the temporal patch), the text each image
marker expands to, in torch.

The three families share one image processor (transformers 5.24 gives Qwen3-VL directories
its ``Qwen2VLImageProcessor`` too), with other settings for Qwen3-VL (patch 16, mean and std
0.5): each image keeps roughly its own size and aspect ratio (:func:`smart_resize`), and gives
``t * h * w`` patches of ``3 * temporal_patch_size * patch_size**2`` values, concatenated over
the images, and ``t * h * w / merge_size**2`` placeholder rows; their
:class:`~fusion.preprocessing.VisionLanguageProcessor` is
:class:`~fusion.families.qwen_vl.processor.Qwen2VLProcessor`.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusion._validation import check_int, is_int
from fusion.hf.config import MAX_SIDE, ConfigReader
from fusion.hf.errors import short_repr
from fusion.media.images import (
    CLIP_MEAN,
    CLIP_STD,
    as_uint8_image,
    check_pil_mode,
    check_pixels,
    default_max_pixels,
    image_size,
    is_pil_image,
    rescale_normalize,
    to_rgb,
)
from fusion.media.resize import (
    BICUBIC,
    FILTER_NAMES,
    resize,
    resize_pillow_image,
    resizes_as_pillow_image,
)

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
# What Qwen's chat template writes for each image, and what a prompt marks an image with.
QWEN2_VL_IMAGE_MARKER = VISION_START + IMAGE_PAD + VISION_END
# What Qwen's chat templates write for each video; its <|video_pad|> becomes the video's text
# (the video processor's video_text, processor.expand_video_pads).
QWEN2_VL_VIDEO_MARKER = VISION_START + VIDEO_PAD + VISION_END
# smart_resize's own limit: a thinner image would be resized to a sliver of patches.
MAX_ASPECT_RATIO = 200
# Bounds on the settings, far above any published model's (patch 14 or 16, merge 2, temporal
# 2): an image is resized to about MAX_IMAGE_PIXELS pixels at most (4096 x 4096, as the other
# families' sides; Qwen2-VL's published max_pixels is 12,845,056, whose patches take 308 MB).
MAX_PATCH_SIZE = 256
MAX_MERGE_SIZE = 16
MAX_TEMPORAL_PATCH_SIZE = 8
MAX_IMAGE_PIXELS = MAX_SIDE * MAX_SIDE
# transformers' defaults (Qwen2VLImageProcessor; Qwen2VLConfig / Qwen2_5_VLConfig).
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# What a config.json gives this processor (the family's defaults for keys it leaves out).


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """The (height, width) Qwen2-VL's image processor resizes a ``height`` x ``width`` image
    to: both multiples of ``factor`` (``patch_size * merge_size``), about the same aspect
    ratio, and about ``min_pixels`` to ``max_pixels`` pixels. The arithmetic is transformers'
    (Python's round-half-even, then a scale by the square root of the pixel ratio when the
    rounded size falls outside the range), so the sizes are the same; they can leave the range
    by a sliver of patches (a side never goes below ``factor``).

    Raises:
        ValueError: an argument that is not a positive integer (named); an aspect ratio above
            :data:`MAX_ASPECT_RATIO` (200), which transformers refuses too.
    """
    for name, value in (
        ("height", height),
        ("width", width),
        ("factor", factor),
        ("min_pixels", min_pixels),
        ("max_pixels", max_pixels),
    ):
        check_int(value, name, low=1, high=2**62)
    # The same float expressions as transformers, so that the same sizes come out.
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"height, width: {height} x {width} pixels, an aspect ratio of {ratio:.1f}, above "
            f"Qwen2-VL's limit of {MAX_ASPECT_RATIO} (crop or pad the image first)"
        )
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    if new_height * new_width > max_pixels:
        scale = math.sqrt(height * width / max_pixels)  # shrink: round down, keep >= factor
        new_height = max(factor, math.floor(height / scale / factor) * factor)
        new_width = max(factor, math.floor(width / scale / factor) * factor)
    elif new_height * new_width < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))  # grow: round up
        new_height = math.ceil(height * scale / factor) * factor
        new_width = math.ceil(width * scale / factor) * factor
    return new_height, new_width


def check_patch_settings(processor: Any, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """The checks Qwen2-VL's image and video processors share: the patch sizes within their
    bounds, the pixel range within [1, ``max_pixels``] and in order, and ``max_pixels`` at
    least one ``patch_size * merge_size`` square (``smart_resize`` never goes below one, so a
    smaller ``max_pixels`` could not be kept for any image or frame).

    Raises:
        ValueError: naming the setting, what was expected and what was given.
    """
    check_int(processor.patch_size, "patch_size", low=1, high=MAX_PATCH_SIZE)
    check_int(processor.merge_size, "merge_size", low=1, high=MAX_MERGE_SIZE)
    check_int(
        processor.temporal_patch_size, "temporal_patch_size", low=1, high=MAX_TEMPORAL_PATCH_SIZE
    )
    check_int(processor.max_pixels, "max_pixels", low=1, high=max_pixels)
    check_int(processor.min_pixels, "min_pixels", low=1, high=max_pixels)
    if processor.min_pixels > processor.max_pixels:
        raise ValueError(
            f"min_pixels: expected at most max_pixels={processor.max_pixels}, got "
            f"{processor.min_pixels}"
        )
    factor = processor.patch_size * processor.merge_size
    if factor**2 > processor.max_pixels:
        raise ValueError(
            f"max_pixels: expected at least (patch_size * merge_size)**2 = {factor**2}, "
            f"got {processor.max_pixels}"
        )


def read_patch_settings(
    read: ConfigReader, defaults: Any, max_pixels: int = MAX_IMAGE_PIXELS
) -> dict[str, Any]:
    """The settings Qwen2-VL's image and video processors share, from their config as
    transformers 5.24 reads it: the pixel range from ``size`` (``shortest_edge`` is the
    minimum pixel count, ``longest_edge`` the maximum), each overridden by a top-level
    ``min_pixels`` / ``max_pixels`` (the legacy keys, which published Qwen directories hold);
    the patch sizes, resampling filter, flags, rescale factor, mean and std. What is absent
    is the ``defaults`` processor's (the pixel range only when ``size`` is absent). Types are
    checked here, naming the key, and pixel counts against ``max_pixels``; other ranges and
    consistency by the processor's constructor.

    Raises:
        CheckpointError: naming the file and key (see ``Qwen2VLImageProcessor.from_config``).
    """
    config = read.values
    size = config.get("size")
    if size is None:
        pixels = {"shortest_edge": defaults.min_pixels, "longest_edge": defaults.max_pixels}
    elif isinstance(size, Mapping):
        pixels = {k: size[k] for k in ("shortest_edge", "longest_edge") if k in size}
    else:
        raise read.fail("size", f"expected an object, got {short_repr(size)}")
    for key, edge, what in (
        ("min_pixels", "shortest_edge", "minimum"),
        ("max_pixels", "longest_edge", "maximum"),
    ):
        source = f"size.{edge}"
        if config.get(key) is not None:
            pixels[edge], source = config[key], key  # the legacy key wins, as in transformers
        if pixels.get(edge) is None:
            raise read.fail(
                source,
                f"missing: expected the {what} pixel count as size.{edge} or as {key}, got "
                f"size={short_repr(size)}",
            )
        value = pixels[edge]
        if not is_int(value) or not 0 < value:
            raise read.fail(source, f"expected a positive integer, got {short_repr(value)}")
        if value > max_pixels:
            raise read.fail(source, f"expected at most {max_pixels} pixels, got {value}")
    sizes = {key: read.integer(key, 2, low=None) for key in ("temporal_patch_size", "merge_size")}
    return {
        "min_pixels": pixels["shortest_edge"],
        "max_pixels": pixels["longest_edge"],
        **sizes,
        "patch_size": read.integer("patch_size", defaults.patch_size, low=None),
        "resample": read.resample("resample", BICUBIC, FILTER_NAMES),
        **{
            key: read.flag(key, True)
            for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
        },
        "rescale_factor": read.number("rescale_factor", 1 / 255),
        "image_mean": read.triple("image_mean", defaults.image_mean),
        "image_std": read.triple("image_std", defaults.image_std, positive=True),
    }


def qwen2_vl_image_text(rows: int) -> str:
    """The text one image marker expands to, as Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's
    processors write it (for images; Qwen3-VL's adds timestamps to videos only):
    ``<|vision_start|>``, ``rows`` times ``<|image_pad|>``, ``<|vision_end|>``.

    Raises:
        ValueError: ``rows`` not an integer in [1, :data:`MAX_IMAGE_PIXELS`] (no image of the
            settings' bounds gives more).
    """
    check_int(rows, "rows", low=1, high=MAX_IMAGE_PIXELS)
    return VISION_START + IMAGE_PAD * rows + VISION_END


@dataclass(frozen=True)
class PatchedImages:
    """Images as Qwen2-VL's vision tower takes them.

    Attributes:
        pixel_values: float32 [n_patches, 3 * temporal_patch_size * patch_size**2], the patches
            of all images in order: per image, row-major over its merge_size x merge_size
            blocks of patches, and within a block row-major (the order the tower's patch
            merger reads).
        image_grid_thw: int64 [n_images, 3], each image's (temporal, height, width) grid of
            patches; its product is the image's patch count.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


class PatchGeometry:
    """The patch arithmetic the image and video processors share, from their
    ``patch_size``, ``merge_size`` and ``temporal_patch_size`` fields."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int

    @property
    def factor(self) -> int:
        """``patch_size * merge_size``: the sides of resized images and frames are multiples
        of it."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """The values of one flattened patch: ``3 * temporal_patch_size * patch_size**2``."""
        return 3 * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class Qwen2VLImageProcessor(PatchGeometry):
    """Images -> :class:`PatchedImages` as transformers' ``Qwen2VLImageProcessor`` computes
    them (its Pillow backend, ``Qwen2VLImageProcessorPil``: the one ``AutoImageProcessor``
    gives without torchvision), used by Qwen2-VL, Qwen2.5-VL and Qwen3-VL alike (see
    :func:`default_image_processor` for each family's settings).

    Each image is made RGB (alpha over white), resized with ``resample`` to the size
    :func:`smart_resize` gives (multiples of ``patch_size * merge_size`` holding about
    ``min_pixels`` to ``max_pixels`` pixels), rescaled and normalised, cut into
    ``patch_size`` squares, and each square repeated ``temporal_patch_size`` times (a still
    image is one frame of a video whose frames are the same).

    Build it with :meth:`from_config` from ``preprocessor_config.json``, or directly (every
    setting is checked; see :data:`MAX_IMAGE_PIXELS` and the other bounds).

    Attributes:
        pixel_limit: the most pixels an image may hold as given and as resized (None:
            :func:`fusion.media.images.default_max_pixels`, Pillow's
            decompression-bomb limit): a safety cap, not one of transformers' settings
            (``VisionLanguageProcessor``'s ``max_pixels=`` sets it).

    Raises:
        ValueError: a setting out of range or inconsistent (named): sizes not integers within
            their bounds, ``min_pixels`` above ``max_pixels``, ``max_pixels`` below one
            ``patch_size * merge_size`` square, a resampling filter not taken.
    """

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    do_convert_rgb: bool = True
    pixel_limit: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_patch_settings(self)
        if isinstance(self.resample, bool) or self.resample not in FILTER_NAMES:
            names = ", ".join(f"{n} ({FILTER_NAMES[n]})" for n in sorted(FILTER_NAMES))
            raise ValueError(f"resample: expected one of {names}, got {self.resample!r}")
        if self.pixel_limit is not None:
            check_int(self.pixel_limit, "pixel_limit", low=1, high=2**62)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], where: str = "preprocessor_config.json"
    ) -> "Qwen2VLImageProcessor":
        """From a ``Qwen2VLImageProcessor`` config, read as transformers 5.24 reads it: the
        pixel range from ``size`` (``shortest_edge`` is the minimum pixel count,
        ``longest_edge`` the maximum; transformers' defaults, 3136 and 1003520, only when
        ``size`` is absent), each overridden by a top-level ``min_pixels`` / ``max_pixels``
        (the legacy keys, which published Qwen directories hold).

        Raises:
            TypeError: ``config`` not a mapping.
            ValueError: naming ``where`` and the key: a value of the wrong type or range; a
                pixel range given in neither form (e.g. only ``size.min_pixels``, which
                transformers 5.24 no longer reads); an ``image_processor_type`` of another
                family.
        """
        read = ConfigReader.for_image_processor(config, where)
        kind = config.get("image_processor_type")
        if kind is not None and not (
            isinstance(kind, str) and kind.startswith("Qwen2VLImageProcessor")
        ):
            raise read.fail(
                "image_processor_type",
                f"expected a Qwen2VLImageProcessor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), got {kind!r}",
            )
        settings = read_patch_settings(read, cls())
        try:
            return cls(**settings)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def output_size(self, height: int, width: int, name: str = "image") -> tuple[int, int]:
        """The (height, width) an image of this size is resized to (itself without
        ``do_resize``): arithmetic only.

        Raises:
            ValueError: naming ``name``: an aspect ratio above 200; without ``do_resize``,
                sides that are not multiples of ``patch_size * merge_size``.
        """
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise ValueError(
                    f"{name}: {height} x {width} pixels with do_resize false: both sides must "
                    f"be multiples of patch_size * merge_size = {self.factor}"
                )
            return height, width
        try:
            return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None

    def grid(self, height: int, width: int, name: str = "image") -> tuple[int, int, int]:
        """The (temporal, height, width) grid of patches of an image of this size (raises as
        :meth:`output_size`)."""
        out_height, out_width = self.output_size(height, width, name)
        return 1, out_height // self.patch_size, out_width // self.patch_size

    def rows(self, height: int, width: int, name: str = "image") -> int:
        """The placeholder rows an image of this size gives: ``t * h * w / merge_size**2``
        (raises as :meth:`output_size`)."""
        t, h, w = self.grid(height, width, name)
        return t * h * w // self.merge_size**2

    def check(self, image: object, name: str = "image") -> tuple[int, int, int]:
        """An image's grid, every check made from its size and type alone (nothing
        converted or allocated): the type, dtype and mode (see
        :func:`fusion.preprocessing.as_uint8_image`), 3 channels when ``do_convert_rgb`` is
        false, the pixel cap as given and as resized, the aspect ratio.

        Raises:
            TypeError, ValueError: naming ``name``.
        """
        if is_pil_image(image):
            check_pil_mode(image, name)
        height, width = image_size(image, name)
        if not self.do_convert_rgb:
            # transformers then takes the pixels as they are: a grayscale, palette or RGBA
            # image would give other channels than the tower's three.
            if is_pil_image(image):
                mode = image.mode  # type: ignore[attr-defined]
                fits, got = mode == "RGB", f"Pillow mode {mode!r}"
            else:
                channels = as_uint8_image(image, name).size(0)
                fits, got = channels == 3, f"{channels} channel(s)"
            if not fits:
                raise ValueError(
                    f"{name}: {got} with do_convert_rgb false; expected an RGB image (3 "
                    "channels), or set do_convert_rgb"
                )
        out = self.output_size(height, width, name)
        check_pixels([(height, width), out], self.pixel_limit or default_max_pixels(), name)
        return 1, out[0] // self.patch_size, out[1] // self.patch_size

    def __call__(self, images: Sequence[object]) -> PatchedImages:
        """Images (uint8 tensors [1, 3 or 4, h, w], or Pillow images) -> their patches and
        grids. Every image is checked (:meth:`check`) before any is processed, and the
        patches are written into one tensor allocated once.

        Raises:
            TypeError: ``images`` not a sequence.
            TypeError, ValueError: an image that cannot be taken (named by its index).
        """
        if not isinstance(images, Sequence) or isinstance(images, str | bytes):
            raise TypeError(f"images: expected a sequence of images, got {type(images).__name__}")
        grids = [self.check(image, f"images[{i}]") for i, image in enumerate(images)]
        counts = [t * h * w for t, h, w in grids]
        pixel_values = torch.empty(sum(counts), self.patch_dim, dtype=torch.float32)
        start = 0
        for i, (image, count) in enumerate(zip(images, counts, strict=True)):
            self._patches(image, f"images[{i}]", pixel_values[start : start + count])
            start += count
        grid_thw = torch.tensor(grids, dtype=torch.int64).view(len(grids), 3)
        return PatchedImages(pixel_values, grid_thw)

    def _patches(self, image: object, name: str, out: torch.Tensor) -> None:
        """One checked image's patches written into ``out`` [n, patch_dim]."""
        pixels: torch.Tensor
        if self.do_resize and resizes_as_pillow_image(image, self.resample):
            # A decoded RGB image goes to Pillow's resize as it is (no tensor copy first).
            height, width = image.height, image.width  # type: ignore[attr-defined]
            pixels = resize_pillow_image(image, self.output_size(height, width), self.resample)
        else:
            if is_pil_image(image) and not self.do_convert_rgb:
                pixels = _rgb_bytes(image)  # checked: mode RGB
            else:
                pixels = to_rgb(as_uint8_image(image, name))  # RGB already when not converting
            if self.do_resize:
                pixels = resize(pixels, self.output_size(*pixels.shape[1:]), self.resample)
        factor = self.rescale_factor if self.do_rescale else 1.0
        mean, std = (self.image_mean, self.image_std) if self.do_normalize else (None, None)
        # Rescaled (float64 product, rounded to float32) and normalised (float32) as
        # transformers' Pillow backend computes them, so the values are its bits.
        values = rescale_normalize(pixels, factor, mean, std)
        # A still image is a clip of temporal_patch_size equal frames (a view, not copies).
        frames = values.unsqueeze(0).expand(self.temporal_patch_size, -1, -1, -1)
        write_patches(frames, self.patch_size, self.merge_size, out)


def write_patches(
    frames: torch.Tensor, patch_size: int, merge_size: int, out: torch.Tensor
) -> None:
    """Frames cut into the patches Qwen2-VL's vision tower takes, written into ``out``: the
    layout of images and videos alike.

    Args:
        frames: float32 [t, 3, H, W], ``t`` a multiple of the temporal patch (``out``'s
            ``patch_dim / (3 * patch_size**2)``), ``H`` and ``W`` multiples of ``patch_size *
            merge_size``.
        out: [t / temporal_patch * H / patch_size * W / patch_size, patch_dim], per temporal
            patch, row-major over the merge_size x merge_size blocks of patches, and within a
            block row-major (the merger's neighbours are consecutive rows); each row holds
            (channel, time, y, x).
    """
    p, m = patch_size, merge_size
    frame_count, _, height, width = frames.shape
    t = out.size(1) // (3 * p * p)
    blocks_h, blocks_w = height // (p * m), width // (p * m)
    # [T, 3, H, W] -> [grid t, block row, block col, row in block, col in block, channel,
    # time in patch, y, x]
    patches = frames.reshape(frame_count // t, t, 3, blocks_h, m, p, blocks_w, m, p)
    target = out.view(frame_count // t, blocks_h, blocks_w, m, m, 3, t, p, p)
    target.copy_(patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8))


def _rgb_bytes(image: Any) -> torch.Tensor:
    """A Pillow RGB image's bytes as uint8 [3, h, w], a transparent colour ignored (as
    transformers reads an image it does not convert; :func:`from_pil` would composite it)."""
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return data.view(image.height, image.width, 3).permute(2, 0, 1)
