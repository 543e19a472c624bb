"""Prompts and images -> token ids and pixels, for any registered vision-language family.

:class:`VisionLanguageProcessor` is one path for every family: one :meth:`~VisionLanguageProcessor.
from_directory` and one ``__call__`` (markers checked, every image planned from its size,
the markers expanded, the images processed, the prompts tokenized and their placeholder ids
checked). What differs between families is a subclass's few hooks: its marker and
placeholder text, the rows an image of a given size gives, the pixels, the id check and how a
directory's settings are read. Each family's home defines its subclass beside its image
processor (e.g. :mod:`fusion.families.qwen_vl.processor`), registered in :data:`KINDS` under
its ``kind``, and the family names that kind (:attr:`fusion.families.Family.processor`).

This module stands below the families' processors, which subclass its classes; the registry
(:mod:`fusion.families`), which imports them, is looked up only when a directory's or a
model's family is asked for (:meth:`~VisionLanguageProcessor.from_directory`,
:meth:`~VisionLanguageProcessor.for_model`), never when this module is imported.
"""

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from fusion._validation import check_int
from fusion.early_fusion import EarlyFusion
from fusion.families.base import Family
from fusion.families.directory import HfDirectory, VlmImageLayout, hf_model_kind, read_hf_vlm_layout
from fusion.hf.config import read_hf_config
from fusion.hf.errors import CheckpointError
from fusion.hf.files import read_tokenizer
from fusion.media.images import check_max_pixels, check_pixels, image_size
from fusion.media.prompts import check_marker_count, count_markers, expand_markers
from fusion.padding import left_pad

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"
TOKENIZER_FILE = "tokenizer.json"
IMAGE_TOKEN = "<image>"
# Caps on what the images of a prompt may cost, above any published model's needs (an image
# split into at most 4 x 4 tiles plus the whole, of 64 to 169 rows each; 576 rows per
# whole image).
MAX_TILES_PER_IMAGE = 256
MAX_IMAGE_ROWS = 1 << 16
_WARNED_DEFAULTS: set[str] = set()  # directories whose defaults were announced

Encode = Callable[[str], list[int]]
#: kind -> its processor class, registered by each subclass that sets ``kind``.
KINDS: dict[str, type["VisionLanguageProcessor"]] = {}


def detect_model_kind(directory: str | bytes | os.PathLike) -> str:
    """The :class:`VisionLanguageProcessor` kind a model directory's (or ``config.json``'s)
    family takes, or the family's name for a text-only one (``"llama"``): what it describes,
    as preprocessing sees it (see :func:`fusion.checkpoint.hf_vlm.hf_model_kind`, whose
    errors it raises)."""
    from fusion.families import family_named

    family = family_named(hf_model_kind(directory))
    return family.processor or family.name


@dataclass(frozen=True)
class VisionInputs:
    """What a prompt batch gives the model.

    Attributes:
        ids: the token ids of each prompt, image markers expanded to placeholder ids.
        pixel_values: float32 [n, 3, s, s], the images or tiles of all prompts in order;
            ``n`` is 0 without images. For towers taking patches of images of any size: the
            flattened patches of all images in order, float32 [n_patches, 3 *
            temporal_patch_size * patch_size**2].
        image_grid_thw: for those towers only (None otherwise): int64 [n_images, 3] on the
            CPU, each image's (temporal, height, width) grid of patches; an image gives
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
        images. With grids it also holds ``"image_grid_thw"``, which stays on the CPU: the
        tower reads the grids as sizes (to split the images and build their positions), and a
        copy on an accelerator would only be read back."""
        if self.pixel_values.size(0) == 0:
            return {}
        pixel_values = self.pixel_values.to(device=device, dtype=dtype)
        if self.image_grid_thw is None:
            return {"image": {"pixel_values": pixel_values}}
        return {"image": {"pixel_values": pixel_values, "image_grid_thw": self.image_grid_thw}}


class VisionLanguageProcessor:
    """Prompts with image markers, and images -> :class:`VisionInputs`.

    Each marker (``"<image>"``, or the family's own, :attr:`marker`) is replaced by the text
    of its image's placeholders, as the model's Hugging Face processor writes it (the
    subclass's :meth:`_image_text`: e.g. the image token once per row, or per tile a tag
    and the image token once per row), then the prompt is tokenized whole, as the processor
    tokenizes it. Families whose towers take images of any size give their
    :class:`VisionInputs` the images' ``image_grid_thw`` too.

    ``VisionLanguageProcessor(kind, ...)`` makes the processor of that kind (:data:`KINDS`).

    Args:
        kind: one of :data:`KINDS` (see :func:`detect_model_kind`).
        image_processor: that kind's image processor (its ``image_processor_type``).
        tokens_per_image: rows per image or tile; None for kinds whose rows vary with each
            image's size (the attribute is then 1: :meth:`plan` counts rows).
        image_size: the side of the square images or tiles the vision tower takes; None for
            those kinds (the attribute is then the side of its patches).
        image_token_id: the placeholder id; the tokenizer must encode :attr:`placeholder` as
            it.
        encode: text -> ids, special tokens (BOS) added as the model expects.
        max_pixels: the most pixels an image may have, as given or at any step of its
            processing (None: :func:`fusion.media.images.default_max_pixels`,
            Pillow's decompression-bomb limit). Not an image processor's own ``max_pixels``
            setting.
        max_tiles_per_image: the most tiles one image may be split into.
        max_image_rows: the most placeholder rows the images of one prompt may expand to.
        vision_start_token_id, vision_end_token_id: for kinds that enclose each image's
            placeholders (and required there): the ids that must enclose them once tokenized.

    The caps are checked from the images' sizes, before any pixel is processed.

    Raises:
        TypeError: ``encode`` not callable.
        ValueError: an unknown ``kind``, an image processor of another kind, a size or cap
            that is not a positive integer or a negative id, an argument given for a kind
            that does not take it (or missing where it is needed).
    """

    kind: ClassVar[str]
    image_processor_type: ClassVar[Any]
    marker: ClassVar[str] = IMAGE_TOKEN  # what a prompt marks each image with
    placeholder: ClassVar[str] = IMAGE_TOKEN  # the text tokenized as image_token_id
    takes: ClassVar[tuple[str, ...]] = ()  # the constructor's per-kind arguments it takes
    pixel_cap: ClassVar[str] = "max_pixels"  # the image processor's field max_pixels sets
    for_models: ClassVar[bool] = False  # whether for_model makes one

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            KINDS[cls.kind] = cls

    def __new__(cls, kind: object = None, *args: Any, **kwargs: Any) -> "VisionLanguageProcessor":
        if cls is VisionLanguageProcessor and isinstance(kind, str) and kind in KINDS:
            cls = KINDS[kind]  # the processor of that kind
        return super().__new__(cls)

    def __init__(
        self,
        kind: str,
        image_processor: Any,
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
        if kind not in KINDS or not isinstance(self, KINDS[kind]):
            raise ValueError(f"kind: expected one of {sorted(KINDS)}, got {kind!r}")
        if not isinstance(image_processor, self.image_processor_type):
            raise ValueError(
                f"image_processor: expected a {self.image_processor_type.__name__} for {kind}, "
                f"got {type(image_processor).__name__}"
            )
        if not callable(encode):
            raise TypeError(f"encode: expected a callable text -> ids, got {type(encode).__name__}")
        per_kind = {
            "tokens_per_image": (tokens_per_image, 1),
            "image_size": (image_size, 1),
            "vision_start_token_id": (vision_start_token_id, 0),
            "vision_end_token_id": (vision_end_token_id, 0),
        }
        for name, (given, _) in per_kind.items():
            if name not in self.takes and given is not None:
                raise ValueError(f"{name}: not taken by {kind} (expected None), got {given!r}")
        checked = [
            (name, value, low) for name, (value, low) in per_kind.items() if name in self.takes
        ]
        for name, value, low in (
            *checked,
            ("image_token_id", image_token_id, 0),
            ("max_tiles_per_image", max_tiles_per_image, 1),
            ("max_image_rows", max_image_rows, 1),
        ):
            check_int(value, name, low=low, expected=f"an integer >= {low}")
        self.max_pixels = check_max_pixels(max_pixels)
        # The image processor applies the same pixel cap.
        self.image_processor: Any = dataclasses.replace(
            image_processor, **{self.pixel_cap: self.max_pixels}
        )
        self.tokens_per_image, self.image_size = self._sizes(tokens_per_image, image_size)
        self.image_token_id = image_token_id
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        self.encode = encode
        self.max_tiles_per_image = max_tiles_per_image
        self.max_image_rows = max_image_rows

    @classmethod
    def for_model(
        cls, model: EarlyFusion, encode: Encode, image_processor: Any = None
    ) -> "VisionLanguageProcessor":
        """For a model as its family's builder (or the loaders) make it, of a family whose
        tower takes square images; ``image_processor`` defaults to the family's defaults for
        its image size.

        Raises:
            ValueError: ``model`` has no image encoder of such a family.
        """
        encoder = model.encoders["image"] if "image" in model.encoders else None
        takers = [f for f in _processed_families() if KINDS[cast(str, f.processor)].for_models]
        family = next((f for f in takers if isinstance(encoder, f.encoder_types)), None)
        if family is None:
            raise ValueError(
                f"model: expected an 'image' encoder of {' or '.join(f.what for f in takers)}, "
                f"got {type(encoder).__name__}"
            )
        kind = KINDS[cast(str, family.processor)]
        size = kind.tower_image_size(encoder)
        return kind(
            kind.kind,
            image_processor or kind.image_processor_type.for_image_size(size),
            tokens_per_image=cast(Any, encoder).tokens_per_image,
            image_size=size,
            image_token_id=model.encoder_tokens["image"],
            encode=encode,
        )

    @classmethod
    def from_directory(
        cls,
        directory: str | bytes | os.PathLike | HfDirectory,
        *,
        encode: Encode | None = None,
        max_pixels: int | None = None,
        max_tiles_per_image: int = MAX_TILES_PER_IMAGE,
        max_image_rows: int = MAX_IMAGE_ROWS,
    ) -> "VisionLanguageProcessor":
        """From a model directory (or its :class:`~fusion.checkpoint.hf_model.HfDirectory`, whose
        parsed ``config.json`` is used as it is), read as ``transformers`` reads it:

        - ``config.json``: its family (:attr:`fusion.families.Family.processor` names the
          kind), and what the kind needs of the model (placeholder id, rows per image or
          tile and the tower's image size, see
          :func:`fusion.checkpoint.hf_vlm.read_hf_vlm_layout`; or the placeholder, start and
          end ids and the tower's patch sizes);
        - the image processor's settings from the first place that holds them, in
          ``transformers``' order: the ``"image_processor"`` object of
          ``processor_config.json`` (what transformers 5's ``save_pretrained`` writes), then
          ``preprocessor_config.json``; with neither, the family's defaults for the tower,
          said once in a warning naming them;
        - the top level of ``processor_config.json`` (e.g. ``image_seq_len``, ``patch_size``,
          ``num_additional_image_tokens``, ``vision_feature_select_strategy``), checked
          against the model;
        - unless ``encode`` is given, ``tokenizer.json`` (read with ``tokenizers``).

        Image sizes the settings lead to are checked against the tower (crops or tiles of
        its image size, or its patch sizes) before any image is processed. ``max_pixels``,
        ``max_tiles_per_image`` and ``max_image_rows`` are as for the constructor.

        Raises:
            CheckpointError: naming the file and key: a config that describes no model a
                processor is registered for, a processor file that exists but cannot be
                read, settings that contradict the model (``image_seq_len``, ``patch_size``, a
                crop or tile size other than the tower's), no ``tokenizer.json`` and no
                ``encode``.
            ImportError: ``tokenizer.json`` must be read and ``tokenizers`` is missing.
            ValueError: a bad value in the image processor's settings (named with file and
                key, e.g. a size above 4096, or a ``max_pixels`` above 4096 * 4096); patch
                sizes other than the tower's; a bad cap.
        """
        from fusion.families import family_of

        hf = HfDirectory.of(directory, "directory")
        family = family_of(hf.config, source=hf.config_file, among=_processed_families())
        kind = KINDS[cast(str, family.processor)]
        image_processor, model = kind.read_directory(hf)
        return kind(
            kind.kind,
            image_processor,
            **model,
            encode=encode or _tokenizer_encode(hf.path),
            max_pixels=max_pixels,
            max_tiles_per_image=max_tiles_per_image,
            max_image_rows=max_image_rows,
        )

    def plan(self, prompts: Sequence[str], images: Sequence[object]) -> list[int]:
        """The tiles each image gives (1 per whole image; for kinds whose rows vary with the
        image: its placeholder rows), from the images' sizes alone, every cap checked: the
        pixels of each image at every step, the tiles per image and the placeholder rows per
        prompt (and what the kind's image processor checks from a size, e.g. the aspect
        ratio and mode).

        Raises:
            TypeError, ValueError: an image that cannot be taken, or a cap exceeded (named by
                the image's index or the prompt's).
        """
        counts = count_markers(prompts, self.marker)
        tiles = [self._plan_image(image, f"images[{i}]") for i, image in enumerate(images)]
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

    def expand(
        self, prompts: Sequence[str], images: Sequence[object]
    ) -> tuple[list[str], list[int]]:
        """The prompts with each marker replaced by the placeholder text of its image, and
        each image's tiles (:meth:`plan`), from the images' sizes alone (nothing processed).

        Raises:
            TypeError, ValueError: a number of markers other than the number of images; as
                :meth:`plan`.
        """
        check_marker_count(prompts, len(images), self.marker)
        tiles = self.plan(prompts, images)
        texts = [
            self._image_text(*image_size(image, f"images[{i}]"), count)
            for i, (image, count) in enumerate(zip(images, tiles, strict=True))
        ]
        return expand_markers(prompts, texts, self.marker), tiles

    def __call__(
        self,
        prompts: str | Sequence[str],
        images: Sequence[object] = (),
        *,
        video_texts: Sequence[str] = (),
    ) -> VisionInputs:
        """Expand, tokenize and process.

        Args:
            prompts: one prompt or several; each :attr:`marker` marks where an image goes.
            images: the images, in the order of the markers (through the first prompt, then
                the next...): uint8 tensors [1, 3 or 4, h, w] (L, RGB, RGBA) or Pillow images.
            video_texts: for kinds taking videos (Qwen2-VL's), each video's text (its
                video processor's ``video_text``), replacing the prompts' video placeholders
                in order; their patches are the video processor's to make.

        Raises:
            TypeError: ``prompts`` not strings; ``images`` not a sequence.
            ValueError: before any image is processed, a number of markers other than the
                number of images (or of video placeholders other than of ``video_texts``),
                or a prompt the kind refuses (e.g. a placeholder outside a marker, a video's
                placeholder without ``video_texts``; ``video_texts`` for a kind taking no
                videos); an image that cannot be taken (named by its
                index, e.g. a 16-bit or 2-channel one); a cap exceeded (see :meth:`plan`);
                images processed to a size the vision tower does not take (an image processor
                at odds with the model); an empty prompt; placeholder ids in the tokenized
                prompts that do not match the images' rows (the tokenizer does not encode
                :attr:`placeholder` as the one token ``image_token_id``, or a prompt holds
                that token itself; each image's run of placeholders not between the start and
                end ids, for kinds that take them).
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not isinstance(images, Sequence) or isinstance(images, str | bytes):
            raise TypeError(f"images: expected a sequence of images, got {type(images).__name__}")
        check_marker_count(prompts, len(images), self.marker)
        self._check_prompts(prompts, videos=bool(video_texts))
        texts, tiles = self.expand(prompts, images)
        if video_texts:
            texts = self._expand_videos(texts, video_texts)
        pixel_values, grids = self.pixels(images)
        ids = []
        for i, text in enumerate(texts):
            encoded = [int(t) for t in self.encode(text)]
            if not encoded:
                raise ValueError(f"prompts[{i}]: the tokenizer gives no tokens")
            ids.append(encoded)
        self.check_ids(ids, prompts, tiles)
        return VisionInputs(ids, pixel_values, grids)

    def check_placeholder_count(
        self, ids: Sequence[Sequence[int]], rows: int, subject: str = "prompts hold"
    ) -> None:
        """Raise ``ValueError`` unless ``ids`` (each prompt's) hold ``rows`` placeholder ids
        in all (``subject``: the words the message says they hold it with)."""
        found = sum(list(row).count(self.image_token_id) for row in ids)
        if found != rows:
            raise ValueError(
                f"prompts: the tokenized {subject} {found} placeholder ids "
                f"({self.image_token_id}), but the images give {rows} rows; the tokenizer must "
                f"encode {self.placeholder!r} as the single token {self.image_token_id}, and "
                "prompts must not hold it otherwise"
            )

    def check_ids(self, ids: list[list[int]], prompts: Sequence[str], tiles: list[int]) -> None:
        """Raise ``ValueError`` unless the tokenized prompts hold their images' placeholder
        ids (each image's ``tiles * tokens_per_image``), and no other."""
        self.check_placeholder_count(ids, sum(tiles) * self.tokens_per_image)

    def pixels(self, images: Sequence[object]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The images processed (in order, each on its own), and their grids (None for kinds
        without).

        Raises:
            TypeError, ValueError: an image the image processor cannot take, or sizes the
                vision tower does not take.
        """
        raise NotImplementedError

    def made(self, pixel_values: torch.Tensor, grids: torch.Tensor | None) -> int:
        """The tiles (:meth:`plan`'s unit) that :meth:`pixels` made."""
        return pixel_values.size(0)

    # The hooks of a kind.

    @classmethod
    def read_directory(cls, directory: HfDirectory) -> tuple[Any, dict[str, Any]]:
        """(the image processor, the constructor's model arguments) of ``directory``, as
        :meth:`from_directory` describes."""
        raise NotImplementedError

    @staticmethod
    def tower_image_size(encoder: Any) -> int:
        """(``for_models`` kinds) The side of the images an image encoder takes."""
        raise NotImplementedError

    def _sizes(self, tokens_per_image: int | None, image_size: int | None) -> tuple[int, int]:
        """The ``tokens_per_image`` and ``image_size`` attributes, from the arguments."""
        assert tokens_per_image is not None and image_size is not None  # checked
        return tokens_per_image, image_size

    def _check_prompts(self, prompts: Sequence[str], videos: bool = False) -> None:
        """Refuse (``ValueError``) prompts the kind cannot take, before any image is
        planned (``videos``: video texts are given for the prompts' video placeholders)."""

    def _expand_videos(self, texts: list[str], video_texts: Sequence[str]) -> list[str]:
        """The prompts with each video's placeholder replaced by its text (kinds taking
        videos)."""
        raise ValueError(f"video_texts: the {self.kind} processor takes no videos")

    def _plan_image(self, image: object, name: str) -> int:
        """One image's tiles, every cap checked from its size."""
        raise NotImplementedError

    def _image_text(self, height: int, width: int, tiles: int) -> str:
        """The placeholder text of an image of this size, which gives ``tiles``."""
        raise NotImplementedError


class SquareImagesProcessor(VisionLanguageProcessor):
    """A processor of a family whose tower takes square images or tiles of one side,
    :attr:`image_size`, each giving :attr:`tokens_per_image` rows. A subclass gives its
    image processor's steps (:meth:`_steps`), tiles (:meth:`_tiles`), the image processor
    settings to check against the tower (:meth:`_tower_setting`) and its check of the top
    level of ``processor_config.json`` (:meth:`_check_processor_config`)."""

    takes = ("tokens_per_image", "image_size")
    for_models = True
    # The processor_config.json key giving the rows per image or tile, and which of the two.
    rows_key: ClassVar[str | None] = None
    rows_per: ClassVar[str] = "image"

    def _plan_image(self, image: object, name: str) -> int:
        height, width = image_size(image, name)
        sizes, rows, cols = self._steps(height, width)
        check_pixels(sizes, self.max_pixels, name)
        tiles = rows * cols + 1
        if tiles > self.max_tiles_per_image:
            raise ValueError(
                f"{name}: {height} x {width} pixels would be split into {tiles} tiles, "
                f"more than max_tiles_per_image={self.max_tiles_per_image}"
            )
        return tiles

    def pixels(self, images: Sequence[object]) -> tuple[torch.Tensor, torch.Tensor | None]:
        pixel_values = self._tiles(images)
        if len(images) and pixel_values.shape[1:] != (3, self.image_size, self.image_size):
            raise ValueError(
                f"image_processor: gives images of {list(pixel_values.shape[2:])} pixels, but "
                f"the vision tower takes {self.image_size} x {self.image_size}"
            )
        return pixel_values, None

    @classmethod
    def read_directory(cls, directory: HfDirectory) -> tuple[Any, dict[str, Any]]:
        layout = read_hf_vlm_layout(directory)
        found = _image_processor_settings(directory.path)
        if found is None:
            image_processor = cls.image_processor_type.for_image_size(layout.image_size)
            what = f"the {layout.kind} defaults for the tower's {layout.image_size}-pixel images"
            _warn_defaults(directory.path, f"{what}: {image_processor}", stacklevel=3)
        else:
            settings, where = found
            image_processor = cls.image_processor_type.from_config(settings, where)
            side = layout.image_size
            key, got = cls._tower_setting(image_processor, side, where)
            if got != (side, side):
                raise ValueError(
                    f"{where}: {key}: gives images of {got[0]} x {got[1]} pixels, but the "
                    f"vision tower (config.json, vision_config.image_size) takes {side} x {side}"
                )
        file = directory.path / PROCESSOR_CONFIG
        if file.exists():
            cls._check_processor_config(read_hf_config(file), file, layout)
        model = {
            "tokens_per_image": layout.tokens_per_image,
            "image_size": layout.image_size,
            "image_token_id": layout.image_token_id,
        }
        return image_processor, model

    def _steps(self, height: int, width: int) -> tuple[list[tuple[int, int]], int, int]:
        """An image's (height, width) as given and after each resize, and its grid of crops
        (0, 0 when it is one tile)."""
        raise NotImplementedError

    def _tiles(self, images: Sequence[object]) -> torch.Tensor:
        """The images' tiles, float32 [n, 3, s, s]."""
        raise NotImplementedError

    @classmethod
    def _tower_setting(
        cls, processor: Any, side: int, where: str
    ) -> tuple[str, tuple[int | None, int | None]]:
        """The key and the (height, width) of the images the settings give, to be the
        tower's (refusing, naming ``where``, settings that give images of varying sizes)."""
        raise NotImplementedError

    @classmethod
    def _check_processor_config(
        cls, config: dict[str, Any], file: Path, layout: VlmImageLayout
    ) -> None:
        """Refuse (``CheckpointError``, naming ``file`` and the key) a top level of
        ``processor_config.json`` (the processor's own arguments) at odds with the model's
        rows per image or tile: by default its :attr:`rows_key`, where it says."""
        rows = config.get(cls.rows_key) if cls.rows_key else None
        if rows not in (None, layout.tokens_per_image):
            raise CheckpointError(
                file,
                cast(str, cls.rows_key),
                f"{rows!r}, but the model gives {layout.tokens_per_image} rows per {cls.rows_per}",
            )


def _processed_families() -> tuple[Family, ...]:
    """The registered families a processor kind is registered for."""
    from fusion.families import FAMILIES

    return tuple(f for f in FAMILIES if f.processor in KINDS)


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


def prepare_inputs(
    directory: str | bytes | os.PathLike | HfDirectory,
    prompts: str | Sequence[str],
    images: Sequence[object] = (),
    *,
    encode: Encode | None = None,
    max_pixels: int | None = None,
    max_tiles_per_image: int = MAX_TILES_PER_IMAGE,
    max_image_rows: int = MAX_IMAGE_ROWS,
    video_texts: Sequence[str] = (),
) -> VisionInputs:
    """``VisionLanguageProcessor.from_directory(directory, ...)(prompts, images)``: what a
    command line needs to run a vision-language directory on image files (decode them with
    :func:`fusion.preprocessing.load_image`, with the same ``max_pixels``; ``video_texts`` as
    the processor's call takes them). Raises as those two do."""
    processor = VisionLanguageProcessor.from_directory(
        directory,
        encode=encode,
        max_pixels=max_pixels,
        max_tiles_per_image=max_tiles_per_image,
        max_image_rows=max_image_rows,
    )
    return processor(prompts, images, video_texts=video_texts)
