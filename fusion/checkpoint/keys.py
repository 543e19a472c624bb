"""Where the Llama key renaming and the q/k row permutation were first defined; they live in
:mod:`fusion.hf.keys` now, and this module keeps the old import path working."""

from fusion.hf.keys import (
    HF_DERIVED_KEY,
    fusion_key_to_hf,
    fusion_to_hf,
    fusion_to_meta,
    hf_key_to_fusion,
    hf_to_fusion,
    interleaved_to_rotate_half,
    meta_to_fusion,
    rope_heads,
    rotate_half_to_interleaved,
)

__all__ = [
    "HF_DERIVED_KEY",
    "fusion_key_to_hf",
    "fusion_to_hf",
    "fusion_to_meta",
    "hf_key_to_fusion",
    "hf_to_fusion",
    "interleaved_to_rotate_half",
    "meta_to_fusion",
    "rope_heads",
    "rotate_half_to_interleaved",
]
