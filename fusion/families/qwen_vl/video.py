"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's video processors, as transformers 5.24's
``Qwen2VLVideoProcessor`` and ``Qwen3VLVideoProcessor`` compute them: which frames of a clip
are kept, the size frames are resized to, and the patches and grids the vision tower takes.

The patch layout, the pixel range's arithmetic (:func:`~.images.smart_resize`) and the
settings are the image processor's (:mod:`fusion.families.qwen_vl.images`); the pixels differ
because transformers' video processors run on torchvision, not Pillow: frames are
resized by torch's antialiased interpolation on the uint8 frames (what torchvision calls on
CPU), then rescaled and normalised in one float32 step, ``(x - mean / factor) / (std /
factor)``. Frames are padded to a multiple of the temporal patch by repeating the last one.

    processor = Qwen2VLVideoProcessor.from_directory(directory)
    video = load_video("clip.mp4", sampler=processor.sampler)
    patched = processor([video])   # pixel_values_videos, video_grid_thw, second_per_grid_ts
"""

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fusion._validation import check_int
from fusion.families.processor import PREPROCESSOR_CONFIG, PROCESSOR_CONFIG
from fusion.families.qwen_vl.images import (
    MAX_IMAGE_PIXELS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    PatchGeometry,
    check_patch_settings,
    read_patch_settings,
    smart_resize,
    write_patches,
)
from fusion.families.qwen_vl.processor import check_against_tower, read_qwen2_vl_layout
from fusion.hf.config import ConfigReader, read_hf_config
from fusion.hf.errors import CheckpointError
from fusion.media.images import CLIP_MEAN, CLIP_STD, STANDARD_MEAN, STANDARD_STD
from fusion.media.resize import BICUBIC, BILINEAR, NEAREST
from fusion.media.video import (
    Sampler,
    Video,
    VideoMetadata,
    check_fps,
    check_sample_count,
    clip_fps,
)

VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"
# torch's interpolation modes for the filters transformers maps to torchvision's
# (pil_torch_interpolation_mapping): nearest is torchvision's NEAREST_EXACT.
_MODES = {NEAREST: "nearest-exact", BILINEAR: "bilinear", BICUBIC: "bicubic"}
# The most patches one call makes (float32 rows of 3 * 2 * 14**2 values: 9.9 GB): far above a
# published model's longest video (768 frames at 602,112 pixels: 1.2M patches).
MAX_VIDEO_PATCHES = 2**21


@dataclass(frozen=True)
class PatchedVideos:
    """Videos as Qwen2-VL's vision tower takes them.

    Attributes:
        pixel_values_videos: float32 [n_patches, 3 * temporal_patch_size * patch_size**2],
            the patches of all videos in order, laid out as images' (see
            :class:`~fusion.preprocessing.PatchedImages`), one temporal patch after another.
        video_grid_thw: int64 [n_videos, 3], each video's (temporal, height, width) grid.
        second_per_grid_ts: per video, the seconds one temporal patch spans,
            ``temporal_patch_size / sampled_fps`` (Qwen2.5-VL's processor output).
        metadata: per video, its :class:`~fusion.preprocessing.VideoMetadata`.
    """

    pixel_values_videos: torch.Tensor
    video_grid_thw: torch.Tensor
    second_per_grid_ts: tuple[float, ...]
    metadata: tuple[VideoMetadata, ...]


@dataclass(frozen=True)
class Qwen2VLVideoProcessor(PatchGeometry):
    """Clips -> :class:`PatchedVideos` as transformers' ``Qwen2VLVideoProcessor`` computes
    them (Qwen2-VL and Qwen2.5-VL; :class:`Qwen3VLVideoProcessor` for Qwen3-VL), with its
    defaults: 100,352 to 602,112 pixels a frame, patch 14, CLIP's mean and std, every frame
    kept unless ``do_sample_frames``.

    Attributes:
        min_pixels, max_pixels: a frame's pixel range after resizing (``size``'s
            ``shortest_edge`` and ``longest_edge``).
        do_sample_frames, fps, num_frames, min_frames, max_frames: which frames are kept
            (:meth:`sample_frames`), applied by :func:`~fusion.preprocessing.load_video`
            through :attr:`sampler`.
        cap_pixels_per_frame, max_video_tokens: qwen-vl-utils' cap on a whole video's pixels
            (off by default, as in transformers 5.24).
        max_patches: the most patches one call makes (a safety cap, not a transformers
            setting), checked before any frame is resized.

    Raises:
        ValueError: a setting out of range or inconsistent (named).
    """

    #: What a prompt holds in each video's place, replaced by its text (:meth:`video_text`).
    placeholder: ClassVar[str] = VIDEO_PAD
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
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
    do_convert_rgb: bool = True  # a setting read and kept: decoded frames are RGB already
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    max_patches: int = MAX_VIDEO_PATCHES

    # transformers' class name, checked against video_processor_type.
    hf_class: ClassVar[str] = "Qwen2VLVideoProcessor"
    # The largest max_pixels taken: a frame's budget here (as an image's).
    max_pixels_bound: ClassVar[int] = MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        check_patch_settings(self, self.max_pixels_bound)
        check_int(self.min_frames, "min_frames", low=1)
        check_int(self.max_frames, "max_frames", low=self.min_frames)
        check_int(self.max_video_tokens, "max_video_tokens", low=1)
        check_int(self.max_patches, "max_patches", low=1)
        if self.num_frames is not None:
            check_int(self.num_frames, "num_frames", low=1)
        if self.fps is not None:
            check_fps(self.fps, "fps")
            if self.num_frames is not None:
                raise ValueError(
                    f"num_frames, fps: give one, got num_frames={self.num_frames}, fps={self.fps}"
                )
        if isinstance(self.resample, bool) or self.resample not in _MODES:
            names = ", ".join(f"{n} ({_MODES[n]})" for n in sorted(_MODES))
            raise ValueError(
                f"resample: expected one of {names} (torchvision's filters that transformers' "
                f"video processors use), got {self.resample!r}"
            )

    @property
    def sampler(self) -> Sampler | None:
        """:meth:`sample_frames` when ``do_sample_frames``, else None (every frame kept): what
        :func:`~fusion.preprocessing.load_video` takes as ``sampler=``."""
        return self.sample_frames if self.do_sample_frames else None

    # -- settings ---------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], where: str = VIDEO_PREPROCESSOR_CONFIG
    ) -> "Qwen2VLVideoProcessor":
        """From a video processor config (or, as transformers falls back to it, the image
        processor's ``preprocessor_config.json``), read as transformers 5.24 reads it: the
        image processor's keys (:func:`~fusion.families.qwen_vl.images.read_patch_settings`,
        with this class's pixel range when ``size`` and the legacy keys are absent), then
        ``do_sample_frames``, ``fps``, ``num_frames``, ``min_frames``, ``max_frames``,
        ``cap_pixels_per_frame`` and ``max_video_tokens``.

        Raises:
            TypeError: ``config`` not a mapping.
            ValueError: naming ``where`` and the key: a value of the wrong type or range; a
                ``video_processor_type`` of another class.
        """
        read = ConfigReader.for_image_processor(config, where)
        kind = config.get("video_processor_type")
        if kind is not None and kind != cls.hf_class:
            raise read.fail("video_processor_type", f"expected {cls.hf_class}, got {kind!r}")
        defaults = cls()
        settings = read_patch_settings(read, defaults, cls.max_pixels_bound)

        # fps and num_frames: an explicit null is None (no sampling by it), as transformers'
        # constructor takes it; absent, the class's default (Qwen3-VL's fps is 2).
        fps = config.get("fps", defaults.fps)
        num_frames = config.get("num_frames")
        settings.update(
            do_sample_frames=read.flag("do_sample_frames", defaults.do_sample_frames),
            fps=None if fps is None else read.number("fps", fps, 0.0),
            num_frames=None if num_frames is None else read.integer("num_frames"),
            min_frames=read.integer("min_frames", defaults.min_frames),
            max_frames=read.integer("max_frames", defaults.max_frames),
            cap_pixels_per_frame=read.flag("cap_pixels_per_frame", False),
            max_video_tokens=read.integer("max_video_tokens", defaults.max_video_tokens),
        )
        try:
            return cls(**settings)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    @classmethod
    def from_directory(cls, directory: str | Path) -> "Qwen2VLVideoProcessor":
        """The video processor of a model directory, found as transformers looks for it: the
        ``"video_processor"`` object of ``processor_config.json``, then
        ``video_preprocessor_config.json``, then the image processor's
        ``preprocessor_config.json`` (published Qwen2-VL directories have only that one, so
        their videos take its pixel range), else this class's defaults.

        Raises:
            CheckpointError, ValueError: a file that cannot be read, or its settings (named).
        """
        found = _video_settings(Path(directory))
        return cls() if found is None else cls.from_config(*found)

    # -- sampling ---------------------------------------------------------------------------

    def sample_frames(self, metadata: VideoMetadata) -> list[int]:
        """The frames kept of a clip, as transformers' ``Qwen2VLVideoProcessor.sample_frames``
        keeps them: ``num_frames`` rounded to a multiple of the temporal patch, or ``fps``
        frames a second clamped to [``min_frames``, ``max_frames``] and the clip's length and
        rounded down to a multiple of the temporal patch, then evenly spaced
        (``arange(0, total, total / n)``, truncated); every frame without either.

        Raises:
            ValueError: ``fps`` for a clip without a frame rate; no frame left (a clip
                shorter than the temporal patch); more frames than the clip holds.
        """
        total, tps = metadata.total_num_frames, self.temporal_patch_size
        num_frames: int | None = None
        if self.num_frames is not None:
            num_frames = round(self.num_frames / tps) * tps
        elif self.fps is not None:
            max_frames = math.floor(min(self.max_frames, total) / tps) * tps
            wanted = total / clip_fps(metadata) * self.fps
            wanted = min(max(wanted, self.min_frames), max_frames, total)
            num_frames = math.floor(wanted / tps) * tps
        if num_frames is None:
            return list(range(total))
        if num_frames == 0:
            raise ValueError(
                f"num_frames: no frame is kept of a clip of {total} frames (at least one "
                f"temporal patch, {tps} frames, is sampled)"
            )
        check_sample_count(num_frames, total)
        # torch's float arange, as transformers calls it: its length and values are its.
        return torch.arange(0, total, total / num_frames).int().tolist()

    # -- sizes ------------------------------------------------------------------------------

    def _max_pixels(self, num_frames: int) -> int:
        """The frame pixel budget: ``max_pixels``, or with ``cap_pixels_per_frame`` an even
        share of ``max_video_tokens`` tokens' pixels (at least 1.05 ``min_pixels``)."""
        if not self.cap_pixels_per_frame:
            return self.max_pixels
        total = int(self.max_video_tokens * self.factor * self.factor * 0.9)
        share = total * self.temporal_patch_size // num_frames
        return max(min(self.max_pixels, share), int(self.min_pixels * 1.05))

    def output_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) frames of this size are resized to (arithmetic only).

        Raises:
            ValueError: an aspect ratio above 200; without ``do_resize``, sides that are not
                multiples of ``patch_size * merge_size``.
        """
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise ValueError(
                    f"frames: {height} x {width} pixels with do_resize false: both sides must "
                    f"be multiples of patch_size * merge_size = {self.factor}"
                )
            return height, width
        budget = self._max_pixels(num_frames)
        return smart_resize(height, width, self.factor, self.min_pixels, budget)

    def grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The (temporal, height, width) grid of ``num_frames`` kept frames of this size: the
        frames padded to a multiple of the temporal patch (arithmetic only, before decoding;
        raises as :meth:`output_size`)."""
        check_int(num_frames, "num_frames", low=1)
        out_height, out_width = self.output_size(num_frames, height, width)
        grid_t = -(-num_frames // self.temporal_patch_size)
        return grid_t, out_height // self.patch_size, out_width // self.patch_size

    def rows(self, num_frames: int, height: int, width: int) -> int:
        """The placeholder rows a video gives: ``t * h * w / merge_size**2``."""
        t, h, w = self.grid(num_frames, height, width)
        return t * h * w // self.merge_size**2

    def plan(self, metadata: VideoMetadata) -> tuple[list[int], tuple[int, int, int]]:
        """The frames this processor keeps of a clip and the grid they give, from the clip's
        metadata alone (:func:`~fusion.preprocessing.probe_video`): a video's rows
        (``t * h * w / merge_size**2``) are known before any frame is decoded.

        Raises:
            ValueError: as :meth:`sample_frames` and :meth:`output_size`.
        """
        total = metadata.total_num_frames
        indices = self.sample_frames(metadata) if self.do_sample_frames else list(range(total))
        return indices, self.grid(len(indices), metadata.height, metadata.width)

    def video_text(self, grid_thw: Sequence[int], metadata: VideoMetadata) -> str:
        """What a video's ``<|video_pad|>`` becomes in the prompt, as transformers'
        ``Qwen2VLProcessor`` and ``Qwen2_5_VLProcessor`` write it: one ``<|video_pad|>`` per
        row, ``t * h * w / merge_size**2`` (``metadata`` is Qwen3-VL's concern)."""
        t, h, w = _grid(grid_thw)
        return VIDEO_PAD * (t * h * w // self.merge_size**2)

    # -- pixels -----------------------------------------------------------------------------

    def __call__(self, videos: Sequence[Video | torch.Tensor]) -> PatchedVideos:
        """Videos (:class:`~fusion.preprocessing.Video`, or uint8 tensors [t, 3, h, w] of
        frames already kept) -> their patches and grids. Every video's grid is computed and
        the total checked against ``max_patches`` before any frame is resized; the patches
        are written into one tensor allocated once.

        Raises:
            TypeError: ``videos`` not a sequence of videos (named by index).
            ValueError: frames that are not uint8 [t, 3, h, w]; sizes past the settings; more
                than ``max_patches`` patches in all.
        """
        if not isinstance(videos, Sequence) or isinstance(videos, str | bytes):
            raise TypeError(f"videos: expected a sequence of videos, got {type(videos).__name__}")
        clips = [_as_video(video, f"videos[{i}]") for i, video in enumerate(videos)]
        grids = []
        for i, clip in enumerate(clips):
            t, _, height, width = clip.frames.shape
            try:
                grids.append(self.grid(t, height, width))
            except ValueError as error:
                raise ValueError(f"videos[{i}]: {error}") from None
        counts = [t * h * w for t, h, w in grids]
        if sum(counts) > self.max_patches:
            raise ValueError(
                f"videos: {sum(counts)} patches in all (grids {grids}), more than "
                f"max_patches={self.max_patches}; sample fewer frames or lower max_pixels"
            )
        pixel_values = torch.empty(sum(counts), self.patch_dim, dtype=torch.float32)
        start = 0
        for clip, count in zip(clips, counts, strict=True):
            self._patches(clip.frames, pixel_values[start : start + count])
            start += count
        grid_thw = torch.tensor(grids, dtype=torch.int64).view(len(grids), 3)
        metadata = tuple(clip.metadata for clip in clips)
        seconds = tuple(self.temporal_patch_size / m.sampled_fps for m in metadata)
        return PatchedVideos(pixel_values, grid_thw, seconds, metadata)

    def _patches(self, frames: torch.Tensor, out: torch.Tensor) -> None:
        """One video's checked uint8 frames [t, 3, h, w] as patches written into ``out``."""
        t, _, height, width = frames.shape
        size = self.output_size(t, height, width)
        if size != (height, width):
            frames = _resize(frames, size, self.resample)
        values = self._rescale_normalize(frames)
        if pad := -t % self.temporal_patch_size:  # the last frame repeated, as transformers
            values = torch.cat([values, values[-1:].expand(pad, -1, -1, -1)])
        write_patches(values, self.patch_size, self.merge_size, out)

    def _rescale_normalize(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 -> float32 as transformers' torchvision backend computes it: rescale and
        normalise fused into ``(x - mean / factor) / (std / factor)``, the mean and std
        scaled in float32."""
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, dtype=torch.float32)
            std = torch.tensor(self.image_std, dtype=torch.float32)
            if self.do_rescale:
                mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            values = frames.to(torch.float32)
            return values.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        if self.do_rescale:
            return frames * self.rescale_factor
        return frames.to(torch.float32)


def _grid(grid_thw: Sequence[int]) -> tuple[int, int, int]:
    values = [int(v) for v in grid_thw]
    if len(values) != 3 or min(values) < 1:
        raise ValueError(f"grid_thw: expected 3 positive integers (t, h, w), got {values}")
    return values[0], values[1], values[2]


def _as_video(video: object, name: str) -> Video:
    if isinstance(video, torch.Tensor):
        frames = video
        metadata = VideoMetadata(
            frames.shape[0], None, frames.shape[-1], frames.shape[-2], None,
            tuple(range(frames.shape[0])),
        )  # fmt: skip
        video = Video(frames, metadata)
    if not isinstance(video, Video):
        raise TypeError(
            f"{name}: expected a Video (load_video) or a uint8 tensor [t, 3, h, w], got "
            f"{type(video).__name__}"
        )
    frames = video.frames
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[1] != 3 or not len(frames):
        raise ValueError(
            f"{name}: expected uint8 frames [t, 3, h, w] (t >= 1, RGB), got {frames.dtype} "
            f"{list(frames.shape)}"
        )
    if frames.device.type != "cpu":  # torchvision resizes other devices' frames otherwise
        raise ValueError(f"{name}: expected frames on the CPU, got {frames.device}")
    return video


def _resize(frames: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """uint8 frames [t, 3, h, w] resized as torchvision 0.28's ``resize`` on CPU resizes
    them: torch's interpolation on the uint8 frames (antialiased, corners not aligned) for
    bicubic, and for bilinear where the CPU has AVX2 (else in float32, rounded back)."""
    mode = _MODES[resample]
    if mode == "nearest-exact":
        return F.interpolate(frames, size=size, mode=mode)
    native = mode == "bicubic" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if native:
        return F.interpolate(frames, size=size, mode=mode, align_corners=False, antialias=True)
    resized = F.interpolate(
        frames.to(torch.float32), size=size, mode=mode, align_corners=False, antialias=True
    )
    return resized.round_().to(torch.uint8)


@dataclass(frozen=True)
class Qwen3VLVideoProcessor(Qwen2VLVideoProcessor):
    """transformers' ``Qwen3VLVideoProcessor``: patch 16, mean and std 0.5, a pixel range of
    131,072 to 786,432 for the whole clip (its ``smart_resize`` counts frames times pixels),
    and 2 frames a second kept by default, evenly spaced from the first frame to the last
    (:meth:`sample_frames`)."""

    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    patch_size: int = 16
    image_mean: tuple[float, ...] = STANDARD_MEAN
    image_std: tuple[float, ...] = STANDARD_STD
    do_sample_frames: bool = True
    fps: float | None = 2
    max_video_tokens: int = 768

    hf_class: ClassVar[str] = "Qwen3VLVideoProcessor"
    # max_pixels is a whole clip's budget here (published: 25,165,824), not a frame's.
    max_pixels_bound: ClassVar[int] = MAX_IMAGE_PIXELS * 64

    def sample_frames(self, metadata: VideoMetadata) -> list[int]:
        """transformers' ``Qwen3VLVideoProcessor.sample_frames``: ``num_frames``, or ``fps``
        frames a second of the clip (a clip without a frame rate taken at 24), clamped to
        [``min_frames``, ``max_frames``] and the clip's length, else every frame clamped
        likewise, spaced as ``linspace(0, total - 1, n)`` rounded (a frame repeats when the
        clip is shorter than ``min_frames``)."""
        total = metadata.total_num_frames
        num_frames = self.num_frames
        if num_frames is None and self.fps is not None:
            clip_fps = 24.0 if metadata.fps is None else metadata.fps
            num_frames = int(total / clip_fps * self.fps)
            num_frames = min(max(num_frames, self.min_frames), self.max_frames, total)
        if num_frames is None:
            num_frames = min(max(total, self.min_frames), self.max_frames)
        if num_frames == 0:
            raise ValueError(f"num_frames: no frame is kept of a clip of {total} frames")
        # numpy's linspace (i * step, the last one exact), rounded half to even as numpy does.
        step = (total - 1) / (num_frames - 1) if num_frames > 1 else 0.0
        return [round(i * step) for i in range(num_frames - 1)] + [total - 1]

    def timestamps(self, metadata: VideoMetadata) -> list[float]:
        """Each temporal patch's time in seconds, as transformers' ``Qwen3VLProcessor``
        computes it from the frames actually kept: the kept indices padded to a multiple of
        the temporal patch by repeating the last, each over the clip's frame rate (24 for
        frames without one, as transformers assumes), the first and last of each patch
        averaged."""
        tps = self.temporal_patch_size
        fps = 24.0 if metadata.fps is None else metadata.fps
        indices = list(metadata.frames_indices)
        indices += indices[-1:] * (-len(indices) % tps)
        seconds = [index / fps for index in indices]
        return [(seconds[i] + seconds[i + tps - 1]) / 2 for i in range(0, len(seconds), tps)]

    def video_text(self, grid_thw: Sequence[int], metadata: VideoMetadata) -> str:
        """A video's text, as transformers' ``Qwen3VLProcessor`` writes it: per temporal
        patch, its time ``<{t:.1f} seconds>`` (:meth:`timestamps`), then ``<|vision_start|>``,
        one ``<|video_pad|>`` per row of that frame (``h * w / merge_size**2``),
        ``<|vision_end|>``. Since each frame has its own start / end pair, the text replaces
        the chat template's whole ``<|vision_start|><|video_pad|><|vision_end|>``
        (:func:`~fusion.families.qwen_vl.processor.expand_video_pads`).

        Raises:
            ValueError: ``metadata`` keeps fewer frames than ``grid_thw`` has temporal
                patches.
        """
        t, h, w = _grid(grid_thw)
        times = self.timestamps(metadata)
        if len(times) < t:
            raise ValueError(
                f"metadata: {len(metadata.frames_indices)} frames kept, fewer than the "
                f"{t} temporal patches of grid_thw {list(grid_thw)}"
            )
        frame = VISION_START + VIDEO_PAD * (h * w // self.merge_size**2) + VISION_END
        return "".join(f"<{times[i]:.1f} seconds>" + frame for i in range(t))

    def output_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """transformers' Qwen3-VL ``smart_resize``: frames smaller than one
        ``patch_size * merge_size`` square scaled up first, then the pixel range applied to
        the whole clip (``num_frames`` rounded to the temporal patch)."""
        if not self.do_resize:
            return super().output_size(num_frames, height, width)
        tps, factor = self.temporal_patch_size, self.factor
        if num_frames < tps:
            raise ValueError(
                f"frames: {num_frames} frame(s), fewer than the temporal patch ({tps}), which "
                "Qwen3-VL's video processor refuses"
            )
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * factor * factor
            per_frame = max(
                min(frame_cap, self.max_pixels // num_frames), int(self.min_pixels * 1.05)
            )
            max_pixels = per_frame * num_frames
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        ratio = max(height, width) / min(height, width)
        if ratio > 200:
            raise ValueError(
                f"frames: {height} x {width} pixels, an aspect ratio of {ratio:.1f}, above 200"
            )
        new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
        frames = round(num_frames / tps) * tps
        if frames * new_height * new_width > max_pixels:
            beta = math.sqrt(num_frames * height * width / max_pixels)
            new_height = max(factor, math.floor(height / beta / factor) * factor)
            new_width = max(factor, math.floor(width / beta / factor) * factor)
        elif frames * new_height * new_width < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (num_frames * height * width))
            new_height = math.ceil(height * beta / factor) * factor
            new_width = math.ceil(width * beta / factor) * factor
        return new_height, new_width


def read_video_processor(directory: str | Path) -> Qwen2VLVideoProcessor:
    """The video processor of a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 model directory:
    transformers' class for its ``config.json`` model type (the family says which:
    :class:`Qwen2VLVideoProcessor`, or :class:`Qwen3VLVideoProcessor` for Qwen3-VL and
    Qwen3.5), its settings found as :meth:`Qwen2VLVideoProcessor.from_directory` finds them,
    and its patch sizes checked against the vision tower's.

    Raises:
        CheckpointError: ``config.json`` missing, unreadable or of another family (named).
        ValueError: settings that cannot be read, or patch sizes other than the tower's
            (naming the file and key).
    """
    path = Path(directory)
    layout = read_qwen2_vl_layout(path)
    classes = {c.hf_class: c for c in (Qwen2VLVideoProcessor, Qwen3VLVideoProcessor)}
    cls = classes[layout.video_processor]
    found = _video_settings(path)
    if found is None:  # transformers' class defaults, with the tower's patch sizes
        processor = cls(
            patch_size=layout.patch_size,
            merge_size=layout.spatial_merge_size,
            temporal_patch_size=layout.temporal_patch_size,
        )
        warnings.warn(
            f"{path}: no video processor settings (no 'video_processor' in "
            f"{PROCESSOR_CONFIG}, no {VIDEO_PREPROCESSOR_CONFIG}, no {PREPROCESSOR_CONFIG}); "
            f"using transformers' {cls.hf_class} defaults with the tower's patch sizes: "
            f"{processor}",
            stacklevel=2,
        )
    else:
        processor = cls.from_config(*found)
        check_against_tower(processor, layout, found[1])
    return processor


def _video_settings(directory: Path) -> tuple[Mapping[str, Any], str] | None:
    """The video processor's settings and where they were found, as transformers looks for
    them (see :meth:`Qwen2VLVideoProcessor.from_directory`); None when no file holds them."""
    file = directory / PROCESSOR_CONFIG
    if file.exists():
        nested = read_hf_config(file).get("video_processor")
        if nested is not None:
            if not isinstance(nested, dict):
                raise CheckpointError(file, "video_processor", "expected an object")
            return nested, f"{file}: video_processor"
    for name in (VIDEO_PREPROCESSOR_CONFIG, PREPROCESSOR_CONFIG):
        file = directory / name
        if file.exists():
            return read_hf_config(file), str(file)
    return None
