"""Hugging Face directories <-> models of this library, for every registered family.

:class:`HfDirectory` is a directory read once: its parsed ``config.json``, its family and the
:class:`~fusion.families.ModelSpec` that config describes, each made when first asked for and
kept, so that the loader, the processor, the conversation encoder and peft, handed the same
object, parse ``config.json`` once between them (each also takes a plain path).
:func:`load_hf_model` reads ``config.json`` once, finds its family
(:func:`fusion.families.family_of`), and builds and fills the model as :func:`load_hf`
describes; :func:`save_hf_model` writes a model as its family's Hugging Face directory. What
differs between families (their config mapping both ways, key layout, builder) is the
family's; nothing here branches on one.
"""

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion._wrappers import unwrap
from fusion.checkpoint.errors import CheckpointError, as_path
from fusion.checkpoint.hf_config import CONFIG_NAME, ConfigReader, read_hf_config
from fusion.checkpoint.hf_llama import HfSpec, load_hf, save_hf, text_decoder
from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion
from fusion.families import FAMILIES, Family, ModelSpec, family_of

# Bounds on what a config.json may ask preprocessing for (published towers: 224 to 512 pixels,
# at most a few thousand patches).
MAX_VISION_IMAGE_SIZE = 4096
MAX_VISION_PATCHES = 1 << 16


class HfDirectory:
    """A Hugging Face model directory, its ``config.json`` read (bounded, strictly) and
    parsed at most once: :attr:`config` when first asked for, then :attr:`family` and
    :attr:`spec` from it. Nothing is read when it is made, so errors come in the order the
    functions it is handed to raise them.

    Raises (from its attributes):
        CheckpointError: ``config.json`` missing or unreadable (:attr:`config`), a
            ``model_type`` no family reads (:attr:`family`), a value no model can be built
            from (:attr:`spec`), each naming the file and key.
    """

    def __init__(self, path: str | bytes | os.PathLike) -> None:
        self.path = as_path(path, "path")
        self.config_file = self.path / CONFIG_NAME

    @classmethod
    def of(cls, path: "str | bytes | os.PathLike | HfDirectory", argument: str) -> "HfDirectory":
        """``path`` itself if it is an :class:`HfDirectory`, else one for it (``argument``
        names it in a ``TypeError`` or ``ValueError`` for a value that is not a path)."""
        return path if isinstance(path, HfDirectory) else cls(as_path(path, argument))

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __repr__(self) -> str:
        return f"HfDirectory({os.fspath(self.path)!r})"

    @cached_property
    def config(self) -> dict[str, Any]:
        """The parsed ``config.json`` (:func:`~fusion.hf.read_hf_config`)."""
        return read_hf_config(self.config_file)

    @cached_property
    def family(self) -> Family:
        """The registered family of :attr:`config` (:func:`~fusion.families.family_of`)."""
        return family_of(self.config, source=self.config_file)

    @cached_property
    def spec(self) -> ModelSpec:
        """The model :attr:`config` describes, every value checked (:meth:`Family.read`)."""
        return self.family.read(ConfigReader(self.config, self.config_file))

    def spec_among(self, among: tuple[Family, ...]) -> ModelSpec:
        """:attr:`spec`, for a directory of one of the families ``among`` (refused otherwise,
        as :func:`~fusion.families.family_of` refuses it, naming their model types)."""
        family_of(self.config, source=self.config_file, among=among)
        return self.spec


def hf_model_kind(path: "str | bytes | os.PathLike | HfDirectory") -> str:
    """The name of the family ``config.json`` describes (``"llama"``, ``"llava"``,
    ``"idefics3"`` for Idefics3 and SmolVLM, ``"qwen2_vl"`` for Qwen2-VL and Qwen2.5-VL,
    ``"qwen3_vl"``), from its ``model_type`` (a config without one is a Llama's).

    Args:
        path: a model directory (or its :class:`HfDirectory`), or its ``config.json``.

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: ``config.json`` missing or unreadable, or a ``model_type`` no family
            reads (named, with the ones they do).
    """
    if isinstance(path, HfDirectory):
        return path.family.name
    path = as_path(path, "path")
    file = path / CONFIG_NAME if path.is_dir() else path
    return family_of(read_hf_config(file), source=file).name


@dataclass(frozen=True)
class VlmImageLayout:
    """What preprocessing needs to know of a model whose tower takes square images or tiles
    of one size (LLaVA, Idefics3): its family's ``kind``, the placeholder id of image rows,
    the rows one image or tile gives, and the side of the images its tower takes."""

    kind: str
    image_token_id: int
    tokens_per_image: int
    image_size: int


def read_hf_vlm_layout(path: "str | bytes | os.PathLike | HfDirectory") -> VlmImageLayout:
    """The :class:`VlmImageLayout` a directory's ``config.json`` describes, without reading
    the weights, for a family whose tower takes square images of one size.

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: as :func:`load_hf_model` for ``config.json``; and naming the key, a
            ``vision_config.image_size`` above :data:`MAX_VISION_IMAGE_SIZE` or not a multiple
            of ``patch_size``, more than :data:`MAX_VISION_PATCHES` patches, a
            ``scale_factor`` that does not divide the patch grid.
    """
    directory = HfDirectory.of(path, "path")
    config_file = directory.config_file
    spec = directory.spec_among(tuple(family for family in FAMILIES if family.square_images))
    # Arithmetic only: nothing is built, so no config can make this slow; every size bounded
    # before preprocessing allocates images, tiles or rows from it.
    size, patch = spec.vision["image_size"], spec.vision["patch_size"]
    if not 0 < size <= MAX_VISION_IMAGE_SIZE:
        raise CheckpointError(
            config_file,
            "vision_config.image_size",
            f"expected a positive integer <= {MAX_VISION_IMAGE_SIZE}, got {size}",
        )
    if patch == 0 or size % patch:
        raise CheckpointError(
            config_file,
            "vision_config.image_size",
            f"expected a positive multiple of patch_size={patch}, got {size}",
        )
    side = size // patch
    if side * side > MAX_VISION_PATCHES:
        raise CheckpointError(
            config_file,
            "vision_config.patch_size",
            f"{patch} cuts {size} x {size} images into {side * side} patches, more than "
            f"{MAX_VISION_PATCHES}",
        )
    rows = spec.family.rows_per_image(spec, side, config_file)
    return VlmImageLayout(spec.family.name, spec.image_token_id or 0, rows, size)


def load_hf_model(
    path: "str | bytes | os.PathLike | HfDirectory",
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> EarlyFusion | TransformerDecoder:
    """Build the model a Hugging Face directory describes, of whichever registered family its
    ``config.json`` names (:data:`fusion.families.FAMILIES`: a Llama or text-only Gemma 3
    decoder, or a LLaVA, Idefics3 / SmolVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 or
    Gemma 3 ``EarlyFusion``), with its weights.

    ``config.json`` is read once (not at all when ``path`` is an :class:`HfDirectory` that
    has read it already). Everything is checked from it and from the weights' headers
    before the model is allocated, once, as :func:`~fusion.checkpoint.load_hf_llama`
    describes (same arguments: ``max_seq_len`` overrides ``max_position_embeddings``). Keys a
    sub-config leaves out take transformers' defaults, as configs written by transformers 4.x
    omit them.

    Returns:
        a ``TransformerDecoder`` (Llama) or an ``EarlyFusion(decoder, {"image": encoder},
        {"image": image_token_id}, ...)``, in training mode as freshly built modules are (call
        ``.eval()`` for inference).

    Raises:
        TypeError, ValueError, CheckpointError: as :func:`~fusion.checkpoint.load_hf_llama`;
            and a ``CheckpointError`` naming the file and key for a ``model_type`` no family
            reads, a missing or malformed ``text_config`` or ``vision_config``, a vision tower
            of another kind, values no model can be built from (e.g. ``vision_feature_layer``
            out of range), or two key layouts mixed.
    """
    return load_family(path, FAMILIES, dtype=dtype, device=device, max_seq_len=max_seq_len)


def load_family(
    path: "str | bytes | os.PathLike | HfDirectory",
    among: tuple[Family, ...],
    *,
    dtype: torch.dtype | None,
    device: str | torch.device,
    max_seq_len: int | None,
) -> Any:
    """:func:`load_hf_model` for a directory of one of the families ``among``."""

    directory = HfDirectory.of(path, "path")

    def read_spec(config_file: Path) -> HfSpec:
        spec = directory.spec_among(among)
        return HfSpec(
            spec.family.name,
            directory.config_file,
            spec.text,
            spec.build,
            spec.family.layout,
            spec.text_prefix,
            spec.layer_counts(),
        )

    return load_hf(directory, read_spec, dtype=dtype, device=device, max_seq_len=max_seq_len)


def save_hf_model(
    model: nn.Module,
    directory: str | bytes | os.PathLike,
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write ``model`` as the Hugging Face directory of its family: ``config.json`` and
    safetensors, in the layout transformers loads (its class is the family's: e.g.
    ``LlamaForCausalLM``, ``LlavaForConditionalGeneration``,
    ``Qwen2_5_VLForConditionalGeneration``), and :func:`load_hf_model` gives back the same
    parameters bit for bit. Written crash-safely as :func:`~fusion.checkpoint.save_state_dict`
    describes, ``config.json`` renamed in last.

    Args:
        model: a model as this library's loaders or builders make it (a ``llama3_2``
            decoder, an ``EarlyFusion`` over one without encoders, whose decoder is saved, or
            a vision-language ``EarlyFusion``), possibly wrapped by ``torch.compile`` or DDP.
        directory: created if needed.
        max_shard_size: bytes per safetensors shard (then with an index); None: one file.
        overwrite: replace a checkpoint already in ``directory``; other files there are kept.

    Returns:
        the files written.

    Raises:
        TypeError: ``model`` of no family; ``directory``, ``max_shard_size`` or ``overwrite``
            of the wrong type.
        ValueError: ``model`` is not as its family's builder makes it (named), tensors without
            data (meta device) or sharded (FSDP2: load a full state dict into a plain model
            and save that); ``max_shard_size`` not positive.
        CheckpointError: ``directory`` already holds a checkpoint or ``config.json`` and
            ``overwrite`` is False; it is a file.
        OSError: the file system failed (a checkpoint being replaced is then left as it was).
    """
    family = family_of(model)
    return save_family(model, family, directory, max_shard_size, overwrite)


def save_family(
    model: object,
    family: Family,
    directory: str | bytes | os.PathLike,
    max_shard_size: int | None,
    overwrite: bool,
) -> list[Path]:
    """:func:`save_hf_model` for a model of ``family`` (its checks and errors)."""
    # A text-only family's format holds the decoder alone (an EarlyFusion's, if given one).
    inner = unwrap(model) if family.encoder_types else text_decoder(model)
    config = family.hf_config(inner)
    return save_hf(
        inner.state_dict(),
        config,
        family.layout,
        directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        argument="model" if family.encoder_types else "decoder",
    )
