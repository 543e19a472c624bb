"""Gemma 3's text stack: sliding-window and full-attention layers, each with its own rotary
base, GeGLU MLPs and four zero-centred norms per layer."""

from collections.abc import Sequence

import torch
from torch import nn

from fusion._validation import check_int
from fusion.decoder import (
    FeedForward,
    MultiHeadAttention,
    RotaryPositionalEmbeddings,
    ScaledEmbedding,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
    ZeroCenteredRMSNorm,
)

#: The layer kinds of ``layer_types``, as Hugging Face's configs name them.
LAYER_TYPES = ("sliding_attention", "full_attention")


def default_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    """Every ``pattern``-th layer full attention, the others sliding-window (transformers'
    default when a config gives no ``layer_types``, from its ``sliding_window_pattern``)."""
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def gemma3_text(
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
    sliding_window: int | None = 4096,
    query_pre_attn_scalar: float = 256,
    rope_base: float = 1_000_000.0,
    rope_local_base: float = 10_000.0,
    rope_linear_factor: float | None = None,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = True,
    final_logit_softcap: float | None = None,
    attn_dropout: float = 0.0,
) -> TransformerDecoder:
    """Gemma 3's text decoder, as transformers 5.24's ``Gemma3TextModel`` and
    ``Gemma3ForCausalLM`` compute it.

    - token embeddings multiplied by ``sqrt(embed_dim)``, rounded to the weights' dtype
      (:class:`~fusion.decoder.ScaledEmbedding`);
    - each layer ``h = x + post_attn(attn(input_norm(x)));
      out = h + post_ffn(mlp(pre_ffn(h)))``, the four norms zero-centred RMSNorms
      (``x * (1 + w)`` in float32), the last two of each pair the layer's ``sa_scale`` and
      ``mlp_scale``;
    - GQA attention with zero-centred q/k norms per head, scaled by
      ``query_pre_attn_scalar ** -0.5``, rotary in Hugging Face's rotate-half layout (the
      checkpoints load with no rows permuted): base ``rope_local_base`` on the
      ``"sliding_attention"`` layers, which attend to the ``sliding_window`` latest positions,
      and ``rope_base`` with the frequencies divided by ``rope_linear_factor`` (Hugging Face's
      ``"linear"`` scaling) on the ``"full_attention"`` layers;
    - a GeGLU MLP (tanh-approximated GELU);
    - a final zero-centred norm, the output tied to the embedding by default, the logits
      soft-capped by ``final_logit_softcap`` when given.

    ``layer_types`` default: :func:`default_layer_types`; ``sliding_window`` may be None
    only where no layer slides. Initialisation, for training from
    scratch: the embedding rows at std ``embed_dim ** -0.5`` (of std 1 once scaled), the norms
    at zero (the identity scaling), linear layers PyTorch's default.

    Raises:
        ValueError: ``layer_types`` of another length or with another kind, sizes or a window
            that are not positive, head counts that do not divide, an odd ``head_dim``, or
            what the parts refuse.
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
    ):
        check_int(value, name, low=1)
    kinds = default_layer_types(num_layers) if layer_types is None else list(layer_types)
    if len(kinds) != num_layers or any(kind not in LAYER_TYPES for kind in kinds):
        raise ValueError(
            f"layer_types: expected {num_layers} entries (num_layers), each one of "
            f"{list(LAYER_TYPES)}, got {kinds!r:.200}"
        )
    if "sliding_attention" in kinds or sliding_window is not None:
        check_int(sliding_window, "sliding_window", low=1)
    ropes = {
        "sliding_attention": RotaryPositionalEmbeddings(
            head_dim, max_seq_len, base=rope_local_base, rotate_half=True
        ),
        "full_attention": RotaryPositionalEmbeddings(
            head_dim,
            max_seq_len,
            base=rope_base,
            rotate_half=True,
            linear_factor=rope_linear_factor,
        ),
    }

    def norm(dim: int = embed_dim) -> ZeroCenteredRMSNorm:
        return ZeroCenteredRMSNorm(dim, eps=norm_eps)

    layers = [
        TransformerSelfAttentionLayer(
            attn=MultiHeadAttention(
                embed_dim,
                num_heads,
                num_kv_heads,
                head_dim,
                ropes[kind],
                attn_dropout,
                q_norm=norm(head_dim),
                k_norm=norm(head_dim),
                attn_scale=query_pre_attn_scalar**-0.5,
                sliding_window=sliding_window if kind == "sliding_attention" else None,
            ),
            mlp=FeedForward(embed_dim, intermediate_dim, activation="gelu_tanh"),
            sa_norm=norm(),
            mlp_norm=norm(),
            sa_scale=norm(),
            mlp_scale=norm(),
        )
        for kind in kinds
    ]
    tok_embeddings = ScaledEmbedding(vocab_size, embed_dim, embed_dim**0.5)
    with torch.no_grad():  # scaled in place: the same random draws, reproducible seeds
        tok_embeddings.weight.mul_(embed_dim**-0.5)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        norm=norm(),
        output=None if tie_word_embeddings else nn.Linear(embed_dim, vocab_size, bias=False),
        final_logit_softcap=final_logit_softcap,
    )
