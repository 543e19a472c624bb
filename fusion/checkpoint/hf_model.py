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
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion._wrappers import unwrap
from fusion.checkpoint.hf_llama import HfSpec, load_hf, save_hf, text_decoder
from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion
from fusion.families import FAMILIES, Family, family_of
from fusion.families.directory import (
    MAX_VISION_IMAGE_SIZE,
    MAX_VISION_PATCHES,
    HfDirectory,
    VlmImageLayout,
    hf_model_kind,
    read_hf_vlm_layout,
)

# HfDirectory and the config-only readers live beside the families (their processors read
# directories too); they stay importable from here.
__all__ = [
    "MAX_VISION_IMAGE_SIZE",
    "MAX_VISION_PATCHES",
    "HfDirectory",
    "VlmImageLayout",
    "hf_model_kind",
    "load_family",
    "load_hf_model",
    "read_hf_vlm_layout",
    "save_family",
    "save_hf_model",
]


def load_hf_model(
    path: "str | bytes | os.PathLike | HfDirectory",
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> EarlyFusion | TransformerDecoder:
    """Build the model a Hugging Face directory describes, of whichever registered family its
    ``config.json`` names (:data:`fusion.families.FAMILIES`: a text decoder, or an
    ``EarlyFusion`` of the family's encoders), with its weights.

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
            spec.config_key,
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
    safetensors, in the layout transformers loads (its class is the family's, its
    ``architectures``), and :func:`load_hf_model` gives back the same
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
