"""Images in: decoding (Pillow, an optional extra, imported only here and only when called),
then everything in torch: 8-bit RGB, alpha over white, rescale and normalise.

Decoding keeps what a file holds: :func:`load_image` applies the EXIF orientation and converts
palette, bilevel, CMYK and YCbCr images to RGB (or RGBA when they carry transparency), as
Hugging Face's processors do before anything else. Images of more than 8 bits per channel are
refused rather than clipped.
"""

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

# Pillow modes decoding takes: 8 bits per channel.
DECODABLE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)


def _pil() -> Any:
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise ImportError(
            "decoding images needs Pillow: pip install 'torch-early-fusion[vision]' (or pillow)"
        ) from None
    return Image, ImageOps


def is_pil_image(value: object) -> bool:
    """Whether ``value`` is a Pillow image (without importing Pillow)."""
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(value, module.Image)


def from_pil(image: Any, name: str = "image") -> torch.Tensor:
    """A Pillow image as a uint8 tensor [channels, height, width]: [3] RGB, [4] RGBA (images
    with an alpha band or a transparent colour), [1] for grayscale ``L``. Other 8-bit modes are
    converted to RGB or RGBA by Pillow (a palette lookup, CMYK or YCbCr to RGB).

    Raises:
        TypeError: not a Pillow image.
        ValueError: a mode the processors cannot take (more than 8 bits per channel, e.g.
            ``I;16`` or ``F``, or an unusual one), named with those that are taken.
    """
    if not is_pil_image(image):
        raise TypeError(f"{name}: expected a Pillow image, got {type(image).__name__}")
    if image.mode not in DECODABLE_MODES:
        raise ValueError(
            f"{name}: Pillow mode {image.mode!r} cannot be taken (16-bit, 32-bit or float "
            f"pixels would have to be clipped); expected one of {list(DECODABLE_MODES)}"
        )
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        image = image.convert("RGBA")
    elif image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    channels = len(image.getbands())
    return data.view(image.height, image.width, channels).permute(2, 0, 1).contiguous()


def load_image(path: str | bytes | os.PathLike) -> torch.Tensor:
    """Decode an image file (any format Pillow reads; the first frame of an animation) to a
    uint8 tensor as :func:`from_pil` describes, after applying its EXIF orientation.

    Raises:
        ImportError: Pillow is not installed.
        FileNotFoundError, OSError: the file cannot be read.
        ValueError: not an image Pillow can decode, or of a mode the processors cannot take.
    """
    Image, ImageOps = _pil()
    path = os.fsdecode(path)
    try:
        with Image.open(path) as opened:
            opened.load()
            image = ImageOps.exif_transpose(opened)
    except Image.UnidentifiedImageError as error:
        raise ValueError(f"image {path!r}: not an image Pillow can decode: {error}") from None
    return from_pil(image, f"image {path!r}")


def as_uint8_image(image: object, name: str = "image") -> torch.Tensor:
    """``image`` (a Pillow image, or a uint8 tensor [1, 3 or 4, h, w]) as a tensor.

    Raises:
        TypeError: neither a tensor nor a Pillow image.
        ValueError: a tensor of another dtype or shape, an empty image, or a Pillow mode
            :func:`from_pil` refuses.
    """
    if is_pil_image(image):
        return from_pil(image, name)
    if not isinstance(image, torch.Tensor):
        raise TypeError(
            f"{name}: expected a uint8 tensor [channels, h, w] or a Pillow image, got "
            f"{type(image).__name__}"
        )
    if image.dtype != torch.uint8 or image.dim() != 3 or image.size(0) not in (1, 3, 4):
        raise ValueError(
            f"{name}: expected 8-bit pixels, a uint8 tensor [1, 3 or 4 channels (L, RGB, "
            f"RGBA), h, w], got shape {list(image.shape)}, dtype {image.dtype}"
        )
    if image.size(1) < 1 or image.size(2) < 1:
        raise ValueError(f"{name}: expected at least one pixel, got shape {list(image.shape)}")
    return image


def to_rgb(image: torch.Tensor) -> torch.Tensor:
    """uint8 [1, 3 or 4, h, w] -> uint8 RGB [3, h, w]: grayscale repeated, RGBA composited
    over white with Pillow's ``alpha_composite`` integer arithmetic (so the pixels are those
    Hugging Face's processors compute from the same Pillow image)."""
    if image.size(0) == 1:
        return image.expand(3, -1, -1).contiguous()
    if image.size(0) == 3:
        return image
    rgb, alpha = image[:3].to(torch.int64), image[3:].to(torch.int64)
    # Over an opaque white background Pillow's weights reduce to 128 * alpha and
    # 128 * (255 - alpha); sums are divided by 255 with its shift-based rounding.
    blended = rgb * (128 * alpha) + 255 * (128 * (255 - alpha)) + (0x80 << 7)
    out = (((blended >> 8) + blended) >> 8) >> 7
    return torch.where(alpha == 0, 255, out).to(torch.uint8)


def rescale(image: torch.Tensor, factor: float) -> torch.Tensor:
    """uint8 -> float32 ``image * factor``, the product rounded once (computed in float64, as
    Hugging Face's processors compute it)."""
    return (image.to(torch.float64) * factor).to(torch.float32)


def normalize(image: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """float32 [3, h, w] -> ``(image - mean) / std`` per channel, in float32 arithmetic (mean
    and std rounded to float32 first, as Hugging Face's processors round them)."""
    mean_ = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    std_ = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return (image.to(torch.float32) - mean_) / std_
