"""Tiny random Gemma 3 models written by transformers' own classes, for the tests."""

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
