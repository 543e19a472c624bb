"""Tiny random Qwen3-VL models that ``transformers`` builds in the tests (nothing downloaded):
a head_dim of its own, q/k norms, interleaved M-RoPE and two DeepStack layers."""

import torch

from qwen_helpers import EOS, IMAGE_PAD, PAD, VIDEO_PAD, VISION_END, VISION_START, VOCAB
from vlm_helpers import randomize

PATCH = 16
PATCH_WIDTH = 3 * 2 * PATCH * PATCH
TEXT_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # not hidden_size / heads
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    # 8 frequencies: rows t h w t h w t t, interleaved
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
    "pad_token_id": PAD,
    "bos_token_id": None,
    "eos_token_id": EOS,
}
VISION_CONFIG = {
    "depth": 3,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 32,
    "patch_size": PATCH,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,  # a 4 x 4 table, resampled to every grid
    "deepstack_visual_indexes": [0, 2],
}


def tiny_hf_qwen3(seed: int = 0, *, tied: bool = False):
    """A random ``Qwen3VLForConditionalGeneration`` in fp32 eval mode."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(TEXT_CONFIG),
        vision_config=dict(VISION_CONFIG),
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return randomize(Qwen3VLForConditionalGeneration(config).to(torch.float32), seed)


# The same text stack as fusion.models.llama3_2 arguments, for models built without transformers.
FUSION_TEXT = {
    "vocab_size": VOCAB,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 32,
    "head_dim": 16,
    "max_seq_len": 512,
    "intermediate_dim": 64,
    "rope_base": 100.0,  # fast rotations: position mistakes show at once
    "scale_factor": None,
    "tie_word_embeddings": False,
    "qk_norm": True,
    "mrope_section": [4, 2, 2],
    "mrope_interleaved": True,
}


def tiny_qwen3_vl(seed: int = 0):
    """A random Qwen3-VL ``EarlyFusion`` from :func:`fusion.models.qwen3_vl` (its decoder is
    ``llama3_2(**FUSION_TEXT)`` drawn from the same seed), weights N(0, 0.2) so that every
    position or placement mistake moves the logits."""
    from fusion.models import qwen3_vl

    torch.manual_seed(seed)
    model = qwen3_vl(text=FUSION_TEXT, vision=VISION_CONFIG, image_token_id=IMAGE_PAD)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model.eval()
