"""Llama 3.2 builders: the component builder and the 1B / 3B presets."""

from collections.abc import Sequence

import torch
from torch import nn

from fusion._validation import check_int
from fusion.decoder import (
    FeedForward,
    FewRowsLinear,
    MultiHeadAttention,
    RMSNorm,
    RotaryPositionalEmbeddings,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)


def scale_hidden_dim_for_mlp(dim: int, multiple_of: int = 256) -> int:
    """Llama's default MLP width: 2/3 of 4 * dim, rounded up to ``multiple_of``."""
    hidden_dim = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


def llama3_2(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    rope_base: float = 500_000,
    intermediate_dim: int | None = None,
    norm_eps: float = 1e-5,
    scale_factor: float | None = 32,
    tie_word_embeddings: bool = True,
    *,
    rope_low_freq_factor: float = 1.0,
    rope_high_freq_factor: float = 4.0,
    rope_old_context_len: int = 8192,
    qkv_bias: bool = False,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
    head_dim: int | None = None,
    qk_norm: bool = False,
) -> TransformerDecoder:
    """Build a Llama 3.2 decoder; arguments mean what they mean in torchtune's builder.

    ``scale_factor=None`` gives plain (unscaled) RoPE; the keyword-only ``rope_*`` arguments
    set the rest of the llama3 rope-scaling band (Hugging Face's ``rope_scaling``).
    ``intermediate_dim=None`` uses :func:`scale_hidden_dim_for_mlp`. ``qkv_bias`` gives the
    query, key and value projections biases and ``mrope_section`` makes the rotary M-RoPE
    (see :class:`fusion.decoder.RotaryPositionalEmbeddings`): with both, this is Qwen2's text
    stack (:func:`fusion.models.qwen2`). ``head_dim`` (default ``embed_dim // num_heads``)
    and ``qk_norm`` (RMSNorm over each head's queries and keys) give Qwen3's.

    Initialisation, for training from scratch: PyTorch's defaults (``nn.Embedding`` N(0, 1),
    ``nn.Linear`` Kaiming-uniform, norms 1), except that a tied embedding (the output
    projection too) is scaled to std ``embed_dim ** -0.5``, as GPT-2 and OLMo scale tied
    tables, so initial logits are O(1) and the initial loss is close to ``ln(vocab_size)``.
    Untied, the output's Kaiming init already gives logits of std about 0.6.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("embed_dim", embed_dim),
        ("max_seq_len", max_seq_len),
    ):
        check_int(value, name, low=1)
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim: expected a multiple of num_heads={num_heads}, got {embed_dim}"
            )
        head_dim = embed_dim // num_heads
    rope = RotaryPositionalEmbeddings(
        head_dim,
        max_seq_len,
        base=rope_base,
        scale_factor=scale_factor,
        low_freq_factor=rope_low_freq_factor,
        high_freq_factor=rope_high_freq_factor,
        old_context_len=rope_old_context_len,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
    )
    hidden_dim = intermediate_dim or scale_hidden_dim_for_mlp(embed_dim)
    layers = [
        TransformerSelfAttentionLayer(
            attn=MultiHeadAttention(
                embed_dim,
                num_heads,
                num_kv_heads,
                head_dim,
                rope,
                attn_dropout,
                qkv_bias,
                RMSNorm(head_dim, eps=norm_eps) if qk_norm else None,
                RMSNorm(head_dim, eps=norm_eps) if qk_norm else None,
            ),
            mlp=FeedForward(embed_dim, hidden_dim),
            sa_norm=RMSNorm(embed_dim, eps=norm_eps),
            mlp_norm=RMSNorm(embed_dim, eps=norm_eps),
        )
        for _ in range(num_layers)
    ]
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    if tie_word_embeddings:
        # Tied, the table is also the output projection: rows of std d**-0.5 against RMS-normed
        # hidden states give logits of std about 1, so training starts at a loss near ln(vocab)
        # (nn.Embedding's std 1 would give logits of std sqrt(d)). Scaled in place: the same
        # random draws as before, so seeded runs stay reproducible.
        with torch.no_grad():
            tok_embeddings.weight.mul_(embed_dim**-0.5)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=None if tie_word_embeddings else FewRowsLinear(embed_dim, vocab_size, bias=False),
    )


def llama3_2_1b(max_seq_len: int = 131_072) -> TransformerDecoder:
    """Llama 3.2 1B shape: 16 layers, 32 heads (8 KV), width 2048, MLP 8192, tied output."""
    return llama3_2(128_256, 16, 32, 8, 2048, max_seq_len, intermediate_dim=8192)


def llama3_2_3b(max_seq_len: int = 131_072) -> TransformerDecoder:
    """Llama 3.2 3B shape: 28 layers, 24 heads (8 KV), width 3072, MLP 8192, tied output."""
    return llama3_2(128_256, 28, 24, 8, 3072, max_seq_len, intermediate_dim=8192)
