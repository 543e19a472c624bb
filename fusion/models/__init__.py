"""Model builders, kept apart from the modules they assemble: each lives in its family's home
(:mod:`fusion.families`), and this package gathers them under one name."""

from fusion.families.gemma3 import Gemma3ImageEncoder, Gemma3Projector, gemma3, gemma3_text
from fusion.families.idefics3 import Idefics3ImageEncoder, idefics3, smolvlm_256m
from fusion.families.llama import llama3_2, llama3_2_1b, llama3_2_3b, scale_hidden_dim_for_mlp
from fusion.families.llava import LlavaImageEncoder, llava
from fusion.families.qwen3_5 import qwen3_5, qwen3_5_text
from fusion.families.qwen_vl import qwen2, qwen2_vl, qwen3_vl

__all__ = [
    "Gemma3ImageEncoder",
    "Gemma3Projector",
    "Idefics3ImageEncoder",
    "LlavaImageEncoder",
    "gemma3",
    "gemma3_text",
    "idefics3",
    "llama3_2",
    "llama3_2_1b",
    "llama3_2_3b",
    "llava",
    "qwen2",
    "qwen2_vl",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_vl",
    "scale_hidden_dim_for_mlp",
    "smolvlm_256m",
]
