"""Video in: a clip file decoded with PyAV (the ``video`` extra), a list or directory of frame
images, or frames already decoded, sampled as transformers 5.24's video processors sample
them, and checked against caller-set bounds before anything is decoded.

PyAV is the decoder because its wheels carry their own FFmpeg build (nothing to install on the
system, the same codecs everywhere) and it installs on any torch: torchcodec is built against
one torch release and loads FFmpeg from the system. PyAV is imported only when a clip file is
read, here only.

A clip file is opened, its container header read (size, frame count, frame rate, duration)
and checked against :class:`VideoBounds`, then its packets are listed (demuxed, not decoded)
to map frame indices to presentation times; only the frames kept by the sampler are decoded,
seeking to the key frame before each one when it is not reached by decoding on. A truncated
file, a file that is not a video, absurd dimensions or a claimed frame count past the bounds
raise :class:`VideoError` naming the file. Reading never runs code from a file: FFmpeg parses
its bytes, nothing is unpickled or imported; FFmpeg is handed the open file, not its name, so
a playlist (HLS, ffconcat) naming other files or URLs cannot make it open them.

    video = load_video("clip.mp4", sampler=processor.sampler)
    video.frames                  # uint8 [t, 3, h, w], the kept frames
    video.metadata.frames_indices # which frames of the clip they are
"""

import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from fusion._io import NotRegularFile, open_regular
from fusion._validation import check_int, is_int
from fusion.errors import FusionError
from fusion.media.images import is_pil_image, load_image

EXTRA = "pip install 'torch-early-fusion[video]'"
# The frame files a directory of frames is read for (LLaVA-Video-style data sets store JPEGs).
FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
# The frame rate transformers assumes for a clip without one (VideoMetadata.sampled_fps).
DEFAULT_FPS = 24.0


class VideoError(FusionError, ValueError):
    """A clip that cannot be taken: not a video, truncated or corrupt, or past the
    :class:`VideoBounds`. The message names the file (or the argument).

    Attributes:
        file: the clip's path, or the argument's name for frames given in memory.
    """

    def __init__(self, file: str, message: str) -> None:
        self.file = file
        super().__init__(f"{file}: {message}")


@dataclass(frozen=True)
class VideoBounds:
    """The largest clip read, checked from the container header before any frame is decoded.

    Attributes:
        max_width, max_height: the largest frame sides in pixels (default 8192: 8K video).
        max_frames: the most frames a clip may hold (default 100,000: about an hour at 30 fps);
            a clip claiming more is refused before its packets are listed.
        max_duration: the longest clip in seconds (default 4 hours).
        max_file_bytes: the largest clip file (default 8 GiB).
        max_decoded_bytes: the most bytes the kept frames may take decoded (``t * 3 * h *
            w``; default 4 GiB: 690 frames of 1080p), checked after sampling, before the
            frames are allocated.
    """

    max_width: int = 8192
    max_height: int = 8192
    max_frames: int = 100_000
    max_duration: float = 4 * 3600.0
    max_file_bytes: int = 8 * 2**30
    max_decoded_bytes: int = 4 * 2**30

    def __post_init__(self) -> None:
        for name in (
            "max_width",
            "max_height",
            "max_frames",
            "max_file_bytes",
            "max_decoded_bytes",
        ):
            check_int(getattr(self, name), name, low=1)
        duration = self.max_duration
        if isinstance(duration, bool) or not isinstance(duration, int | float) or not (
            0 < duration < math.inf
        ):  # fmt: skip
            raise ValueError(
                f"max_duration: expected a positive number of seconds, got {duration!r}"
            )

    def check(self, where: str, width: int, height: int, frames: int, duration: float) -> None:
        """Raise :class:`VideoError` naming ``where`` when a clip's size is past the bounds."""
        if not (0 < width <= self.max_width and 0 < height <= self.max_height):
            raise VideoError(
                where,
                f"frames of {width} x {height} pixels: expected sides in [1, {self.max_width}] x "
                f"[1, {self.max_height}] (VideoBounds max_width, max_height)",
            )
        if frames > self.max_frames:
            raise VideoError(
                where,
                f"claims {frames} frames, more than max_frames={self.max_frames} (VideoBounds): "
                "refused before decoding",
            )
        if not duration <= self.max_duration:  # NaN too
            raise VideoError(
                where,
                f"lasts {duration} seconds, more than max_duration={self.max_duration} "
                "(VideoBounds): refused before decoding",
            )


@dataclass(frozen=True)
class VideoMetadata:
    """What is known of a clip, as transformers' ``VideoMetadata`` keeps it.

    Attributes:
        total_num_frames: the clip's frames (before sampling).
        fps: its frame rate (the stream's average rate), None when unknown (frames given
            without one).
        width, height: its frame size.
        duration: seconds, ``total_num_frames / fps`` (None without a frame rate).
        frames_indices: the indices of the frames kept, in order.
        video_backend: ``"pyav"`` for a decoded file, ``"frames"`` otherwise.
    """

    total_num_frames: int
    fps: float | None
    width: int
    height: int
    duration: float | None
    frames_indices: tuple[int, ...]
    video_backend: str = "frames"

    @property
    def timestamps(self) -> list[float]:
        """Each kept frame's time in seconds (``index / fps``), as transformers computes it.

        Raises:
            ValueError: the clip has no frame rate.
        """
        if self.fps is None:
            raise ValueError("timestamps: the clip has no frame rate (pass fps= with its frames)")
        return [index / self.fps for index in self.frames_indices]

    @property
    def sampled_fps(self) -> float:
        """The frame rate of the kept frames, ``len(kept) / total * fps`` (transformers' rule:
        :data:`DEFAULT_FPS`, 24, for a clip without a frame rate)."""
        if self.fps is None:
            return DEFAULT_FPS
        return len(self.frames_indices) / self.total_num_frames * self.fps

    def as_transformers(self) -> dict[str, Any]:
        """These fields as the dict transformers' ``VideoMetadata(**...)`` takes."""
        return {
            "total_num_frames": self.total_num_frames,
            "fps": self.fps,
            "width": self.width,
            "height": self.height,
            "duration": self.duration,
            "video_backend": None if self.video_backend == "frames" else self.video_backend,
            "frames_indices": list(self.frames_indices),
        }


@dataclass(frozen=True)
class Video:
    """Decoded frames and their clip's metadata.

    Attributes:
        frames: uint8 [t, 3, h, w], RGB, the kept frames in order.
        metadata: :class:`VideoMetadata`; ``frames_indices`` has ``t`` entries.
    """

    frames: torch.Tensor
    metadata: VideoMetadata = field(repr=False)


# A sampler: the clip's metadata (frames_indices unset: every frame) -> the indices to keep.
Sampler = Callable[[VideoMetadata], Sequence[int]]


def default_sample_indices(
    metadata: VideoMetadata, num_frames: int | None = None, fps: float | None = None
) -> list[int]:
    """transformers' ``default_sample_indices_fn``: ``num_frames`` evenly spaced frames
    (``i * total // num_frames``), or ``fps`` frames a second of the clip (at least one), or
    every frame.

    Raises:
        ValueError: both ``num_frames`` and ``fps``; ``fps`` for a clip without a frame rate;
            more frames asked for than the clip holds.
    """
    total = metadata.total_num_frames
    if num_frames is not None and fps is not None:
        raise ValueError(f"num_frames, fps: give one, got num_frames={num_frames}, fps={fps}")
    if num_frames is None and fps is not None:
        check_fps(fps, "fps")
        num_frames = max(1, int(total / clip_fps(metadata) * fps))
    if num_frames is None:
        return list(range(total))
    check_int(num_frames, "num_frames", low=1)
    check_sample_count(num_frames, total)
    return [i * total // num_frames for i in range(num_frames)]


def check_fps(fps: object, name: str) -> float:
    """``fps`` as a float if a positive finite number; else ``ValueError`` naming ``name``."""
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps < math.inf:
        raise ValueError(f"{name}: expected a positive number of frames a second, got {fps!r}")
    return float(fps)


def clip_fps(metadata: VideoMetadata) -> float:
    """The clip's frame rate, which sampling a number of frames a second needs."""
    if metadata.fps is None:
        raise ValueError(
            "fps: sampling a number of frames a second needs the clip's own frame rate; these "
            "frames came without one (pass fps= with them, or sample num_frames)"
        )
    return metadata.fps


def check_sample_count(num_frames: int, total: int) -> None:
    """Refuse sampling more frames than the clip holds, as transformers refuses it."""
    if num_frames > total:
        raise ValueError(
            f"num_frames: {num_frames} frames asked for, but the clip holds {total} (ask for "
            "fewer, or a lower fps)"
        )


def load_video(
    source: object,
    *,
    sampler: Sampler | None = None,
    fps: float | None = None,
    bounds: VideoBounds | None = None,
) -> Video:
    """A clip's kept frames and metadata.

    Args:
        source: a clip file (a path to any container FFmpeg reads: MP4, MKV, WebM, AVI, ...);
            a directory of frame images (files ending in :data:`FRAME_SUFFIXES`, in natural
            order: ``frame_2`` before ``frame_10``); a list of frame image paths; a uint8
            tensor [t, 3, h, w]; or a list of Pillow images.
        sampler: which frames to keep, from the clip's metadata (e.g. a video processor's
            ``sampler``); None keeps every frame. Indices in order; one may repeat.
        fps: the frame rate of frames given as images or tensors (a file's is read from it).
        bounds: :class:`VideoBounds` (default: its defaults), checked before decoding.

    Returns:
        :class:`Video`: only the kept frames are decoded (frame files outside the sample are
        never decoded, only their headers read).

    Raises:
        ImportError: a clip file without PyAV installed (one line naming the extra).
        TypeError: ``source`` or ``bounds`` of another kind.
        VideoError: naming the file: past the bounds, not a video, truncated or corrupt,
            frames of different sizes or with transparency; a sampler's indices out of order
            or range.
        ValueError: ``fps`` not valid; a sampler's own refusal (e.g. more frames asked for
            than the clip holds).
    """
    bounds = VideoBounds() if bounds is None else bounds
    with _opened(source, fps, bounds) as (metadata, decode, where):
        metadata = _sample(metadata, sampler, where)
        size = len(metadata.frames_indices) * 3 * metadata.height * metadata.width
        if size > bounds.max_decoded_bytes:
            raise VideoError(
                where,
                f"{len(metadata.frames_indices)} frames of {metadata.width} x {metadata.height} "
                f"kept would take {size} bytes decoded, more than max_decoded_bytes="
                f"{bounds.max_decoded_bytes} (VideoBounds): sample fewer frames",
            )
        return Video(decode(metadata.frames_indices), metadata)


def probe_video(
    source: object, *, fps: float | None = None, bounds: VideoBounds | None = None
) -> VideoMetadata:
    """A clip's metadata (``frames_indices``: every frame), read and checked as
    :func:`load_video` reads it, without decoding a frame: what a caller needs to know the
    rows a video brings (e.g. ``processor.rows(len(processor.sample_frames(metadata)),
    metadata.height, metadata.width)``) before deciding to decode it.

    Raises:
        As :func:`load_video`.
    """
    with _opened(source, fps, bounds) as (metadata, _, where):
        return _sample(metadata, None, where)


# What _opened gives: the clip's metadata (frames_indices empty), a function decoding the
# frames at the given indices to uint8 [n, 3, h, w], and the name errors give the clip.
Decode = Callable[[Sequence[int]], torch.Tensor]


@contextmanager
def _opened(
    source: object, fps: float | None, bounds: VideoBounds | None
) -> Iterator[tuple[VideoMetadata, Decode, str]]:
    """The clip ``source`` opened, its size checked against ``bounds``; a file stays open
    for decoding until the block ends."""
    bounds = VideoBounds() if bounds is None else bounds
    if not isinstance(bounds, VideoBounds):
        raise TypeError(f"bounds: expected a VideoBounds, got {type(bounds).__name__}")
    if fps is not None:
        fps = check_fps(fps, "fps")
    if isinstance(source, str | os.PathLike):
        path = Path(os.fsdecode(source))
        if path.is_dir():
            yield (*_frame_files_opened(_frame_files(path), str(path), fps, bounds), str(path))
            return
        if fps is not None:
            raise ValueError(f"fps: a clip file's frame rate is read from it, got fps={fps}")
        with _clip_opened(path, bounds) as opened:
            yield (*opened, str(path))
        return
    if isinstance(source, torch.Tensor):
        yield (*_tensor_opened(source, fps, bounds), "frames")
        return
    if isinstance(source, Sequence) and not isinstance(source, bytes | bytearray) and source:
        if all(isinstance(item, str | os.PathLike) for item in source):
            yield (*_frame_files_opened(list(source), "frames", fps, bounds), "frames")
            return
        if all(is_pil_image(item) for item in source):
            yield (*_pil_opened(source, fps, bounds), "frames")
            return
    raise TypeError(
        "source: expected a clip file, a directory or non-empty list of frame images, a uint8 "
        f"tensor [t, 3, h, w] or a non-empty list of Pillow images, got {_kind(source)}"
    )


def _kind(value: object) -> str:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return f"a {type(value).__name__} of {len(value)} items" if value else "an empty list"
    return type(value).__name__


def _sample(metadata: VideoMetadata, sampler: Sampler | None, where: str) -> VideoMetadata:
    """``metadata`` with the sampler's indices, checked: in order (a frame may repeat, as
    transformers' indexing repeats it), within the clip."""
    total = metadata.total_num_frames
    if sampler is None:
        return replace(metadata, frames_indices=tuple(range(total)))
    indices = [int(i) if isinstance(i, torch.Tensor) else i for i in sampler(metadata)]
    if not indices or not all(is_int(i, 0, total - 1) for i in indices):
        raise VideoError(
            where,
            f"the sampler gave frame indices {_short(indices)}: expected at least one, each in "
            f"[0, {total - 1}]",
        )
    if any(b < a for a, b in pairwise(indices)):
        raise VideoError(where, f"the sampler gave frame indices {_short(indices)}: not in order")
    return replace(metadata, frames_indices=tuple(indices))


def _short(values: Sequence[object]) -> str:
    return repr(list(values)) if len(values) <= 8 else f"[{values[0]!r}, ..., {values[-1]!r}]"


def _checked_metadata(
    where: str, frames: int, fps: float | None, width: int, height: int, bounds: VideoBounds
) -> VideoMetadata:
    """The metadata of ``frames`` frames given as images or tensors, within ``bounds``."""
    duration = None if fps is None else frames / fps
    bounds.check(where, width, height, frames, duration or 0.0)
    return VideoMetadata(frames, fps, width, height, duration, ())


def _tensor_opened(
    frames: torch.Tensor, fps: float | None, bounds: VideoBounds
) -> tuple[VideoMetadata, Decode]:
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[1] != 3:
        raise VideoError(
            "frames",
            f"expected a uint8 tensor [t, 3, h, w] (RGB), got {frames.dtype} {list(frames.shape)}",
        )
    t, _, height, width = frames.shape
    if t == 0:
        raise VideoError("frames", "no frames (t = 0)")
    metadata = _checked_metadata("frames", t, fps, width, height, bounds)
    return metadata, lambda indices: frames[list(indices)]


def _pil_opened(
    images: Sequence[Any], fps: float | None, bounds: VideoBounds
) -> tuple[VideoMetadata, Decode]:
    sizes = {image.size for image in images}
    if len(sizes) > 1:
        raise VideoError("frames", f"frames of different sizes (width, height): {sorted(sizes)}")
    (width, height) = sizes.pop()
    metadata = _checked_metadata("frames", len(images), fps, width, height, bounds)

    def decode(indices: Sequence[int]) -> torch.Tensor:
        return torch.stack([_rgb(images[i], f"frames[{i}]") for i in indices])

    return metadata, decode


def _rgb(image: Any, name: str) -> torch.Tensor:
    """A frame image as uint8 [3, h, w]: palette, grey, CMYK, ... converted to RGB by Pillow;
    a frame with transparency refused (a clip has none; flatten it first)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        raise VideoError(name, f"a frame with transparency (mode {image.mode!r}): flatten it first")
    if image.mode != "RGB":
        image = image.convert("RGB")
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return data.view(image.height, image.width, 3).permute(2, 0, 1)


def _natural_key(name: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _frame_files(directory: Path) -> list[Path]:
    files = [
        entry
        for entry in directory.iterdir()
        if entry.suffix.lower() in FRAME_SUFFIXES and entry.is_file()
    ]
    if not files:
        raise VideoError(
            str(directory), f"a directory without frame images (files ending {FRAME_SUFFIXES})"
        )
    return sorted(files, key=lambda entry: _natural_key(entry.name))


def _frame_files_opened(
    files: Sequence[str | os.PathLike], where: str, fps: float | None, bounds: VideoBounds
) -> tuple[VideoMetadata, Decode]:
    from PIL import Image  # the vision extra; load_image says so when it is missing

    if len(files) > bounds.max_frames:
        raise VideoError(
            where,
            f"{len(files)} frame files, more than max_frames={bounds.max_frames} (VideoBounds)",
        )
    # Every frame's size from its header (nothing decoded): the sampler needs the count and
    # the frames must share one size.
    sizes = []
    for file in files:
        name = os.fsdecode(file)
        try:
            with open_regular(name) as handle, Image.open(handle) as opened:
                sizes.append(opened.size)
        except (OSError, Image.DecompressionBombError) as error:  # not an image, a bomb
            raise VideoError(name, f"not a readable frame image ({error})") from None
    if len(set(sizes)) > 1:
        first = sizes[0]
        other = next(i for i, size in enumerate(sizes) if size != first)
        raise VideoError(
            os.fsdecode(files[other]),
            f"a frame of {sizes[other][0]} x {sizes[other][1]} pixels, but the first frame "
            f"({os.fsdecode(files[0])}) is {first[0]} x {first[1]}: a clip's frames share one size",
        )
    width, height = sizes[0]
    metadata = _checked_metadata(where, len(files), fps, width, height, bounds)

    def decode(indices: Sequence[int]) -> torch.Tensor:
        kept = []
        for i in indices:
            name = os.fsdecode(files[i])
            pixels = load_image(name, max_pixels=width * height)  # its EXIF orientation applied
            if pixels.shape[0] == 4:
                raise VideoError(name, "a frame with transparency: flatten it first")
            kept.append(pixels.expand(3, -1, -1) if pixels.shape[0] == 1 else pixels)
        return torch.stack(kept)

    return metadata, decode


def _av() -> Any:
    try:
        import av
    except ImportError:
        raise ImportError(f"reading video files needs PyAV: {EXTRA}") from None
    return av


@contextmanager
def _clip_opened(path: Path, bounds: VideoBounds) -> Iterator[tuple[VideoMetadata, Decode]]:
    av = _av()  # ImportError before the file is opened
    where = str(path)
    try:
        handle = open_regular(path)  # a FIFO or device would block or never end
    except NotRegularFile:
        raise VideoError(where, "not a regular file (a FIFO, device or socket)") from None
    except FileNotFoundError:
        raise VideoError(where, "no such file") from None
    except OSError as error:
        raise VideoError(where, f"cannot be read: {error.strerror or error}") from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if size > bounds.max_file_bytes:
            raise VideoError(
                where,
                f"{size} bytes, more than max_file_bytes={bounds.max_file_bytes} (VideoBounds)",
            )
        if size == 0:
            raise VideoError(where, "an empty file")
        try:
            with av.open(handle, mode="r") as container:
                index = _ClipIndex.read(container, where, bounds)
                yield index.metadata, index.decode
        except av.FFmpegError as error:
            raise VideoError(where, f"not a readable video (FFmpeg: {error})") from None


@dataclass
class _ClipIndex:
    """An open clip's frames: presentation times in order, which are key frames, and the
    metadata; decodes the frames asked for by seeking."""

    container: Any
    stream: Any
    where: str
    times: list[int]
    key_indices: list[int]
    metadata: VideoMetadata

    @classmethod
    def read(cls, container: Any, where: str, bounds: VideoBounds) -> "_ClipIndex":
        """The clip's header checked against ``bounds``, then its packets listed (read, not
        decoded), at most ``max_frames`` of them."""
        if not container.streams.video:
            raise VideoError(where, f"no video stream (format {container.format.name!r})")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        claimed = stream.frames  # the header's count (0: not recorded), transformers' total
        rate = stream.average_rate
        fps = float(rate) if rate else None
        if stream.duration is not None and stream.time_base:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / 1_000_000  # AV_TIME_BASE
        else:
            seconds = 0.0
        if claimed and fps:
            seconds = max(seconds, claimed / fps)
        bounds.check(where, width, height, claimed, seconds)
        # The frames' presentation times from the packets: a container that under-claims its
        # frames is stopped at max_frames all the same.
        times: list[int] = []
        keys: list[int] = []
        for packet in container.demux(stream):
            if packet.pts is None or packet.size == 0:
                continue  # the flush packet
            if packet.is_keyframe:
                keys.append(packet.pts)
            times.append(packet.pts)
            if len(times) > bounds.max_frames:
                raise VideoError(
                    where, f"holds more than max_frames={bounds.max_frames} frames (VideoBounds)"
                )
        times.sort()
        if not times:
            raise VideoError(where, "no video frames")
        if claimed and claimed != len(times):
            raise VideoError(
                where,
                f"the header claims {claimed} frames but the file holds {len(times)}: "
                "truncated or corrupt",
            )
        position = {pts: i for i, pts in enumerate(times)}
        key_indices = sorted(position[pts] for pts in keys if pts in position)
        duration = len(times) / fps if fps else 0.0
        metadata = VideoMetadata(len(times), fps, width, height, duration, (), "pyav")
        return cls(container, stream, where, times, key_indices, metadata)

    def decode(self, indices: Sequence[int]) -> torch.Tensor:
        """The frames at ``indices`` (in order) as uint8 [n, 3, h, w]: each reached by
        decoding on from the last one decoded when the key frame before it is no further than
        the next frame, else by seeking to that key frame."""
        width, height = self.metadata.width, self.metadata.height
        index_of = {pts: i for i, pts in enumerate(self.times)}
        frames = torch.empty(len(indices), 3, height, width, dtype=torch.uint8)
        decoder = None
        position = -1  # the index of the last frame decoded
        frame = None
        for slot, target in enumerate(indices):
            if slot and target == position:
                frames[slot] = frames[slot - 1]  # a repeated index
                continue
            key = max((k for k in self.key_indices if k <= target), default=0)
            if decoder is None or not (position < target and key <= position + 1):
                self.container.seek(
                    self.times[key], stream=self.stream, backward=True, any_frame=False
                )
                decoder = self.container.decode(self.stream)
                position = -1
            for frame in decoder:
                if frame.pts is None or frame.pts not in index_of:
                    continue
                position = index_of[frame.pts]
                if position >= target:
                    break
            if position != target:
                raise VideoError(
                    self.where, f"frame {target} could not be decoded: truncated or corrupt"
                )
            frames[slot] = _frame_pixels(frame, width, height, self.where)
        return frames


def _frame_pixels(frame: Any, width: int, height: int, where: str) -> torch.Tensor:
    """A decoded frame as uint8 [3, h, w], converted to RGB by FFmpeg as PyAV's
    ``to_ndarray(format="rgb24")`` converts it (what transformers' PyAV reader calls)."""
    if (frame.width, frame.height) != (width, height):
        raise VideoError(
            where,
            f"a frame of {frame.width} x {frame.height} pixels in a {width} x {height} stream",
        )
    plane = frame.reformat(format="rgb24").planes[0]
    rows = torch.frombuffer(bytearray(bytes(plane)), dtype=torch.uint8).view(height, -1)
    return rows[:, : width * 3].reshape(height, width, 3).permute(2, 0, 1)
