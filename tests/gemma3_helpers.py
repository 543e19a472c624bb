"""Tiny random Gemma 3 models written by transformers' own classes, and what the Gemma 3 tests
share."""

import json
from collections.abc import Callable
from pathlib import Path

import torch

from vlm_helpers import randomize

VOCAB = 96
WINDOW = 5  # shorter than the test sequences: the sliding layers' window matters
# Sliding, full, sliding, sliding: both kinds, the first layer not a full one.
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
TEXT_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": len(LAYER_TYPES),
    "layer_types": LAYER_TYPES,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 24,  # not head_dim: the scale matters
    "sliding_window": WINDOW,
    "max_position_embeddings": 256,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "final_logit_softcapping": 8.0,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def tiny_hf_gemma3_text(seed: int = 0, *, attn_implementation: str = "eager", **config):
    """A random ``Gemma3ForCausalLM`` of :data:`TEXT_CONFIG` (``config`` overrides it), tied,
    fp32, in eval mode. The norms' effective scales ``1 + w`` drawn from [0.5, 1.5]."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    settings = {**TEXT_CONFIG, **config, "attn_implementation": attn_implementation}
    torch.manual_seed(seed)
    model = randomize(Gemma3ForCausalLM(Gemma3TextConfig(**settings)), seed)
    with torch.no_grad():  # randomize draws norms from [0.5, 1.5]; Gemma's are 1 + w
        for name, param in model.named_parameters():
            if "norm" in name:
                param.sub_(1.0)
    return model


# The vision model: special ids at the top of the vocabulary, a 32 x 32 SigLIP of 4 x 4 patches
# (an 8 x 8 grid) pooled to 16 rows, longer than the window (so the window's clamp matters).
BOI, EOI, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1
IMAGE_ROWS = 16
IMAGE_SIZE = 32
VISION_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": 4,
    "layer_norm_eps": 1e-6,
    "vision_use_head": False,
}


def tiny_hf_gemma3(seed: int = 0, *, attn_implementation: str = "eager"):
    """A random ``Gemma3ForConditionalGeneration``: :data:`TEXT_CONFIG`'s text stack, a tiny
    SigLIP tower, :data:`IMAGE_ROWS` rows per image; fp32, eval mode, the zero-centred norms'
    effective scales from [0.5, 1.5]."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    # no final_logit_softcapping: Gemma3ForConditionalGeneration never applies it
    text = {**TEXT_CONFIG, "model_type": "gemma3_text", "final_logit_softcapping": None}
    config = Gemma3Config(
        text_config=text,
        vision_config=VISION_CONFIG,
        mm_tokens_per_image=IMAGE_ROWS,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    model = randomize(Gemma3ForConditionalGeneration(config), seed)
    with torch.no_grad():  # the text stack's and the projector's norms are 1 + w
        for name, param in model.named_parameters():
            if "norm" in name and "vision_tower" not in name:
                param.sub_(1.0)
    return model


def image_text(images: int) -> list[int]:
    """The ids the processor writes for ``images`` images: each ``<start_of_image>``, its
    rows of placeholders and ``<end_of_image>`` (the blank lines around them left out)."""
    return [BOI, *[IMAGE] * IMAGE_ROWS, EOI] * images


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def with_config(source: Path, target: Path, edit: Callable[[dict], None]) -> Path:
    """``target``: ``source``'s weights (linked) and its config.json edited by ``edit``."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    for weights in source.glob("*.safetensors*"):
        (target / weights.name).symlink_to(weights)
    return target
