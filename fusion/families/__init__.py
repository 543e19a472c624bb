"""Model families, one module each, and the registry that finds a config's or a model's.

A family (:class:`Family`) holds what the generic loader, saver, exporter, peft converter and
preprocessing need to know of it; they look it up here and never branch on its name. Adding a
family is one module and one line of :data:`FAMILIES` (see ``docs/adding-a-family.md``).
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from fusion._wrappers import unwrap
from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion
from fusion.families.base import Family, ModelSpec
from fusion.families.gemma3 import GEMMA3, GEMMA3_TEXT
from fusion.families.idefics3 import IDEFICS3
from fusion.families.llama import LLAMA
from fusion.families.llava import LLAVA
from fusion.families.qwen3_5 import QWEN3_5, QWEN3_5_TEXT
from fusion.families.qwen_vl import QWEN2_VL, QWEN3_VL
from fusion.hf.config import CONFIG_NAME
from fusion.hf.errors import CheckpointError, short_repr

#: Every family, in the order errors list their model types (a family whose tower subclasses
#: another's comes first: Qwen3.5's is Qwen3-VL's without DeepStack).
FAMILIES: tuple[Family, ...] = (
    LLAMA,
    LLAVA,
    IDEFICS3,
    QWEN2_VL,
    QWEN3_5,
    QWEN3_5_TEXT,
    QWEN3_VL,
    GEMMA3_TEXT,
    GEMMA3,
)

__all__ = ["FAMILIES", "Family", "ModelSpec", "family_named", "family_of"]


def family_named(name: str) -> Family:
    """The registered family called ``name`` (e.g. ``"llava"``).

    Raises:
        ValueError: no family has that name (the names listed).
    """
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"family: expected one of {[f.name for f in FAMILIES]}, got {name!r}")


def family_of(
    target: Mapping[str, Any] | nn.Module,
    *,
    source: str | Path = CONFIG_NAME,
    among: tuple[Family, ...] = FAMILIES,
) -> Family:
    """The family of a parsed ``config.json`` (by its ``model_type``; a config without one is
    a Llama's, as transformers' ``LlamaConfig`` writes none in old files) or of a model of
    this library (a ``TransformerDecoder`` or an ``EarlyFusion`` without encoders is the
    text-only family's that :meth:`~Family.owns` its decoder, else a Llama; otherwise its one
    ``"image"`` encoder's class tells), through ``torch.compile`` and DDP wrappers.

    Args:
        target: the config mapping, or the model.
        source: the config's file, named in errors.
        among: the families to choose from (a loader of one family passes it alone).

    Raises:
        CheckpointError: a config whose ``model_type`` none of ``among`` reads (naming
            ``source``, the key, the types read, and for a plain Llama the loader to use).
        TypeError: a model that is none of ``among``'s (its encoders named).
    """
    if isinstance(target, nn.Module):
        family = _model_family(target, among)
        if family is None:
            inner = unwrap(target)
            got = (
                {name: type(e).__name__ for name, e in inner.encoders.items()}
                if isinstance(inner, EarlyFusion)
                else type(target).__name__
            )
            raise TypeError(f"model: expected a model of {[f.name for f in among]}, got {got}")
        return family
    model_type = target.get("model_type")
    for family in among:
        if ("llama" if model_type is None else model_type) in family.model_types:
            return family
    for family in among:
        reason = family.refused_model_types.get(str(model_type))
        if reason is not None:
            raise CheckpointError(Path(source), "model_type", f"{model_type!r}: {reason}")
    expected = [t for family in among for t in family.model_types]
    hint = " (a plain Llama: use load_hf_model)" if model_type in (None, "llama") else ""
    raise CheckpointError(
        Path(source),
        "model_type",
        f"expected one of {expected}, got {short_repr(model_type)}{hint}",
    )


def _model_family(model: nn.Module, among: tuple[Family, ...]) -> Family | None:
    inner = unwrap(model)
    decoder = inner if isinstance(inner, TransformerDecoder) else None
    if isinstance(inner, EarlyFusion) and not inner.encoders:
        decoder = inner.decoder
    if decoder is not None:
        owner = next((f for f in among if not f.encoder_types and f.owns(decoder)), None)
        return owner or (LLAMA if LLAMA in among else None)
    if not isinstance(inner, EarlyFusion) or set(inner.encoders) != {"image"}:
        return None
    encoder = inner.encoders["image"]
    return next(
        (f for f in among if f.encoder_types and isinstance(encoder, f.encoder_types)), None
    )
