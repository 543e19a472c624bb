"""The Qwen processor kind (:class:`Qwen2VLProcessor`, the
:class:`~fusion.preprocessing.VisionLanguageProcessor` of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and
Qwen3.5) and what it reads of a directory: the placeholder ids and the tower's patch sizes
from ``config.json`` (:func:`read_qwen2_vl_layout`), checked against the image processor's
settings.
"""

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fusion.families.directory import HfDirectory
from fusion.families.processor import (
    VisionLanguageProcessor,
    _image_processor_settings,
    _warn_defaults,
)
from fusion.families.qwen_vl.images import (
    IMAGE_PAD,
    MAX_MERGE_SIZE,
    MAX_PATCH_SIZE,
    MAX_TEMPORAL_PATCH_SIZE,
    QWEN2_VL_IMAGE_MARKER,
    QWEN2_VL_VIDEO_MARKER,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    Qwen2VLImageProcessor,
    qwen2_vl_image_text,
)
from fusion.hf.config import CONFIG_NAME, ConfigReader, read_hf_config
from fusion.hf.errors import CheckpointError, as_path, short_repr
from fusion.media.prompts import check_marker_count

# A video text that brackets its own frames (Qwen3-VL's) replaces the template's whole marker,
# as transformers' Qwen3VLProcessor does (and its 4.x code did; 5.0 to 5.24 left the marker's
# pair around the frames' own, text the models were not trained on).
_VIDEO_PADS = re.compile(f"{re.escape(QWEN2_VL_VIDEO_MARKER)}|{re.escape(VIDEO_PAD)}")

_IDS = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
_VISION_SIZES = ("patch_size", "spatial_merge_size", "temporal_patch_size")


@dataclass(frozen=True)
class Qwen2VLLayout:
    """What preprocessing needs of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL ``config.json``: the
    placeholder id of image rows, the ids around each image, and the vision tower's patch
    sizes."""

    model_type: str
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    settings: Mapping[str, Any] = field(default_factory=dict)  # without a settings file
    settings_name: str = "transformers' Qwen2-VL defaults"  # named in the warning then
    video_processor: str = "Qwen2VLVideoProcessor"  # transformers' class for the model type


def _processor_defaults(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """``config``'s model type and what its family gives this processor for settings left
    out, when its family's images are this processor's; else None."""
    from fusion.families import FAMILIES

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    for family in FAMILIES:
        if family.processor == Qwen2VLProcessor.kind and model_type in family.processor_defaults:
            return model_type, family.processor_defaults[model_type]
    return None


def _model_types() -> list[str]:
    from fusion.families import FAMILIES

    return [
        model_type
        for family in FAMILIES
        if family.processor == Qwen2VLProcessor.kind
        for model_type in family.processor_defaults
    ]


def qwen2_vl_model_type(config: Mapping[str, Any]) -> str | None:
    """``config``'s ``model_type`` when this processor makes its images (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL, Qwen3.5), else None."""
    found = _processor_defaults(config)
    return None if found is None else found[0]


def read_qwen2_vl_layout(path: str | bytes | os.PathLike | HfDirectory) -> Qwen2VLLayout:
    """The :class:`Qwen2VLLayout` of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL directory (or its
    ``config.json``), read with the bounded JSON reader (an :class:`HfDirectory`'s parsed
    config used as it is). Keys omitted take transformers'
    defaults (``Qwen2VLConfig``, ``Qwen2_5_VLConfig``, ``Qwen3VLConfig``: ids 151655, 151652
    and 151653; patch 14, 16 for Qwen3-VL; merge 2, temporal patch 2), the vision keys from
    ``vision_config``, which may be absent, as it is in configs that leave every vision
    setting at its default.

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: naming the file and key: ``config.json`` missing or unreadable, a
            ``model_type`` of another family, an id that is not an integer in [0, 2**31), a
            vision size that is not an integer within the image processor's bounds (e.g. a
            list ``patch_size``).
    """
    if isinstance(path, HfDirectory):
        file, config = path.config_file, path.config
    else:
        path = as_path(path, "path")
        file = path / CONFIG_NAME if path.is_dir() else path
        config = read_hf_config(file)
    found = _processor_defaults(config)
    if found is None:
        raise CheckpointError(
            file,
            "model_type",
            f"expected one of {_model_types()}, got {short_repr(config.get('model_type'))}",
        )
    model_type, defaults = found
    read = ConfigReader(config, file)
    ids = {key: read.integer(key, defaults[key], low=0) for key in _IDS}
    vision = config.get("vision_config")
    if vision is None:
        vision = {}
    if not isinstance(vision, Mapping):
        raise read.fail("vision_config", f"expected an object, got {short_repr(vision)}")
    read_vision = ConfigReader(vision, file, "vision_config.")
    highs = {
        "patch_size": MAX_PATCH_SIZE,
        "spatial_merge_size": MAX_MERGE_SIZE,
        "temporal_patch_size": MAX_TEMPORAL_PATCH_SIZE,
    }
    sizes = {}
    for key in _VISION_SIZES:
        value = read_vision.integer(key, defaults[key])
        if value > highs[key]:
            raise read_vision.fail(key, f"expected an integer <= {highs[key]}, got {value}")
        sizes[key] = value
    return Qwen2VLLayout(
        model_type,
        **ids,
        **sizes,
        settings=defaults["settings"],
        settings_name=defaults["settings_name"],
        video_processor=defaults.get("video_processor", "Qwen2VLVideoProcessor"),
    )


def default_image_processor(layout: Qwen2VLLayout) -> Qwen2VLImageProcessor:
    """The image processor of a directory without image processor settings: the tower's
    patch sizes, and the family's pixel range, mean and std (Qwen2-VL, Qwen2.5-VL:
    transformers' ``Qwen2VLImageProcessor`` defaults; Qwen3-VL: its published settings,
    :data:`QWEN3_VL_SETTINGS`)."""
    return Qwen2VLImageProcessor(
        patch_size=layout.patch_size,
        merge_size=layout.spatial_merge_size,
        temporal_patch_size=layout.temporal_patch_size,
        **layout.settings,
    )


class PatchSizes(Protocol):
    """What :func:`check_against_tower` reads of an image or video processor."""

    @property
    def patch_size(self) -> int: ...
    @property
    def merge_size(self) -> int: ...
    @property
    def temporal_patch_size(self) -> int: ...


def check_against_tower(processor: PatchSizes, layout: Qwen2VLLayout, where: str) -> None:
    """Settings whose patches the vision tower cannot take are refused before any image or
    video is processed (naming the file and key, and ``config.json``'s).

    Raises:
        ValueError: ``patch_size``, ``merge_size`` or ``temporal_patch_size`` other than the
            tower's ``vision_config`` values.
    """
    for key, value, tower_key, tower in (
        ("patch_size", processor.patch_size, "patch_size", layout.patch_size),
        ("merge_size", processor.merge_size, "spatial_merge_size", layout.spatial_merge_size),
        (
            "temporal_patch_size",
            processor.temporal_patch_size,
            "temporal_patch_size",
            layout.temporal_patch_size,
        ),
    ):
        if value != tower:
            raise ValueError(
                f"{where}: {key}: {value}, but the vision tower (config.json, "
                f"vision_config.{tower_key}) takes {tower}"
            )


class Qwen2VLProcessor(VisionLanguageProcessor):
    """:class:`~fusion.preprocessing.VisionLanguageProcessor` of Qwen2-VL, Qwen2.5-VL and
    Qwen3-VL: each image is marked as Qwen's chat template writes it,
    ``<|vision_start|><|image_pad|><|vision_end|>``, and the ``<|image_pad|>`` becomes one per
    row of that image (``t * h * w / merge_size**2``, :func:`qwen2_vl_image_text`); each
    tokenized run of them must lie between the start and end ids, and the inputs carry the
    images' ``image_grid_thw``."""

    kind = "qwen2_vl"
    image_processor_type = Qwen2VLImageProcessor
    marker = QWEN2_VL_IMAGE_MARKER
    placeholder = IMAGE_PAD
    takes = ("vision_start_token_id", "vision_end_token_id")
    pixel_cap = "pixel_limit"

    def _sizes(self, tokens_per_image: int | None, image_size: int | None) -> tuple[int, int]:
        # The rows vary per image: plan() counts them one by one.
        return 1, self.image_processor.patch_size

    @classmethod
    def read_directory(cls, directory: HfDirectory) -> tuple[Any, dict[str, Any]]:
        layout = read_qwen2_vl_layout(directory)
        found = _image_processor_settings(directory.path)
        if found is None:
            image_processor = default_image_processor(layout)
            what = f"{layout.settings_name} with the tower's patch sizes: {image_processor}"
            _warn_defaults(directory.path, what, stacklevel=3)
        else:
            settings, where = found
            image_processor = Qwen2VLImageProcessor.from_config(settings, where)
            check_against_tower(image_processor, layout, where)
        model = {
            "image_token_id": layout.image_token_id,
            "vision_start_token_id": layout.vision_start_token_id,
            "vision_end_token_id": layout.vision_end_token_id,
        }
        return image_processor, model

    def _check_prompts(self, prompts: Sequence[str], videos: bool = False) -> None:
        for i, prompt in enumerate(prompts):
            if prompt.count(VIDEO_PAD) and not videos:
                raise ValueError(
                    f"prompts[{i}]: holds {VIDEO_PAD!r}, a video's placeholder; videos are not "
                    f"taken (mark each image with {QWEN2_VL_IMAGE_MARKER!r})"
                )
            if prompt.count(IMAGE_PAD) != prompt.count(QWEN2_VL_IMAGE_MARKER):
                # transformers would take a lone one for an image too; the model needs each
                # image's rows between its start and end tokens.
                raise ValueError(
                    f"prompts[{i}]: holds {IMAGE_PAD!r} outside the image marker "
                    f"{QWEN2_VL_IMAGE_MARKER!r}; write the whole marker where each image goes"
                )

    def _expand_videos(self, texts: list[str], video_texts: Sequence[str]) -> list[str]:
        return expand_video_pads(texts, video_texts)

    def _plan_image(self, image: object, name: str) -> int:
        t, h, w = self.image_processor.check(image, name)
        return t * h * w // self.image_processor.merge_size**2

    def _image_text(self, height: int, width: int, tiles: int) -> str:
        return qwen2_vl_image_text(tiles)

    def pixels(self, images: Sequence[object]) -> tuple[torch.Tensor, torch.Tensor | None]:
        patched = self.image_processor(images)
        return patched.pixel_values, patched.image_grid_thw

    def made(self, pixel_values: torch.Tensor, grids: torch.Tensor | None) -> int:
        if grids is None:
            return 0
        return int(grids.prod(1).sum()) // self.image_processor.merge_size**2

    def check_ids(self, ids: list[list[int]], prompts: Sequence[str], tiles: list[int]) -> None:
        """Raise ``ValueError`` unless each prompt's ids hold, in order, one run of
        placeholder ids per image, of that image's rows, each right after
        ``vision_start_token_id`` and right before ``vision_end_token_id`` (the tokenizer and
        ``config.json`` agree on the ids)."""
        placeholder, start, end = (
            self.image_token_id,
            self.vision_start_token_id,
            self.vision_end_token_id,
        )
        first = 0
        for index, (encoded, prompt) in enumerate(zip(ids, prompts, strict=True)):
            count = prompt.count(QWEN2_VL_IMAGE_MARKER)
            rows, first = tiles[first : first + count], first + count
            runs, bracketed, i = [], True, 0
            while i < len(encoded):
                if encoded[i] != placeholder:
                    i += 1
                    continue
                begin = i
                while i < len(encoded) and encoded[i] == placeholder:
                    i += 1
                runs.append(i - begin)
                bracketed &= (
                    begin > 0 and encoded[begin - 1] == start and i < len(encoded)
                    and encoded[i] == end
                )  # fmt: skip
            if runs != rows or not bracketed:
                raise ValueError(
                    f"prompts[{index}]: the tokenized prompt holds runs of {runs} placeholder "
                    f"ids ({placeholder})"
                    f"{'' if bracketed else ', not all between the start and end ids'}, but its "
                    f"images give {rows} rows, each between {start} and {end}; the tokenizer "
                    f"must encode {IMAGE_PAD!r}, {VISION_START!r} and {VISION_END!r} as the "
                    "single tokens config.json names (image_token_id, vision_start_token_id, "
                    "vision_end_token_id), and prompts must not hold them otherwise"
                )


def expand_video_pads(prompts: Sequence[str], texts: Sequence[str]) -> list[str]:
    """Each ``<|video_pad|>`` of ``prompts``, in order across them, replaced by the next of
    ``texts`` (the video processor's ``video_text``), as transformers' processors replace it:
    one per video. A text that brackets its own frames with ``<|vision_start|>`` (Qwen3-VL's
    and Qwen3.5's) replaces the template's whole ``<|vision_start|><|video_pad|><|vision_end|>``
    around its pad, so that no start / end pair encloses the frames' own.

    Raises:
        ValueError: a number of ``<|video_pad|>`` other than the number of videos (both
            counts given).
    """
    check_marker_count(prompts, len(texts), VIDEO_PAD, "video")
    remaining = iter(texts)

    def replace(found: re.Match[str]) -> str:
        text = next(remaining)
        if found.group() == QWEN2_VL_VIDEO_MARKER and VISION_START not in text:
            return VISION_START + text + VISION_END
        return text

    return [_VIDEO_PADS.sub(replace, prompt) for prompt in prompts]
