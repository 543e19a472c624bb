"""Qwen2-VL and Qwen2.5-VL: a Qwen vision tower fused into a Qwen2 text decoder with M-RoPE."""

from collections.abc import Mapping, Sequence
from typing import Any

from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion, register_fusion_module
from fusion.encoders.qwen_vision import Qwen2VisionTransformer, Qwen25VisionTransformer
from fusion.hooks import MRopePositions
from fusion.models.llama3_2 import llama3_2

#: The vision towers by model type.
VISION_TOWERS = {"qwen2_vl": Qwen2VisionTransformer, "qwen2_5_vl": Qwen25VisionTransformer}


def qwen2(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    *,
    rope_base: float = 1_000_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    mrope_section: Sequence[int] | None = (16, 24, 24),
    attn_dropout: float = 0.0,
) -> TransformerDecoder:
    """Qwen2's text stack: the Llama layout with biases on q, k and v, plain rotary
    frequencies, and M-RoPE by ``mrope_section`` (None: 1-D RoPE, the text-only Qwen2)."""
    return llama3_2(
        vocab_size,
        num_layers,
        num_heads,
        num_kv_heads,
        embed_dim,
        max_seq_len,
        attn_dropout=attn_dropout,
        rope_base=rope_base,
        intermediate_dim=intermediate_dim,
        norm_eps=norm_eps,
        scale_factor=None,
        tie_word_embeddings=tie_word_embeddings,
        qkv_bias=True,
        mrope_section=mrope_section,
    )


def qwen2_vl(
    *,
    text: Mapping[str, Any],
    vision: Mapping[str, Any],
    image_token_id: int,
    model_type: str = "qwen2_5_vl",
) -> EarlyFusion:
    """A Qwen2-VL (``model_type="qwen2_vl"``) or Qwen2.5-VL model: ``EarlyFusion(decoder,
    {"image": tower}, {"image": image_token_id}, hooks=[MRopePositions(...)])``.

    The tower's merger is registered with :func:`fusion.register_fusion_module`. Called
    without positions, or with fusion's 1-D ones, the model derives M-RoPE positions from its
    ``<|image_pad|>`` placeholders and ``encoder_input["image"]["image_grid_thw"]``.

    Args:
        text: keyword arguments of :func:`fusion.models.llama3_2` (with ``qkv_bias=True`` and
            an ``mrope_section`` for Qwen2's stack, as :func:`qwen2` passes them).
        vision: keyword arguments of the tower,
            :class:`~fusion.encoders.Qwen2VisionTransformer` or
            :class:`~fusion.encoders.Qwen25VisionTransformer`.
        image_token_id: the ``<|image_pad|>`` id.
        model_type: ``"qwen2_vl"`` or ``"qwen2_5_vl"``: which tower.

    Raises:
        ValueError: an unknown ``model_type``, a decoder without M-RoPE, a tower whose output
            width is not the decoder's, or any argument the parts refuse.
    """
    if model_type not in VISION_TOWERS:
        raise ValueError(f"model_type: expected one of {list(VISION_TOWERS)}, got {model_type!r}")
    return qwen_fusion(llama3_2(**text), VISION_TOWERS[model_type](**vision), image_token_id)


def qwen_fusion(decoder: TransformerDecoder, tower: Any, image_token_id: int) -> EarlyFusion:
    """``EarlyFusion(decoder, {"image": tower}, {"image": image_token_id},
    hooks=[MRopePositions(...)])`` for a Qwen tower (its merger registered with
    :func:`fusion.register_fusion_module`), what the Qwen-VL builders without DeepStack share.

    Raises:
        ValueError: a tower whose output width is not the decoder's.
    """
    if tower.out_dim != decoder.embed_dim:
        raise ValueError(
            f"vision: the tower writes rows of width {tower.out_dim}, the decoder's width is "
            f"{decoder.embed_dim}"
        )
    register_fusion_module(tower.merger)
    return EarlyFusion(
        decoder,
        {"image": tower},
        {"image": image_token_id},
        hooks=[MRopePositions("image", tower.spatial_merge_size)],
    )
