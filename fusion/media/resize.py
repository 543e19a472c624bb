"""Resizing 8-bit images with Pillow's own ``Image.resize``, as Hugging Face's image
processors resize them (their Pillow backend): the same library, so the same pixels, bit for
bit, whatever Pillow's version (Pillow 13, for one, changed the order of its two passes).

Pillow is the ``vision`` extra. A tensor goes to Pillow as the interleaved memory Pillow
decodes into (no copy when it already is, as :func:`~fusion.preprocessing.from_pil` leaves
it), and the result is a view of Pillow's bytes.
"""

import ctypes
import functools
import warnings
from typing import Any, Literal

import torch

from fusion._validation import is_int
from fusion.media.images import from_pil, is_pil_image

# Pillow's resampling filter numbers, which image processor configs store (``resample``).
NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING = 0, 1, 2, 3, 4, 5
# The filters taken, by number: their names (nearest is not one: no image processor of these
# models uses it).
FILTER_NAMES = {
    BOX: "box",
    BILINEAR: "bilinear",
    HAMMING: "hamming",
    BICUBIC: "bicubic",
    LANCZOS: "lanczos",
}
FILTERS = FILTER_NAMES  # deprecated name: was number -> (torch filter function, support)
BACKENDS = ("auto", "pillow", "torch")


def resize(
    image: torch.Tensor,
    size: tuple[int, int],
    resample: int = BICUBIC,
    *,
    backend: Literal["auto", "pillow", "torch"] = "auto",
) -> torch.Tensor:
    """Resize an 8-bit image with Pillow's ``Image.resize(size[::-1], resample)``.

    Args:
        image: uint8 [channels, height, width] on any device (each channel is resized alone,
            as Pillow resizes each band of an RGB or L image).
        size: (height, width) of the output, each >= 1.
        resample: :data:`BOX`, :data:`BILINEAR`, :data:`HAMMING`, :data:`BICUBIC` or
            :data:`LANCZOS` (Pillow's numbers).
        backend: ``"pillow"``: one ``Image.resize`` call, for 1 or 3 channels on the CPU;
            ``"auto"``: that, or one call per channel (other channel counts; Pillow would
            premultiply a fourth as alpha) on a CPU copy for other devices. ``"torch"`` is
            deprecated (the torch resampling is gone): it warns and means ``"auto"``, which
            gives the bytes it gave.

    Returns:
        uint8 [channels, height, width] on ``image``'s device (from one Pillow call: a view of
        interleaved [height, width, channels] memory); a copy when the size is unchanged.

    Raises:
        TypeError: ``image`` not a tensor.
        ValueError: ``image`` not uint8 [c, h, w] with h, w >= 1; ``size`` not two integers
            >= 1; an unsupported filter (e.g. nearest); an unknown ``backend``, or
            ``"pillow"`` for an image it cannot take (not 1 or 3 channels, not on the CPU).
        ImportError: Pillow is not installed.
    """
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"image: expected a uint8 tensor [c, h, w], got {type(image).__name__}")
    if image.dtype != torch.uint8 or image.dim() != 3 or min(image.shape[1:], default=0) < 1:
        raise ValueError(
            f"image: expected a uint8 tensor [c, h, w], got shape {list(image.shape)}, dtype "
            f"{image.dtype}"
        )
    if not isinstance(size, tuple | list) or len(size) != 2 or not all(is_int(s, 1) for s in size):
        raise ValueError(f"size: expected (height, width), two integers >= 1, got {size!r}")
    if resample not in FILTER_NAMES:
        names = ", ".join(f"{n} ({FILTER_NAMES[n]})" for n in sorted(FILTER_NAMES))
        raise ValueError(f"resample: expected one of {names}, got {resample!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        warnings.warn(
            "resize(backend='torch') is deprecated: resizing is Pillow's (the same bytes); "
            "leave backend out",
            DeprecationWarning,
            stacklevel=2,
        )
    one_call = image.device.type == "cpu" and image.size(0) in (1, 3)
    if backend == "pillow" and not one_call:
        raise ValueError(
            "backend: 'pillow' takes 1 or 3 channels on the CPU, got shape "
            f"{list(image.shape)} on {image.device}"
        )
    if _pillow_image() is None:
        raise ImportError("resize needs Pillow: pip install pillow (the 'vision' extra)")
    if one_call:
        return _resize_pillow(image, size, resample)
    if image.size(0) == 0:
        return image.new_empty(0, *size)
    on_cpu = image.cpu()
    bands = [on_cpu] if on_cpu.size(0) in (1, 3) else on_cpu.split(1)
    out = [_resize_pillow(band, size, resample) for band in bands]
    return (out[0] if len(out) == 1 else torch.cat(out)).to(image.device)


@functools.cache
def _pillow_image() -> Any:
    """Pillow's ``Image`` module, or None when Pillow is not installed."""
    try:
        from PIL import Image
    except ImportError:
        return None
    return Image


def _resize_pillow(image: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """uint8 [1 or 3, h, w] on the CPU resized by Pillow's ``Image.resize``: [c, *size]."""
    Image = _pillow_image()
    channels, in_height, in_width = image.shape
    # Pillow's interleaved layout [h, w, c]; a view (no copy) when the tensor already is one,
    # as images decoded by Pillow are (``from_pil``).
    interleaved = image.permute(1, 2, 0).contiguous()
    # The tensor's memory as a buffer Pillow reads from (no numpy needed); kept alive below.
    buffer = (ctypes.c_uint8 * interleaved.numel()).from_address(interleaved.data_ptr())
    mode = "L" if channels == 1 else "RGB"
    source = Image.frombuffer(mode, (in_width, in_height), buffer, "raw", mode, 0, 1)
    resized = source.resize((size[1], size[0]), resample=resample)
    del source, buffer, interleaved
    data = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8)
    # A [c, h, w] view of Pillow's layout: a further resize reads it without a copy.
    return data.view(size[0], size[1], channels).permute(2, 0, 1)


def resizes_as_pillow_image(image: object, resample: int) -> bool:
    """Whether :func:`resize_pillow_image` takes ``image``: a Pillow RGB image without a
    transparent colour (one :func:`fusion.preprocessing.to_rgb` would leave as it is), and a
    filter :func:`resize` takes."""
    return (
        is_pil_image(image)
        and image.mode == "RGB"  # type: ignore[attr-defined]
        and image.info.get("transparency") is None  # type: ignore[attr-defined]
        and resample in FILTER_NAMES
    )


def resize_pillow_image(image: Any, size: tuple[int, int], resample: int) -> torch.Tensor:
    """A Pillow RGB image (see :func:`resizes_as_pillow_image`) resized by Pillow before it
    becomes a tensor: the same pixels as ``resize(from_pil(image), size, resample)`` without
    copying the large image into a tensor first. Returns uint8 [3, *size] (a view of
    interleaved memory)."""
    resized = image.resize((size[1], size[0]), resample=resample)
    return from_pil(resized, "image", contiguous=False)
