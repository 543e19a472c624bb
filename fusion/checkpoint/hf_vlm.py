"""Deprecated per-family names of :func:`~fusion.checkpoint.load_hf_model` and
:func:`~fusion.checkpoint.save_hf_model`, kept for one release (see the CHANGELOG): each loads
or saves as the generic function does, restricted to its family."""

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion.checkpoint.hf_model import (
    MAX_VISION_IMAGE_SIZE,
    MAX_VISION_PATCHES,
    VlmImageLayout,
    hf_model_kind,
    load_family,
    load_hf_model,
    read_hf_vlm_layout,
    save_family,
)
from fusion.early_fusion import EarlyFusion
from fusion.families import FAMILIES, family_named

__all__ = [
    "MAX_VISION_IMAGE_SIZE",
    "MAX_VISION_PATCHES",
    "VlmImageLayout",
    "hf_config_from_idefics3",
    "hf_config_from_llava",
    "hf_model_kind",
    "load_hf_idefics3",
    "load_hf_llava",
    "load_hf_model",
    "load_hf_vlm",
    "read_hf_vlm_layout",
    "save_hf_idefics3",
    "save_hf_llava",
    "save_hf_qwen2_vl",
    "save_hf_qwen3_vl",
]

_VISION_FAMILIES = tuple(family for family in FAMILIES if family.encoder_types)


def _loader(name: str) -> Any:
    among = (family_named(name),) if name else _VISION_FAMILIES

    def load(
        path: str | bytes | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        max_seq_len: int | None = None,
    ) -> EarlyFusion:
        return load_family(path, among, dtype=dtype, device=device, max_seq_len=max_seq_len)

    what = " or ".join(f.what for f in among)
    load.__doc__ = f"Deprecated: :func:`~fusion.checkpoint.load_hf_model`, for {what} only."
    return load


def _saver(name: str) -> Any:
    family = family_named(name)

    def save(
        model: EarlyFusion,
        directory: str | bytes | os.PathLike,
        *,
        max_shard_size: int | None = None,
        overwrite: bool = False,
    ) -> list[Path]:
        return save_family(model, family, directory, max_shard_size, overwrite)

    save.__doc__ = f"Deprecated: :func:`~fusion.checkpoint.save_hf_model`, for {family.what} only."
    return save


load_hf_llava = _loader("llava")
load_hf_idefics3 = _loader("idefics3")
load_hf_vlm = _loader("")
save_hf_llava = _saver("llava")
save_hf_idefics3 = _saver("idefics3")
save_hf_qwen2_vl = _saver("qwen2_vl")
save_hf_qwen3_vl = _saver("qwen3_vl")


def hf_config_from_llava(model: nn.Module) -> dict[str, Any]:
    """Deprecated: the LLaVA family's ``hf_config``."""
    return family_named("llava").hf_config(model)


def hf_config_from_idefics3(model: nn.Module) -> dict[str, Any]:
    """Deprecated: the Idefics3 family's ``hf_config``."""
    return family_named("idefics3").hf_config(model)
