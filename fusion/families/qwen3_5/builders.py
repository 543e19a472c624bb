"""Qwen3.5: a hybrid text stack (three Gated DeltaNet layers for each gated full-attention
layer, by default) with interleaved M-RoPE, fused with Qwen3-VL's vision tower without
DeepStack."""

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from fusion._validation import check_int
from fusion.decoder import (
    FeedForward,
    FewRowsLinear,
    GatedDeltaNet,
    MultiHeadAttention,
    RotaryPositionalEmbeddings,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
    ZeroCenteredRMSNorm,
)
from fusion.early_fusion import EarlyFusion
from fusion.encoders.qwen_vision import Qwen35VisionTransformer
from fusion.families.qwen_vl.builders import qwen_fusion

#: The layer kinds of ``layer_types``, as Hugging Face's configs name them.
LAYER_TYPES = ("linear_attention", "full_attention")


def default_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Every ``interval``-th layer full attention, the others Gated DeltaNet (transformers'
    default when a config gives no ``layer_types``)."""
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def qwen3_5_text(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    *,
    head_dim: int = 256,
    layer_types: Sequence[str] | None = None,
    linear_num_key_heads: int = 16,
    linear_num_value_heads: int = 32,
    linear_key_head_dim: int = 128,
    linear_value_head_dim: int = 128,
    linear_conv_kernel: int = 4,
    rope_base: float = 10_000_000.0,
    rotary_dim: int | None = None,
    mrope_section: Sequence[int] | None = (11, 11, 10),
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    attn_dropout: float = 0.0,
) -> TransformerDecoder:
    """Qwen3.5's text decoder, as transformers 5.24's ``Qwen3_5TextModel`` computes it.

    Each layer is pre-norm (zero-centred RMSNorms, ``x * (1 + w)``) with a SwiGLU MLP; its
    token mixer is chosen by ``layer_types``:

    - ``"full_attention"``: gated GQA (``q_proj`` gives each head its query and a gate, the
      output is multiplied by ``sigmoid(gate)``), zero-centred q/k norms per head, rotary on
      the first ``rotary_dim`` channels of each head (default a quarter of ``head_dim``) in
      Hugging Face's rotate-half layout, so checkpoints load with no rows permuted;
    - ``"linear_attention"``: :class:`~fusion.decoder.GatedDeltaNet`.

    The rotary is interleaved M-RoPE (``mrope_section`` frequencies for t, h, w), 1-D
    positions being text; ``mrope_section=None``: plain 1-D RoPE, as transformers'
    ``Qwen3_5ForCausalLM`` rotates (its t, h and w rows are the same text positions).

    Raises:
        ValueError: ``layer_types`` of another length or with another kind, no full-attention
            layer, sizes that are not positive, head counts that do not divide, or what the
            parts refuse.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("embed_dim", embed_dim),
        ("intermediate_dim", intermediate_dim),
        ("max_seq_len", max_seq_len),
        ("head_dim", head_dim),
        ("linear_num_key_heads", linear_num_key_heads),
        ("linear_num_value_heads", linear_num_value_heads),
        ("linear_key_head_dim", linear_key_head_dim),
        ("linear_value_head_dim", linear_value_head_dim),
        ("linear_conv_kernel", linear_conv_kernel),
    ):
        check_int(value, name, low=1)
    kinds = default_layer_types(num_layers) if layer_types is None else list(layer_types)
    if len(kinds) != num_layers or any(kind not in LAYER_TYPES for kind in kinds):
        raise ValueError(
            f"layer_types: expected {num_layers} entries (num_layers), each one of "
            f"{list(LAYER_TYPES)}, got {kinds!r:.200}"
        )
    rotary_dim = head_dim // 4 if rotary_dim is None else rotary_dim
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(
            f"rotary_dim: expected an even number of channels in [2, head_dim={head_dim}], got "
            f"{rotary_dim}"
        )
    rope = RotaryPositionalEmbeddings(
        rotary_dim,
        max_seq_len,
        base=rope_base,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_section is not None,
        rotate_half=True,
    )

    def mixer(kind: str) -> MultiHeadAttention | GatedDeltaNet:
        if kind == "linear_attention":
            return GatedDeltaNet(
                embed_dim,
                linear_num_key_heads,
                linear_num_value_heads,
                linear_key_head_dim,
                linear_value_head_dim,
                linear_conv_kernel,
                norm_eps=norm_eps,
            )
        return MultiHeadAttention(
            embed_dim,
            num_heads,
            num_kv_heads,
            head_dim,
            rope,
            attn_dropout,
            q_norm=ZeroCenteredRMSNorm(head_dim, eps=norm_eps),
            k_norm=ZeroCenteredRMSNorm(head_dim, eps=norm_eps),
            output_gate=True,
        )

    layers = [
        TransformerSelfAttentionLayer(
            attn=mixer(kind),
            mlp=FeedForward(embed_dim, intermediate_dim),
            sa_norm=ZeroCenteredRMSNorm(embed_dim, eps=norm_eps),
            mlp_norm=ZeroCenteredRMSNorm(embed_dim, eps=norm_eps),
        )
        for kind in kinds
    ]
    return TransformerDecoder(
        tok_embeddings=nn.Embedding(vocab_size, embed_dim),
        layers=layers,
        max_seq_len=max_seq_len,
        norm=ZeroCenteredRMSNorm(embed_dim, eps=norm_eps),
        output=None if tie_word_embeddings else FewRowsLinear(embed_dim, vocab_size, bias=False),
    )


def qwen3_5(
    *,
    text: Mapping[str, Any],
    vision: Mapping[str, Any],
    image_token_id: int,
    video_token_id: int | None = None,
) -> EarlyFusion:
    """A Qwen3.5 model: ``EarlyFusion(decoder, {"image": tower}, {"image": image_token_id},
    hooks=[MRopePositions(...)])``, the decoder :func:`qwen3_5_text`, the tower
    :class:`~fusion.encoders.Qwen35VisionTransformer` (its merger registered with
    :func:`fusion.register_fusion_module`); with ``video_token_id``, a ``"video"`` entry
    sharing the tower, each temporal patch of a video a media of its own in the positions
    (as Qwen3-VL's per-frame timestamps separate them; see :func:`qwen_fusion`).

    Raises:
        ValueError: a tower whose output width is not the decoder's, or any argument the
            parts refuse.
    """
    return qwen_fusion(
        qwen3_5_text(**text),
        Qwen35VisionTransformer(**vision),
        image_token_id,
        video_token_id=video_token_id,
        split_frames=True,
    )
