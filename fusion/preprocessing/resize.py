"""Resizing 8-bit images in torch, bit for bit as Pillow resizes them.

Image processors of vision-language models resize with Pillow (``Image.resize``) before they
rescale and normalise, so matching their pixels means matching Pillow's integer arithmetic:
each output pixel is a weighted sum of input pixels, with the filter's weights normalised to sum
to one, rounded to 22-bit fixed point, and the sum rounded and clipped to 8 bits after each of
the two one-dimensional passes. Pillow 13 runs the vertical pass first when the height shrinks
by more than twice as many pixels as the width does, the horizontal pass first otherwise
(earlier Pillow versions always ran the horizontal pass first; results then differ by a level
or two at some pixels of such resizes).

Where Pillow is installed, :func:`resize` hands 1- and 3-channel images on the CPU to Pillow
itself (bit-identical by construction, and Pillow's C loops are the fastest way to these
pixels); the torch path serves other devices, other channel counts and machines without Pillow,
and is tested against Pillow bit for bit.
"""

import ctypes
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

from fusion.preprocessing.images import from_pil, is_pil_image

# Pillow's resampling filter numbers, which image processor configs store (``resample``).
NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING = 0, 1, 2, 3, 4, 5
_PRECISION_BITS = 22  # 32 bits, minus 8 for the value, minus 2 for overshoot and sign


def _box(x: float) -> float:
    return 1.0 if -0.5 < x <= 0.5 else 0.0


def _bilinear(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def _hamming(x: float) -> float:
    x = abs(x)
    if x == 0.0:
        return 1.0
    if x >= 1.0:
        return 0.0
    x = x * math.pi
    # Pillow's constants are single-precision floats (0.54f, 0.46f).
    return math.sin(x) / x * (_F32_054 + _F32_046 * math.cos(x))


def _bicubic(x: float) -> float:
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


def _lanczos(x: float) -> float:
    return _sinc(x) * _sinc(x / 3) if -3.0 <= x < 3.0 else 0.0


_F32_054 = float(torch.tensor(0.54, dtype=torch.float32))
_F32_046 = float(torch.tensor(0.46, dtype=torch.float32))
FILTERS: dict[int, tuple[Callable[[float], float], float]] = {
    BOX: (_box, 0.5),
    BILINEAR: (_bilinear, 1.0),
    HAMMING: (_hamming, 1.0),
    BICUBIC: (_bicubic, 2.0),
    LANCZOS: (_lanczos, 3.0),
}
FILTER_NAMES = {
    BOX: "box",
    BILINEAR: "bilinear",
    HAMMING: "hamming",
    BICUBIC: "bicubic",
    LANCZOS: "lanczos",
}


@functools.lru_cache(maxsize=64)
def _coefficients(in_size: int, out_size: int, resample: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each output position: the input indices [out, k] and fixed-point weights [out, k]
    (zero beyond each position's support), computed in Python's doubles in Pillow's order."""
    fn, support = FILTERS[resample]
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support *= filter_scale
    width = math.ceil(support) * 2 + 1
    inverse = 1.0 / filter_scale
    firsts, rows = [], []
    one = 1 << _PRECISION_BITS
    for out in range(out_size):  # Python floats: Pillow's doubles, in Pillow's order
        center = (out + 0.5) * scale
        first = max(int(center - support + 0.5), 0)
        count = min(int(center + support + 0.5), in_size) - first
        taps = [fn((i + first - center + 0.5) * inverse) for i in range(count)]
        total = 0.0
        for tap in taps:  # summed in order, as Pillow does
            total += tap
        if total != 0.0:
            taps = [tap / total for tap in taps]
        # Rounded half away from zero, as Pillow converts them.
        fixed = [int(tap * one - 0.5) if tap < 0 else int(tap * one + 0.5) for tap in taps]
        firsts.append(first)
        rows.append(fixed + [0] * (width - count))
    offsets = torch.arange(width)
    weights = torch.tensor(rows, dtype=torch.int32).view(out_size, width)
    # Positions beyond a row's count carry weight 0; their index is kept in range.
    indices = (torch.tensor(firsts)[:, None] + offsets).clamp_(max=in_size - 1)
    return indices, weights


def _weight_parts(weights: torch.Tensor) -> list[tuple[torch.Tensor, int]] | None:
    """The fixed-point weights [out, k] as float32 parts ``(part, shift)`` with ``weights ==
    sum(part << shift)``, each narrow enough that a sum of ``k`` products with 8-bit pixels
    stays below 2**24, where float32 holds every integer exactly (then any order of summation
    gives the exact sum). None when that takes more than 2 parts (filters of more than about 16
    taps, i.e. downscales by more than about 4): one float64 sum is then faster."""
    taps = max(int((weights != 0).sum(1).max()), 1)
    bits = math.floor(math.log2((1 << 24) / (255 * taps)))
    if bits < 1:  # tens of thousands of taps
        return None
    parts: list[tuple[torch.Tensor, int]] = []
    rest, shift = weights.to(torch.int64), 0
    while not bool((rest.abs() < (1 << bits)).all()):
        if len(parts) == 1:
            return None
        parts.append(((rest & ((1 << bits) - 1)).to(torch.float32), shift))  # low bits, >= 0
        rest, shift = rest >> bits, shift + bits  # floor: the rest keeps the sign
    return [*parts, (rest.to(torch.float32), shift)]


def _resample_first(image: torch.Tensor, out_size: int, resample: int) -> torch.Tensor:
    """Resample the first dimension of a uint8 tensor [n, ...] to ``out_size``: [out_size, ...].

    Each output row is the weighted sum of its input rows, computed for all filter taps at
    once by ``embedding_bag`` (a gather, multiply and sum in one kernel), exactly: in float32
    with the weights split into two parts whose sums stay below 2**24 (see
    :func:`_weight_parts`), or in float64 for wider filters (every product below 2**30, every
    sum below 2**53). So
    the result is Pillow's integer sum whatever the order of summation. Columns go through in
    blocks of about 2**21 input values, which bounds the copies whatever the image.
    """
    indices, weights = _coefficients(image.size(0), out_size, resample)
    parts = _weight_parts(weights)
    dtype = torch.float64 if parts is None else torch.float32
    if parts is None:
        parts = [(weights.to(torch.float64), 0)]
    rows = image.reshape(image.size(0), -1)
    out = torch.empty(out_size, rows.size(1), dtype=torch.uint8)
    step = max(16, (1 << 21) // rows.size(0))
    for start in range(0, rows.size(1), step):  # blocks of columns, not taps or rows
        table = rows[:, start : start + step].to(dtype)
        acc = torch.zeros(out_size, table.size(1), dtype=torch.float64)
        for part, shift in parts:  # at most 2
            summed = F.embedding_bag(indices, table, per_sample_weights=part, mode="sum")
            acc.add_(summed, alpha=float(1 << shift))
        # Rounded (Pillow's half), floor-divided by 2**22 and clipped, as Pillow's lookup
        # table does: exact in float64, as every value is an integer below 2**53.
        acc.add_(1 << (_PRECISION_BITS - 1)).mul_(2.0**-_PRECISION_BITS).floor_().clamp_(0, 255)
        out[:, start : start + step] = acc
    return out.view(out_size, *image.shape[1:])


BACKENDS = ("auto", "pillow", "torch")


def resize(
    image: torch.Tensor,
    size: tuple[int, int],
    resample: int = BICUBIC,
    *,
    backend: Literal["auto", "pillow", "torch"] = "auto",
) -> torch.Tensor:
    """Resize an 8-bit image as Pillow's ``Image.resize(size[::-1], resample)`` does.

    Args:
        image: uint8 [channels, height, width] (each channel is resized alone, as Pillow
            resizes each band of an RGB or L image).
        size: (height, width) of the output, each >= 1.
        resample: :data:`BOX`, :data:`BILINEAR`, :data:`HAMMING`, :data:`BICUBIC` or
            :data:`LANCZOS` (Pillow's numbers).
        backend: ``"pillow"``: Pillow's own ``Image.resize`` (1 or 3 channels on the CPU);
            ``"torch"``: the vectorised torch resampling (any channel count and device);
            ``"auto"``: Pillow where it is installed and the image qualifies, torch otherwise.
            Both give the same bytes.

    Returns:
        uint8 [channels, height, width] on ``image``'s device (from Pillow: a view of
        interleaved [height, width, channels] memory); a copy when the size is unchanged.

    Raises:
        TypeError: ``image`` not a tensor.
        ValueError: ``image`` not uint8 [c, h, w] with h, w >= 1; ``size`` not two integers
            >= 1; an unsupported filter (e.g. nearest); an unknown ``backend``, or
            ``"pillow"`` for an image it cannot take (not 1 or 3 channels, not on the CPU).
        ImportError: ``backend="pillow"`` without Pillow installed.
    """
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"image: expected a uint8 tensor [c, h, w], got {type(image).__name__}")
    if image.dtype != torch.uint8 or image.dim() != 3 or min(image.shape[1:], default=0) < 1:
        raise ValueError(
            f"image: expected a uint8 tensor [c, h, w], got shape {list(image.shape)}, dtype "
            f"{image.dtype}"
        )
    if (
        not isinstance(size, tuple | list)
        or len(size) != 2
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in size)
    ):
        raise ValueError(f"size: expected (height, width), two integers >= 1, got {size!r}")
    if resample not in FILTERS:
        names = ", ".join(f"{n} ({FILTER_NAMES[n]})" for n in sorted(FILTERS))
        raise ValueError(f"resample: expected one of {names}, got {resample!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    # Pillow premultiplies alpha (RGBA) and has no 2-band 8-bit mode: 1 or 3 channels only.
    pillow_fits = image.device.type == "cpu" and image.size(0) in (1, 3)
    if backend == "pillow":
        if not pillow_fits:
            raise ValueError(
                "backend: 'pillow' takes 1 or 3 channels on the CPU, got shape "
                f"{list(image.shape)} on {image.device}"
            )
        if _pillow_image() is None:
            raise ImportError("backend='pillow' needs Pillow: pip install pillow")
    if backend == "pillow" or (backend == "auto" and pillow_fits and _pillow_image()):
        return _resize_pillow(image, size, resample)
    height, width = size
    in_height, in_width = image.shape[1:]
    vertical_first = height < in_height and in_height - height > 2 * (in_width - width)
    # Each pass resamples the first dimension of a [size, ...] view (one uint8 copy each).
    out = image.cpu()
    if vertical_first and height != in_height:
        out = _resample_first(out.transpose(0, 1), height, resample).transpose(0, 1)
    if width != in_width:
        out = _resample_first(out.permute(2, 0, 1), width, resample).permute(1, 2, 0)
    if not vertical_first and height != in_height:
        out = _resample_first(out.transpose(0, 1), height, resample).transpose(0, 1)
    return out.contiguous().clone() if out is image else out.contiguous().to(image.device)


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
        and resample in FILTERS
    )


def resize_pillow_image(image: Any, size: tuple[int, int], resample: int) -> torch.Tensor:
    """A Pillow RGB image (see :func:`resizes_as_pillow_image`) resized by Pillow before it
    becomes a tensor: the same pixels as ``resize(from_pil(image), size, resample)`` without
    copying the large image into a tensor first. Returns uint8 [3, *size] (a view of
    interleaved memory)."""
    resized = image.resize((size[1], size[0]), resample=resample)
    return from_pil(resized, "image", contiguous=False)
