"""Deprecated location of the Qwen-VL config mapping, now :mod:`fusion.families.qwen_vl`."""

from fusion.families.qwen_vl.family import (
    ARCHITECTURES,
    MODEL_TYPES,
    QWEN3_MODEL_TYPES,
    VISION_DEFAULTS,
    hf_config_from_qwen,
    qwen_text_kwargs,
    qwen_vision_kwargs,
)

__all__ = [
    "ARCHITECTURES",
    "MODEL_TYPES",
    "QWEN3_MODEL_TYPES",
    "VISION_DEFAULTS",
    "hf_config_from_qwen",
    "qwen_text_kwargs",
    "qwen_vision_kwargs",
]
