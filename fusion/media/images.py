"""Images in: decoding (Pillow, an optional extra, imported only here and only when called),
then everything in torch: 8-bit RGB, alpha over white, rescale and normalise.

Decoding keeps what a file holds: :func:`load_image` applies the EXIF orientation and converts
palette, bilevel, CMYK and YCbCr images to RGB (or RGBA when they carry transparency), as
Hugging Face's processors do before anything else. Images of more than 8 bits per channel are
refused rather than clipped.
"""

import contextlib
import io
import os
import struct
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fusion._io import NotRegularFile, open_regular
from fusion._validation import check_int

# Pillow modes decoding takes: 8 bits per channel.
DECODABLE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)
PILLOW_MAX_PIXELS = 1024 * 1024 * 1024 // 4 // 3  # Pillow's default bomb limit: 89,478,485
# decode_image's cap on encoded bytes: a PNG of PILLOW_MAX_PIXELS RGB pixels stored raw is
# about 256 MiB; real images are a few megabytes at most.
MAX_IMAGE_BYTES = 256 * 2**20


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


def from_pil(image: Any, name: str = "image", *, contiguous: bool = True) -> torch.Tensor:
    """A Pillow image as a uint8 tensor [channels, height, width]: [3] RGB, [4] RGBA (images
    with an alpha band or a transparent colour), [1] for grayscale ``L``. Other 8-bit modes are
    converted to RGB or RGBA by Pillow (a palette lookup, CMYK or YCbCr to RGB).

    ``contiguous=False`` returns a view of Pillow's interleaved [height, width, channels]
    bytes (one copy fewer; what the processors take, as Pillow's resize reads that layout).

    Raises:
        TypeError: not a Pillow image.
        ValueError: a mode the processors cannot take (more than 8 bits per channel, e.g.
            ``I;16`` or ``F``, or an unusual one), named with those that are taken.
    """
    if not is_pil_image(image):
        raise TypeError(f"{name}: expected a Pillow image, got {type(image).__name__}")
    check_pil_mode(image, name)
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        image = image.convert("RGBA")
    elif image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    channels = len(image.getbands())
    pixels = data.view(image.height, image.width, channels).permute(2, 0, 1)
    return pixels.contiguous() if contiguous else pixels


def check_pil_mode(image: Any, name: str = "image") -> None:
    """Raise ``ValueError`` (naming ``name``) unless the Pillow image's mode is one
    :func:`from_pil` takes: checked before anything is converted."""
    if image.mode not in DECODABLE_MODES:
        raise ValueError(
            f"{name}: Pillow mode {image.mode!r} cannot be taken (16-bit, 32-bit or float "
            f"pixels would have to be clipped); expected one of {list(DECODABLE_MODES)}"
        )


def default_max_pixels() -> int:
    """The pixel cap applied by default (:func:`load_image`, the image processors): Pillow's
    own decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``, 89,478,485 unless changed),
    or :data:`PILLOW_MAX_PIXELS` when Pillow is not loaded or its check is switched off."""
    module = sys.modules.get("PIL.Image")
    limit = getattr(module, "MAX_IMAGE_PIXELS", None)
    return PILLOW_MAX_PIXELS if limit is None else int(limit)


def check_max_pixels(max_pixels: int | None, name: str = "max_pixels") -> int:
    """``max_pixels`` checked (a positive integer), or the default cap when None."""
    if max_pixels is None:
        return default_max_pixels()
    return check_int(max_pixels, name, low=1, expected="a positive integer or None")


def load_image(path: str | bytes | os.PathLike, *, max_pixels: int | None = None) -> torch.Tensor:
    """Decode an image file (any format Pillow reads; the first frame of an animation) to a
    uint8 tensor as :func:`from_pil` describes, after applying its EXIF orientation.

    The pixel count is checked from the file's header, before anything is decoded: a small
    file can declare an image of gigabytes.

    Args:
        path: the file.
        max_pixels: the largest width * height taken; None: :func:`default_max_pixels`
            (Pillow's decompression-bomb limit). Raise it to take larger images (Pillow's own
            check is then lifted to match, while the file is opened).

    Raises:
        ImportError: Pillow is not installed.
        ValueError: naming the file: it cannot be read (missing, a directory, no permission),
            it is not an image Pillow can decode, it is truncated or corrupt, it declares more
            than ``max_pixels`` pixels, or its mode cannot be taken; ``max_pixels`` not a
            positive integer.
    """
    _pil()  # ImportError before the file is opened
    limit = check_max_pixels(max_pixels)
    path = os.fsdecode(path)
    where = f"image {path!r}"
    try:
        handle = open_regular(path)  # a FIFO or device would block or never end
    except NotRegularFile:
        raise ValueError(f"{where}: not a regular file (a directory, FIFO or device)") from None
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except OSError as error:
        raise ValueError(f"{where}: cannot be read: {error.strerror or error}") from None
    with handle:
        return _decode(handle, where, limit)


def decode_image(
    data: bytes | bytearray,
    name: str = "image",
    *,
    max_pixels: int | None = None,
    max_bytes: int = MAX_IMAGE_BYTES,
) -> torch.Tensor:
    """Decode an encoded image held in memory (the bytes of a PNG, JPEG, ... file, e.g. an
    image embedded in a data set) as :func:`load_image` decodes a file: the same formats,
    checks, EXIF orientation and result.

    The bytes are untrusted: their size is checked before anything is parsed (at most
    ``max_bytes``), then the pixel count from the header, before anything is decoded
    (Pillow's decompression-bomb guard, as for a file).

    Args:
        data: the encoded image.
        name: what errors call it (e.g. ``"train.parquet:row 3: images[0]"``).
        max_pixels: as :func:`load_image`.
        max_bytes: the largest encoded size taken (default :data:`MAX_IMAGE_BYTES`).

    Raises:
        ImportError: Pillow is not installed.
        TypeError: ``data`` not bytes.
        ValueError: naming ``name``: empty, more than ``max_bytes`` bytes, not an image Pillow
            can decode, truncated or corrupt, more than ``max_pixels`` pixels, or a mode that
            cannot be taken; ``max_pixels`` / ``max_bytes`` not positive integers.
    """
    if not isinstance(data, bytes | bytearray):
        raise TypeError(f"{name}: expected the encoded image as bytes, got {type(data).__name__}")
    check_int(max_bytes, "max_bytes", low=1)
    limit = check_max_pixels(max_pixels)
    if not data:
        raise ValueError(f"{name}: empty (no image data)")
    if len(data) > max_bytes:
        raise ValueError(
            f"{name}: {len(data)} bytes of encoded image, more than max_bytes={max_bytes}: "
            "refused before decoding"
        )
    _pil()
    return _decode(io.BytesIO(data), name, limit)


def _decode(handle: Any, where: str, limit: int) -> torch.Tensor:
    """Decode the image file open in ``handle`` (a binary file object), its pixel count
    checked against ``limit`` from the header first; errors name ``where``."""
    Image, ImageOps = _pil()
    try:
        with _pillow_limit(Image, limit), Image.open(handle) as opened:
            width, height = opened.size  # from the header: nothing decoded yet
            if width * height > limit:
                raise _TooLarge(
                    f"{where}: {width} x {height} = {width * height} pixels, more than "
                    f"max_pixels={limit} (a decompression bomb, or pass a larger max_pixels)"
                )
            opened.load()
            image = ImageOps.exif_transpose(opened)
    except _TooLarge as error:
        raise ValueError(str(error)) from None
    except Image.DecompressionBombError as error:  # Pillow's check, before ours could run
        raise ValueError(
            f"{where}: more than max_pixels={limit} pixels (a decompression bomb, or pass a "
            f"larger max_pixels): {error}"
        ) from None
    except Image.UnidentifiedImageError as error:
        raise ValueError(f"{where}: not an image Pillow can decode: {error}") from None
    except OSError as error:  # truncated or corrupt data, a failing disk
        raise ValueError(f"{where}: cannot be decoded: {error.strerror or error}") from None
    except (SyntaxError, ValueError, EOFError, IndexError, struct.error) as error:
        # Pillow's decoders report corrupt data with these too.
        raise ValueError(f"{where}: corrupt image data: {type(error).__name__}: {error}") from None
    return from_pil(image, where)


class _TooLarge(Exception):
    """Our own pixel cap, kept apart from the errors Pillow raises."""


_PILLOW_LIMIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _pillow_limit(Image: Any, limit: int) -> Iterator[None]:
    """Pillow's bomb check (a module global it applies while opening) lifted to ``limit`` when
    that is above it, and its ``DecompressionBombWarning`` silenced: our check from the header
    replaces both."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        current = Image.MAX_IMAGE_PIXELS
        if current is None or limit <= current:
            yield
            return
        with _PILLOW_LIMIT_LOCK:
            Image.MAX_IMAGE_PIXELS = limit
            try:
                yield
            finally:
                Image.MAX_IMAGE_PIXELS = current


def image_size(image: object, name: str = "image") -> tuple[int, int]:
    """(height, width) of a uint8 tensor [c, h, w] or a Pillow image, without converting it.

    Raises:
        TypeError, ValueError: as :func:`as_uint8_image`, for a tensor.
    """
    if is_pil_image(image):
        return image.height, image.width  # type: ignore[attr-defined]
    tensor = as_uint8_image(image, name)
    return tensor.size(1), tensor.size(2)


def check_pixels(sizes: Sequence[tuple[int, int]], max_pixels: int, name: str = "image") -> None:
    """Raise ``ValueError`` (naming ``name``) if any of ``sizes`` (an image as given, then as
    each processing step makes it) holds more than ``max_pixels`` pixels: checked before the
    work, from arithmetic only."""
    for step, (height, width) in enumerate(sizes):
        if height * width > max_pixels:
            what = "is" if step == 0 else "would be processed to"
            raise ValueError(
                f"{name}: {what} {height} x {width} = {height * width} pixels, more than "
                f"max_pixels={max_pixels}"
            )


def as_uint8_image(image: object, name: str = "image") -> torch.Tensor:
    """``image`` (a Pillow image, or a uint8 tensor [1, 3 or 4, h, w]) as a tensor.

    Raises:
        TypeError: neither a tensor nor a Pillow image.
        ValueError: a tensor of another dtype or shape, an empty image, or a Pillow mode
            :func:`from_pil` refuses.
    """
    if is_pil_image(image):
        return from_pil(image, name, contiguous=False)
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


def rescale_normalize(
    image: torch.Tensor,
    factor: float,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 [c, h, w] -> float32 [c, h, w] (contiguous): :func:`rescale` by ``factor``, then
    :func:`normalize` with ``mean`` and ``std`` unless they are None, in one pass: an 8-bit
    channel takes 256 values, so the two steps run on those (the same arithmetic, the same
    bits) and each pixel looks its value up in the table [c, 256].

    Args:
        out: a contiguous float32 [c, h, w] to write into (e.g. one row of a stacked batch).
    """
    channels = image.size(0)
    levels = torch.arange(256, dtype=torch.uint8).expand(channels, 1, 256)
    table = rescale(levels, factor)
    if mean is not None and std is not None:
        table = normalize(table, mean, std)
    table = table.reshape(channels, 256).to(image.device)
    if out is None:
        out = torch.empty(image.shape, dtype=torch.float32, device=image.device)
    index = image.to(torch.int32).contiguous()  # 4 bytes a pixel, not int64's 8
    for c in range(channels):
        torch.index_select(table[c], 0, index[c].view(-1), out=out[c].view(-1))
    return out


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
