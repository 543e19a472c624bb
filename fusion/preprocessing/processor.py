"""Prompts and images -> token ids and pixels for a LLaVA, Idefics3 / SmolVLM, Qwen2-VL,
Qwen2.5-VL or Qwen3-VL model."""

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusion.checkpoint import CheckpointError, read_hf_config
from fusion.checkpoint.files import read_tokenizer
from fusion.checkpoint.hf_vlm import VlmImageLayout, hf_model_kind, read_hf_vlm_layout
from fusion.early_fusion import EarlyFusion
from fusion.models.idefics3 import Idefics3ImageEncoder
from fusion.models.llava import LlavaImageEncoder, rows_per_image
from fusion.padding import left_pad
from fusion.preprocessing.clip import ClipImageProcessor
from fusion.preprocessing.idefics3 import IMAGE_TOKEN, Idefics3ImageProcessor, idefics3_image_text
from fusion.preprocessing.images import check_max_pixels, check_pixels, image_size
from fusion.preprocessing.prompts import check_marker_count, expand_markers
from fusion.preprocessing.qwen2_vl import (
    IMAGE_PAD,
    QWEN2_VL_IMAGE_MARKER,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    Qwen2VLImageProcessor,
    Qwen2VLLayout,
    check_against_tower,
    default_image_processor,
    qwen2_vl_image_text,
    qwen2_vl_model_type,
    read_qwen2_vl_layout,
)

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"
TOKENIZER_FILE = "tokenizer.json"
# Caps on what the images of a prompt may cost, above any published model's needs
# (SmolVLM and Idefics3 split an image into at most 4 x 4 tiles plus the whole, of 64 to 169
# rows each; LLaVA-1.5 gives 576 rows per image).
MAX_TILES_PER_IMAGE = 256
MAX_IMAGE_ROWS = 1 << 16
_WARNED_DEFAULTS: set[str] = set()  # directories whose defaults were announced

Encode = Callable[[str], list[int]]
ImageProcessor = ClipImageProcessor | Idefics3ImageProcessor | Qwen2VLImageProcessor
KINDS = {
    "llava": ClipImageProcessor,
    "idefics3": Idefics3ImageProcessor,
    "qwen2_vl": Qwen2VLImageProcessor,
}


def detect_model_kind(directory: str | bytes | os.PathLike) -> str:
    """``"llama"``, ``"llava"``, ``"idefics3"`` or ``"qwen2_vl"`` (Qwen2-VL, Qwen2.5-VL and
    Qwen3-VL, whose images one processor makes): what a model directory's ``config.json``
    describes, as preprocessing sees it (see
    :func:`fusion.checkpoint.hf_vlm.hf_model_kind`, whose errors it raises)."""
    if _is_qwen2_vl(directory):
        return "qwen2_vl"
    return hf_model_kind(directory)


def _is_qwen2_vl(directory: str | bytes | os.PathLike) -> bool:
    """Whether ``config.json`` describes a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model (its
    ``model_type``)."""
    return qwen2_vl_model_type(read_hf_config(directory)) is not None


@dataclass(frozen=True)
class VisionInputs:
    """What a prompt batch gives the model.

    Attributes:
        ids: the token ids of each prompt, image markers expanded to placeholder ids.
        pixel_values: float32 [n, 3, s, s], the images (LLaVA) or tiles (Idefics3) of all
            prompts in order; ``n`` is 0 without images. Qwen2-VL: the flattened patches of
            all images in order, float32 [n_patches, 3 * temporal_patch_size *
            patch_size**2].
        image_grid_thw: Qwen2-VL only (None otherwise): int64 [n_images, 3] on the CPU, each
            image's (temporal, height, width) grid of patches; an image gives
            ``t * h * w / merge_size**2`` placeholder rows.
    """

    ids: list[list[int]]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None = None

    def tokens(self, pad_id: int, device: str | torch.device | None = None) -> torch.Tensor:
        """The prompts as a left-padded [b, s] int64 batch (see
        :func:`fusion.generation.left_pad`, whose errors it raises)."""
        return left_pad(self.ids, pad_id, device=device)

    def encoder_input(
        self, device: str | torch.device | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, Any]:
        """``encoder_input`` for ``EarlyFusion`` / :func:`fusion.generate`: ``{"image":
        {"pixel_values": ...}}`` (moved to ``device`` / ``dtype`` if given), or ``{}`` without
        images. Qwen2-VL's also holds ``"image_grid_thw"``, which stays on the CPU: the tower
        reads the grids as sizes (to split the images and build their positions), and a copy
        on an accelerator would only be read back."""
        if self.pixel_values.size(0) == 0:
            return {}
        pixel_values = self.pixel_values.to(device=device, dtype=dtype)
        if self.image_grid_thw is None:
            return {"image": {"pixel_values": pixel_values}}
        return {"image": {"pixel_values": pixel_values, "image_grid_thw": self.image_grid_thw}}


class VisionLanguageProcessor:
    """Prompts with image markers, and images -> :class:`VisionInputs`.

    Each marker (``"<image>"``) is replaced by the text of its image's placeholders, as the
    model's Hugging Face processor writes it (LLaVA: the image token once per row; Idefics3:
    per tile a ``<fake_token_around_image>``, a ``<row_r_col_c>`` or ``<global-img>`` tag
    and the image token once per row, see
    :func:`fusion.preprocessing.idefics3_image_text`), then the prompt is tokenized whole, as
    the processor tokenizes it.

    Qwen2-VL, Qwen2.5-VL and Qwen3-VL (``kind="qwen2_vl"``) mark each image as Qwen's chat
    template writes it, ``<|vision_start|><|image_pad|><|vision_end|>``, and the
    ``<|image_pad|>`` becomes one per row of that image (``t * h * w / merge_size**2``, see
    :func:`fusion.preprocessing.qwen2_vl_image_text`); the :class:`VisionInputs` then carry
    the images' ``image_grid_thw`` too.

    Args:
        kind: ``"llava"``, ``"idefics3"`` or ``"qwen2_vl"``.
        image_processor: a :class:`ClipImageProcessor` (LLaVA),
            :class:`Idefics3ImageProcessor` or :class:`Qwen2VLImageProcessor`.
        tokens_per_image: rows per image (LLaVA) or tile (Idefics3); None for Qwen2-VL,
            whose rows vary with each image's size (the attribute is then 1: :meth:`plan`
            counts rows).
        image_size: the side of the square images or tiles the vision tower takes; None for
            Qwen2-VL (the attribute is then the side of its patches).
        image_token_id: the placeholder id; the tokenizer must encode ``"<image>"`` (Qwen2-VL:
            ``"<|image_pad|>"``) as it.
        encode: text -> ids, special tokens (BOS) added as the model expects.
        max_pixels: the most pixels an image may have, as given or at any step of its
            processing (None: :func:`fusion.preprocessing.images.default_max_pixels`,
            Pillow's decompression-bomb limit). Not Qwen2-VL's own ``max_pixels`` setting,
            which its image processor holds.
        max_tiles_per_image: the most tiles one image may be split into (Idefics3).
        max_image_rows: the most placeholder rows the images of one prompt may expand to.
        vision_start_token_id, vision_end_token_id: Qwen2-VL only (and required there): the
            ids of ``<|vision_start|>`` and ``<|vision_end|>``, which must enclose each
            image's placeholders once tokenized.

    The caps are checked from the images' sizes, before any pixel is processed.

    Raises:
        TypeError: ``encode`` not callable.
        ValueError: an unknown ``kind``, an image processor of another kind, a size or cap
            that is not a positive integer or a negative id, an argument given for a kind
            that does not take it (or missing where it is needed).
    """

    def __init__(
        self,
        kind: str,
        image_processor: ImageProcessor,
        *,
        tokens_per_image: int | None = None,
        image_size: int | None = None,
        image_token_id: int,
        encode: Encode,
        max_pixels: int | None = None,
        max_tiles_per_image: int = MAX_TILES_PER_IMAGE,
        max_image_rows: int = MAX_IMAGE_ROWS,
        vision_start_token_id: int | None = None,
        vision_end_token_id: int | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
        if not isinstance(image_processor, KINDS[kind]):
            raise ValueError(
                f"image_processor: expected a {KINDS[kind].__name__} for {kind}, got "
                f"{type(image_processor).__name__}"
            )
        if not callable(encode):
            raise TypeError(f"encode: expected a callable text -> ids, got {type(encode).__name__}")
        qwen = isinstance(image_processor, Qwen2VLImageProcessor)
        per_kind = {
            "tokens_per_image": (tokens_per_image, 1, not qwen),
            "image_size": (image_size, 1, not qwen),
            "vision_start_token_id": (vision_start_token_id, 0, qwen),
            "vision_end_token_id": (vision_end_token_id, 0, qwen),
        }
        for name, (given, _, taken) in per_kind.items():
            if not taken and given is not None:
                raise ValueError(f"{name}: not taken by {kind} (expected None), got {given!r}")
        checked = [(name, value, low) for name, (value, low, taken) in per_kind.items() if taken]
        for name, value, low in (
            *checked,
            ("image_token_id", image_token_id, 0),
            ("max_tiles_per_image", max_tiles_per_image, 1),
            ("max_image_rows", max_image_rows, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        self.kind = kind
        self.max_pixels = check_max_pixels(max_pixels)
        self.image_processor: ImageProcessor
        # The image processor applies the same pixel cap.
        if isinstance(image_processor, Qwen2VLImageProcessor):
            self.image_processor = dataclasses.replace(image_processor, pixel_limit=self.max_pixels)
            # Qwen2-VL's rows vary per image: plan() counts them one by one.
            tokens_per_image, image_size = 1, image_processor.patch_size
        else:
            self.image_processor = dataclasses.replace(image_processor, max_pixels=self.max_pixels)
        assert tokens_per_image is not None and image_size is not None  # checked above
        self.tokens_per_image: int = tokens_per_image
        self.image_size: int = image_size
        self.image_token_id = image_token_id
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        self.encode = encode
        self.max_tiles_per_image = max_tiles_per_image
        self.max_image_rows = max_image_rows

    @classmethod
    def for_model(
        cls,
        model: EarlyFusion,
        encode: Encode,
        image_processor: ClipImageProcessor | Idefics3ImageProcessor | None = None,
    ) -> "VisionLanguageProcessor":
        """For a model as :func:`fusion.models.llava` / :func:`fusion.models.idefics3` (or the
        loaders) make it; ``image_processor`` defaults to the model family's defaults for its
        image size.

        Raises:
            ValueError: ``model`` has no LLaVA or Idefics3 image encoder.
        """
        encoder = model.encoders["image"] if "image" in model.encoders else None
        default: ClipImageProcessor | Idefics3ImageProcessor
        if isinstance(encoder, LlavaImageEncoder):
            kind, size = "llava", encoder.vision_tower.image_size
            default = ClipImageProcessor.for_image_size(size)
        elif isinstance(encoder, Idefics3ImageEncoder):
            kind, size = "idefics3", encoder.vision_model.image_size
            default = Idefics3ImageProcessor.for_image_size(size)
        else:
            raise ValueError(
                "model: expected an 'image' encoder of LLaVA or Idefics3, got "
                f"{type(encoder).__name__}"
            )
        return cls(
            kind,
            image_processor or default,
            tokens_per_image=encoder.tokens_per_image,
            image_size=size,
            image_token_id=model.encoder_tokens["image"],
            encode=encode,
        )

    @classmethod
    def from_directory(
        cls,
        directory: str | bytes | os.PathLike,
        *,
        encode: Encode | None = None,
        max_pixels: int | None = None,
        max_tiles_per_image: int = MAX_TILES_PER_IMAGE,
        max_image_rows: int = MAX_IMAGE_ROWS,
    ) -> "VisionLanguageProcessor":
        """From a model directory, read as ``transformers`` reads it:

        - ``config.json``: the model (placeholder id, rows per image or tile, the tower's
          image size; Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the placeholder, start and end ids and
          the tower's patch, merge and temporal patch sizes, see
          :func:`fusion.preprocessing.qwen2_vl.read_qwen2_vl_layout`);
        - the image processor's settings from the first place that holds them, in
          ``transformers``' order: the ``"image_processor"`` object of
          ``processor_config.json`` (what transformers 5's ``save_pretrained`` writes), then
          ``preprocessor_config.json``; with neither, the family's defaults for the tower's
          image size (Qwen2-VL, Qwen2.5-VL: transformers' defaults with the tower's patch
          sizes; Qwen3-VL: its published settings, see
          :func:`fusion.preprocessing.qwen2_vl.default_image_processor`), said once in a
          warning naming them. The Qwen families' pixel range is read as transformers
          5.24 reads it (:meth:`Qwen2VLImageProcessor.from_config`: ``min_pixels`` /
          ``max_pixels`` over ``size``);
        - the top level of ``processor_config.json`` (``image_seq_len`` of Idefics3 /
          SmolVLM; ``patch_size``, ``num_additional_image_tokens`` and
          ``vision_feature_select_strategy`` of LLaVA), checked against the model;
        - unless ``encode`` is given, ``tokenizer.json`` (read with ``tokenizers``).

        Image sizes the settings lead to are checked against the tower (crops or tiles of
        its image size; Qwen2-VL: its patch sizes) before any image is processed.
        ``max_pixels``, ``max_tiles_per_image`` and ``max_image_rows`` are as for the
        constructor.

        Raises:
            CheckpointError: naming the file and key: a config that describes no LLaVA,
                Idefics3 or Qwen2-VL model, a processor file that exists but cannot be read,
                settings that contradict the model (``image_seq_len``, ``patch_size``, a crop
                or tile size other than the tower's), no ``tokenizer.json`` and no ``encode``.
            ImportError: ``tokenizer.json`` must be read and ``tokenizers`` is missing.
            ValueError: a bad value in the image processor's settings (named with file and
                key, e.g. a size above 4096, or Qwen2-VL's ``max_pixels`` above 4096 * 4096);
                Qwen2-VL patch sizes other than the tower's; a bad cap.
        """
        directory = Path(os.fsdecode(directory))
        if _is_qwen2_vl(directory):
            return cls._from_qwen2_vl_directory(
                directory,
                encode=encode,
                max_pixels=max_pixels,
                max_tiles_per_image=max_tiles_per_image,
                max_image_rows=max_image_rows,
            )
        layout: VlmImageLayout = read_hf_vlm_layout(directory)
        found = _image_processor_settings(directory)
        image_processor: ClipImageProcessor | Idefics3ImageProcessor
        family = ClipImageProcessor if layout.kind == "llava" else Idefics3ImageProcessor
        if found is None:
            image_processor = family.for_image_size(layout.image_size)
            what = f"the {layout.kind} defaults for the tower's {layout.image_size}-pixel images"
            _warn_defaults(directory, f"{what}: {image_processor}", stacklevel=2)
        else:
            settings, where = found
            image_processor = family.from_config(settings, where)
            _check_against_tower(image_processor, layout, where)
        _check_processor_config(directory, layout)
        return cls(
            layout.kind,
            image_processor,
            tokens_per_image=layout.tokens_per_image,
            image_size=layout.image_size,
            image_token_id=layout.image_token_id,
            encode=encode or _tokenizer_encode(directory),
            max_pixels=max_pixels,
            max_tiles_per_image=max_tiles_per_image,
            max_image_rows=max_image_rows,
        )

    @classmethod
    def _from_qwen2_vl_directory(
        cls,
        directory: Path,
        *,
        encode: Encode | None,
        max_pixels: int | None,
        max_tiles_per_image: int,
        max_image_rows: int,
    ) -> "VisionLanguageProcessor":
        """:meth:`from_directory` for Qwen2-VL, Qwen2.5-VL and Qwen3-VL."""
        layout: Qwen2VLLayout = read_qwen2_vl_layout(directory)
        found = _image_processor_settings(directory)
        if found is None:
            image_processor = default_image_processor(layout)
            qwen3 = layout.model_type == "qwen3_vl"
            which = "Qwen3-VL's published settings" if qwen3 else "transformers' Qwen2-VL defaults"
            what = f"{which} with the tower's patch sizes: {image_processor}"
            _warn_defaults(directory, what, stacklevel=3)
        else:
            settings, where = found
            image_processor = Qwen2VLImageProcessor.from_config(settings, where)
            check_against_tower(image_processor, layout, where)
        return cls(
            "qwen2_vl",
            image_processor,
            image_token_id=layout.image_token_id,
            vision_start_token_id=layout.vision_start_token_id,
            vision_end_token_id=layout.vision_end_token_id,
            encode=encode or _tokenizer_encode(directory),
            max_pixels=max_pixels,
            max_tiles_per_image=max_tiles_per_image,
            max_image_rows=max_image_rows,
        )

    def plan(self, prompts: Sequence[str], images: Sequence[object]) -> list[int]:
        """The tiles each image gives (1 per LLaVA image; Qwen2-VL: its placeholder rows),
        from the images' sizes alone, every cap checked: the pixels of each image at every
        step, the tiles per image and the placeholder rows per prompt (Qwen2-VL: the aspect
        ratio too, and the mode, as :meth:`Qwen2VLImageProcessor.check` does).

        Raises:
            TypeError, ValueError: an image that cannot be taken, or a cap exceeded (named by
                the image's index or the prompt's).
        """
        marker = QWEN2_VL_IMAGE_MARKER if self.kind == "qwen2_vl" else IMAGE_TOKEN
        counts = [prompt.count(marker) for prompt in prompts]
        tiles = []
        for i, image in enumerate(images):
            name = f"images[{i}]"
            if isinstance(self.image_processor, Qwen2VLImageProcessor):
                t, h, w = self.image_processor.check(image, name)
                tiles.append(t * h * w // self.image_processor.merge_size**2)
                continue
            height, width = image_size(image, name)
            if isinstance(self.image_processor, ClipImageProcessor):
                sizes, grid = self.image_processor.steps(height, width), 0
            else:
                sizes, rows, cols = self.image_processor.steps(height, width)
                grid = rows * cols
            check_pixels(sizes, self.max_pixels, name)
            tiles.append(grid + 1)
            if grid + 1 > self.max_tiles_per_image:
                raise ValueError(
                    f"{name}: {height} x {width} pixels would be split into {grid + 1} tiles, "
                    f"more than max_tiles_per_image={self.max_tiles_per_image}"
                )
        first = 0
        for i, count in enumerate(counts):
            rows = sum(tiles[first : first + count]) * self.tokens_per_image
            first += count
            if rows > self.max_image_rows:
                raise ValueError(
                    f"prompts[{i}]: its {count} image(s) would expand to {rows} placeholder "
                    f"rows, more than max_image_rows={self.max_image_rows}"
                )
        return tiles

    def __call__(self, prompts: str | Sequence[str], images: Sequence[object] = ()) -> VisionInputs:
        """Expand, tokenize and process.

        Args:
            prompts: one prompt or several; each ``"<image>"`` marks where an image goes
                (Qwen2-VL: each ``"<|vision_start|><|image_pad|><|vision_end|>"``).
            images: the images, in the order of the markers (through the first prompt, then
                the next...): uint8 tensors [1, 3 or 4, h, w] (L, RGB, RGBA) or Pillow images.

        Raises:
            TypeError: ``prompts`` not strings; ``images`` not a sequence.
            ValueError: before any image is processed, a number of markers other than the
                number of images; an image that cannot be taken (named by its index, e.g. a
                16-bit or 2-channel one); a cap exceeded (see :meth:`plan`); images processed
                to a size the vision tower does not take (an image processor at odds with the
                model); Qwen2-VL: an image's aspect ratio above 200, an ``<|image_pad|>``
                outside a marker, a ``<|video_pad|>`` (videos are not taken); an empty
                prompt;
                placeholder ids in the tokenized prompts that do not match the images' rows
                (the tokenizer does not encode ``"<image>"`` as the one token
                ``image_token_id``, or a prompt holds that token itself; Qwen2-VL: each
                image's run of placeholders not between the start and end ids).
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not isinstance(images, Sequence) or isinstance(images, str | bytes):
            raise TypeError(f"images: expected a sequence of images, got {type(images).__name__}")
        if self.kind == "qwen2_vl":
            return self._qwen2_vl(prompts, images)
        check_marker_count(prompts, len(images), IMAGE_TOKEN)
        self.plan(prompts, images)
        pixel_values: torch.Tensor
        if isinstance(self.image_processor, ClipImageProcessor):
            pixel_values = self.image_processor(images)
            texts = [IMAGE_TOKEN * self.tokens_per_image] * len(images)
            tiles = len(images)
        elif isinstance(self.image_processor, Idefics3ImageProcessor):
            tiled = self.image_processor(images)
            pixel_values = (
                torch.cat([t.tiles for t in tiled])
                if tiled
                else torch.empty(0, 3, self.image_size, self.image_size)
            )
            texts = [idefics3_image_text(t.rows, t.cols, self.tokens_per_image) for t in tiled]
            tiles = pixel_values.size(0)
        else:  # as __init__ checked
            raise TypeError(f"image_processor: unexpected {type(self.image_processor).__name__}")
        if images and pixel_values.shape[1:] != (3, self.image_size, self.image_size):
            raise ValueError(
                f"image_processor: gives images of {list(pixel_values.shape[2:])} pixels, but the "
                f"vision tower takes {self.image_size} x {self.image_size}"
            )
        ids = []
        for i, text in enumerate(expand_markers(prompts, texts, IMAGE_TOKEN)):
            encoded = [int(t) for t in self.encode(text)]
            if not encoded:
                raise ValueError(f"prompts[{i}]: the tokenizer gives no tokens")
            ids.append(encoded)
        found = sum(row.count(self.image_token_id) for row in ids)
        if found != tiles * self.tokens_per_image:
            raise ValueError(
                f"prompts: the tokenized prompts hold {found} placeholder ids "
                f"({self.image_token_id}), but the images give {tiles * self.tokens_per_image} "
                f"rows; the tokenizer must encode {IMAGE_TOKEN!r} as the single token "
                f"{self.image_token_id}, and prompts must not hold it otherwise"
            )
        return VisionInputs(ids, pixel_values)

    def _qwen2_vl(self, prompts: list[str], images: Sequence[object]) -> VisionInputs:
        """:meth:`__call__` for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: markers checked, every
        image planned from its size, then the patches made and the expanded prompts
        tokenized."""
        check_marker_count(prompts, len(images), QWEN2_VL_IMAGE_MARKER)
        for i, prompt in enumerate(prompts):
            if prompt.count(VIDEO_PAD):
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
        rows = self.plan(prompts, images)
        image_processor = self.image_processor
        if not isinstance(image_processor, Qwen2VLImageProcessor):  # as __init__ checked
            raise TypeError(
                f"image_processor: expected a Qwen2VLImageProcessor, got {image_processor!r}"
            )
        patched = image_processor(images)
        texts = [qwen2_vl_image_text(r) for r in rows]
        ids = []
        first = 0
        for i, text in enumerate(expand_markers(prompts, texts, QWEN2_VL_IMAGE_MARKER)):
            encoded = [int(t) for t in self.encode(text)]
            if not encoded:
                raise ValueError(f"prompts[{i}]: the tokenizer gives no tokens")
            count = prompts[i].count(QWEN2_VL_IMAGE_MARKER)
            self._check_runs(encoded, rows[first : first + count], f"prompts[{i}]")
            first += count
            ids.append(encoded)
        return VisionInputs(ids, patched.pixel_values, patched.image_grid_thw)

    def _check_runs(self, ids: list[int], rows: list[int], name: str) -> None:
        """Raise ``ValueError`` unless ``ids`` hold, in order, one run of placeholder ids per
        image, of that image's ``rows``, each right after ``vision_start_token_id`` and right
        before ``vision_end_token_id`` (the tokenizer and ``config.json`` agree on the ids)."""
        placeholder, start, end = (
            self.image_token_id,
            self.vision_start_token_id,
            self.vision_end_token_id,
        )
        runs, bracketed, i = [], True, 0
        while i < len(ids):
            if ids[i] != placeholder:
                i += 1
                continue
            first = i
            while i < len(ids) and ids[i] == placeholder:
                i += 1
            runs.append(i - first)
            bracketed &= first > 0 and ids[first - 1] == start and i < len(ids) and ids[i] == end
        if runs != rows or not bracketed:
            raise ValueError(
                f"{name}: the tokenized prompt holds runs of {runs} placeholder ids "
                f"({placeholder}){'' if bracketed else ', not all between the start and end ids'}"
                f", but its images give {rows} rows, each between {start} and {end}; the "
                f"tokenizer must encode {IMAGE_PAD!r}, {VISION_START!r} and {VISION_END!r} as "
                "the single tokens config.json names (image_token_id, vision_start_token_id, "
                "vision_end_token_id), and prompts must not hold them otherwise"
            )


def _tokenizer_encode(directory: Path) -> Encode:
    """The encoder of the directory's ``tokenizer.json``, read bounded (untrusted text)."""
    try:
        tokenizer = read_tokenizer(
            directory / TOKENIZER_FILE,
            missing="text prompts need the model's tokenizer (or pass encode)",
        )
    except ImportError:
        raise ImportError(
            "reading tokenizer.json needs the tokenizers package: pip install tokenizers "
            "(or pass encode)"
        ) from None
    return lambda text: tokenizer.encode(text).ids


def _warn_defaults(directory: Path, what: str, stacklevel: int) -> None:
    """Say once per directory that it holds no image processor settings, and what is used."""
    if str(directory.resolve()) in _WARNED_DEFAULTS:
        return
    _WARNED_DEFAULTS.add(str(directory.resolve()))
    warnings.warn(
        f"{directory}: no image processor settings (neither {PREPROCESSOR_CONFIG} nor an "
        f"'image_processor' in {PROCESSOR_CONFIG}); using {what}",
        stacklevel=stacklevel + 1,  # from the caller of from_directory
    )


def _image_processor_settings(directory: Path) -> tuple[dict[str, Any], str] | None:
    """The image processor's settings and where they were found, as transformers looks for
    them: the ``"image_processor"`` object of ``processor_config.json`` first, then
    ``preprocessor_config.json``; None when neither holds them. A file that exists is read
    (and refused, named, when it cannot be)."""
    file = directory / PROCESSOR_CONFIG
    if file.exists():
        nested = read_hf_config(file).get("image_processor")
        if nested is not None:
            if not isinstance(nested, dict):
                raise CheckpointError(file, "image_processor", "expected an object")
            return nested, f"{file}: image_processor"
    file = directory / PREPROCESSOR_CONFIG
    if file.exists():
        return read_hf_config(file), str(file)
    return None


def _check_against_tower(
    processor: ClipImageProcessor | Idefics3ImageProcessor, layout: VlmImageLayout, where: str
) -> None:
    """Settings that would give images of another size than the tower takes are refused
    before any image is processed (naming the file and key)."""
    side = layout.image_size
    got: tuple[int | None, int | None]
    if isinstance(processor, ClipImageProcessor):
        if processor.do_center_crop:
            key, got = "crop_size", (processor.crop_height, processor.crop_width)
        elif processor.do_resize and processor.shortest_edge is None:
            key, got = "size", (processor.height, processor.width)
        else:
            raise ValueError(
                f"{where}: do_center_crop: false, with a size other than height and width, "
                f"gives images of varying sizes; the vision tower takes {side} x {side}"
            )
    else:
        key, got = "max_image_size.longest_edge", (processor.max_image_size,) * 2
    if got != (side, side):
        raise ValueError(
            f"{where}: {key}: gives images of {got[0]} x {got[1]} pixels, but the vision tower "
            f"(config.json, vision_config.image_size) takes {side} x {side}"
        )


def _check_processor_config(directory: Path, layout: VlmImageLayout) -> None:
    """The top level of ``processor_config.json`` (the processor's own arguments) must agree
    with the model on the rows per image or tile."""
    file = directory / PROCESSOR_CONFIG
    if not file.exists():
        return
    config = read_hf_config(file)
    if layout.kind == "idefics3":
        seq_len = config.get("image_seq_len")
        if seq_len not in (None, layout.tokens_per_image):
            raise CheckpointError(
                file,
                "image_seq_len",
                f"{seq_len!r}, but the model gives {layout.tokens_per_image} rows per tile",
            )
        return
    patch = config.get("patch_size")
    if patch is None:
        return
    extra = config.get("num_additional_image_tokens", 0)
    strategy = config.get("vision_feature_select_strategy", "default")
    for key, value, low in (("patch_size", patch, 1), ("num_additional_image_tokens", extra, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 1 << 16:
            raise CheckpointError(file, key, f"expected an integer >= {low}, got {value!r}")
    if strategy not in ("default", "full"):
        expected = f"expected 'default' or 'full', got {strategy!r}"
        raise CheckpointError(file, "vision_feature_select_strategy", expected)
    rows = rows_per_image((layout.image_size // patch) ** 2, strategy, extra)
    if rows != layout.tokens_per_image:
        raise CheckpointError(
            file,
            "patch_size",
            f"{patch} (with num_additional_image_tokens={extra}, "
            f"vision_feature_select_strategy={strategy!r}) gives {rows} rows per image, but the "
            f"model gives {layout.tokens_per_image}",
        )


def prepare_inputs(
    directory: str | bytes | os.PathLike,
    prompts: str | Sequence[str],
    images: Sequence[object] = (),
    *,
    encode: Encode | None = None,
    max_pixels: int | None = None,
    max_tiles_per_image: int = MAX_TILES_PER_IMAGE,
    max_image_rows: int = MAX_IMAGE_ROWS,
) -> VisionInputs:
    """``VisionLanguageProcessor.from_directory(directory, ...)(prompts, images)``: what a
    command line needs to run a LLaVA, Idefics3, Qwen2-VL, Qwen2.5-VL or Qwen3-VL directory on
    image files (decode them with :func:`fusion.preprocessing.load_image`, with the same
    ``max_pixels``). Raises as those
    two do."""
    processor = VisionLanguageProcessor.from_directory(
        directory,
        encode=encode,
        max_pixels=max_pixels,
        max_tiles_per_image=max_tiles_per_image,
        max_image_rows=max_image_rows,
    )
    return processor(prompts, images)
