"""One encoded conversation (:class:`Sample`: ids, labels and pixels or the references to
them, checked), and the references that keep a sample's images (:class:`ImageRef`) and videos
(:class:`VideoRef`) out of memory until its batch is collated."""

from dataclasses import dataclass, field
from typing import Any

import torch

from fusion._validation import describe
from fusion.data.records import ConversationVideo, video_name

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ImageRef:
    """An image of a sample, by file: checked and measured, its pixels not kept.

    Attributes:
        path: the image file; for an image embedded in a data set, where it is
            (``"train.parquet:row 3: images[0]"``).
        height, width: its size once decoded (EXIF orientation applied).
        tiles: how many images or tiles the processor makes of it (1 for a whole image), or
            its placeholder rows for towers taking images of any size
            (:meth:`VisionLanguageProcessor.plan`).
        embedded: for an image embedded in a data set, its place there
            (:class:`fusion.data.hf_datasets.EmbeddedImage`), read again when its pixels
            are made; None for a file.
    """

    path: str
    height: int
    width: int
    tiles: int
    embedded: Any = None


@dataclass(frozen=True)
class VideoRef:
    """A video of a sample, by file: its container probed and its frames planned, nothing
    decoded.

    Attributes:
        source: the clip file, or its frame files in order.
        metadata: the clip's :class:`~fusion.preprocessing.VideoMetadata` with the frames the
            video processor keeps (``frames_indices``), from the container alone.
        grid: the (temporal, height, width) patch grid those frames give.
        rows: the placeholder rows it brings, ``t * h * w / merge_size**2``.
    """

    source: ConversationVideo
    metadata: Any
    grid: tuple[int, int, int]
    rows: int

    @property
    def name(self) -> str:
        """The clip as messages name it."""
        return video_name(self.source)


@dataclass(frozen=True)
class Sample:
    """One encoded conversation.

    Attributes:
        tokens: int64 [n], placeholders included.
        labels: int64 [n]: ``labels[t]`` is ``tokens[t + 1]`` where that token is a target,
            else :data:`IGNORE_INDEX` (always at ``t = n - 1``: a sample never predicts what
            follows it, so packed samples stay apart).
        pixel_values: float32 [tiles, 3, s, s], the images or tiles in order of their
            placeholders; ``tiles`` is 0 without images (and for text-only models), and for a
            sample whose ``images`` are not loaded yet. For towers taking images of any size:
            the images' flattened patches [n_patches, 3 * 2 * p * p].
        source: where it comes from (``"file:line"``), for messages.
        truncated: whether :func:`fit_sample` cut its end.
        images: the image files whose pixels :meth:`ConversationEncoder.load_pixels` makes
            (what :func:`encode_conversations` gives); empty when ``pixel_values`` came
            with the sample.
        image_grid_thw: for towers taking images of any size, int64 [n_images, 3], each
            image's patch grid (t, h, w) (what the vision tower and the M-RoPE positions
            need); [0, 3] for other models.
        videos: the videos whose patches :meth:`ConversationEncoder.load_pixels` makes;
            empty when the patches came with the sample (or without videos).
        pixel_values_videos: float32 [n_patches, 3 * temporal_patch * patch**2], the
            videos' patches in order of their placeholders; empty without videos, and for a
            sample whose ``videos`` are not loaded yet.
        video_grid_thw: int64 [n_videos, 3], each video's grid (t, h, w).
        second_per_grid_ts: float32 [n_videos], the seconds one temporal patch of each video
            spans (Qwen2.5-VL's temporal positions; the processor's ``second_per_grid_ts``).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor
    source: str = ""
    truncated: bool = False
    images: tuple[ImageRef, ...] = ()
    image_grid_thw: torch.Tensor = field(
        default_factory=lambda: torch.empty(0, 3, dtype=torch.int64)
    )
    videos: tuple[VideoRef, ...] = ()
    pixel_values_videos: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    video_grid_thw: torch.Tensor = field(
        default_factory=lambda: torch.empty(0, 3, dtype=torch.int64)
    )
    second_per_grid_ts: torch.Tensor = field(
        default_factory=lambda: torch.empty(0, dtype=torch.float32)
    )

    def __post_init__(self) -> None:
        """Raises ValueError: ``tokens`` not integer ids [n] with n >= 1, ``labels`` not
        integers of the same shape, ``pixel_values`` not a floating tensor (or empty),
        ``images`` not a tuple of :class:`ImageRef`."""
        tokens, labels, pixels = self.tokens, self.labels, self.pixel_values
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.dim() != 1
            or tokens.numel() == 0
            or tokens.dtype.is_floating_point
            or tokens.dtype.is_complex
            or tokens.dtype == torch.bool
        ):
            raise ValueError(f"tokens: expected integer ids [n], n >= 1, got {_describe(tokens)}")
        if (
            not isinstance(labels, torch.Tensor)
            or labels.shape != tokens.shape
            or labels.dtype.is_floating_point
            or labels.dtype.is_complex
            or labels.dtype == torch.bool
        ):
            raise ValueError(
                f"labels: expected integers of the tokens' shape {list(tokens.shape)}, got "
                f"{_describe(labels)}"
            )
        if not isinstance(pixels, torch.Tensor) or (
            pixels.numel() and not pixels.dtype.is_floating_point
        ):
            raise ValueError(f"pixel_values: expected a floating tensor, got {_describe(pixels)}")
        _check_grids("image_grid_thw", self.image_grid_thw, "n_images")
        _check_refs("images", self.images, ImageRef)
        self._check_videos()

    def _check_videos(self) -> None:
        videos, patches = self.pixel_values_videos, self.video_grid_thw
        _check_refs("videos", self.videos, VideoRef)
        if not isinstance(videos, torch.Tensor) or (
            videos.numel() and (not videos.dtype.is_floating_point or videos.dim() != 2)
        ):
            raise ValueError(
                "pixel_values_videos: expected a floating tensor [n_patches, d] (or empty), got "
                f"{_describe(videos)}"
            )
        _check_grids("video_grid_thw", patches, "n_videos")
        seconds = self.second_per_grid_ts
        if (
            not isinstance(seconds, torch.Tensor)
            or seconds.shape != (patches.size(0),)
            or not seconds.dtype.is_floating_point
        ):
            raise ValueError(
                f"second_per_grid_ts: expected a floating tensor [{patches.size(0)}] (one per "
                f"video of video_grid_thw), got {_describe(seconds)}"
            )
        if videos.numel() and int(patches.prod(1).sum()) != videos.size(0):
            raise ValueError(
                f"pixel_values_videos: {videos.size(0)} patches, but video_grid_thw "
                f"{patches.tolist()} gives {int(patches.prod(1).sum())}"
            )

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def has_images(self) -> bool:
        """Whether the sample shows images (loaded or not)."""
        return bool(self.images) or self.pixel_values.numel() > 0

    @property
    def has_videos(self) -> bool:
        """Whether the sample shows videos (loaded or not)."""
        return bool(self.videos) or self.pixel_values_videos.numel() > 0

    @property
    def pixels_loaded(self) -> bool:
        """False for a sample with images whose pixels (or videos whose patches) are still to
        be made."""
        images = not self.images or self.pixel_values.numel() > 0
        return images and (not self.videos or self.pixel_values_videos.numel() > 0)

    @property
    def num_targets(self) -> int:
        """How many tokens the loss covers."""
        return int((self.labels != IGNORE_INDEX).sum())


def _describe(value: object) -> str:
    return describe(value) if isinstance(value, torch.Tensor) else type(value).__name__


def _check_grids(name: str, grids: object, count: str) -> None:
    """``grids`` must be int64 ``[count, 3]`` (each image's or video's t, h, w in patches)."""
    if (
        not isinstance(grids, torch.Tensor)
        or grids.dim() != 2
        or grids.size(1) != 3
        or grids.dtype != torch.int64
    ):
        raise ValueError(f"{name}: expected int64 [{count}, 3], got {_describe(grids)}")


def _check_refs(name: str, refs: object, kind: type) -> None:
    """``refs`` must be a tuple of ``kind`` (the sample's media references)."""
    if not isinstance(refs, tuple) or not all(isinstance(ref, kind) for ref in refs):
        raise ValueError(f"{name}: expected a tuple of {kind.__name__}, got {type(refs).__name__}")
