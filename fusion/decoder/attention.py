import torch
import torch.nn.functional as F
from torch import nn

from fusion._validation import check_int
from fusion.decoder.few_rows import FewRowsLinear
from fusion.decoder.kv_cache import KVCache, SlidingWindowKVCache
from fusion.decoder.packed import PackedSegments
from fusion.decoder.packed_attention import packed_attention, per_sample_attention
from fusion.decoder.recompute import recomputed_projection
from fusion.decoder.rope import RotaryPositionalEmbeddings


class MultiHeadAttention(nn.Module):
    """Grouped-query self-attention with rotary embeddings and an optional KV cache.

    ``num_heads`` query heads share ``num_kv_heads`` key/value heads
    (``num_heads % num_kv_heads == 0``). Attention itself is PyTorch's
    ``scaled_dot_product_attention`` (GQA by its ``enable_gqa``, no repeated keys), or, for
    packed rows given as :class:`~fusion.decoder.packed.PackedSegments`, one of the backends
    of :func:`~fusion.decoder.packed_attention.packed_attention` (no dense mask).

    When training on packed rows with the per-sample SDPA backend, the samples' outputs reach
    ``output_proj`` through a concatenation (and the gate, with ``output_gate``) recomputed in
    the backward pass (:func:`~fusion.decoder.recompute.recomputed_projection`): SDPA keeps
    each sample's outputs for its own backward, and ``output_proj`` would otherwise keep their
    concatenated copy for its weight's gradient, one more ``[b, s, h * hd]`` tensor a layer.
    The recomputation stops before ``output_proj``'s product would run again, so the backward
    runs the same matrix products, and gradients are unchanged bit for bit. An
    ``output_proj`` that is not a plain linear layer (an adapter) keeps its input as before.

    Args:
        embed_dim: model width ``d``.
        num_heads, num_kv_heads, head_dim: head layout.
        pos_embeddings: rotary embeddings applied to queries and keys (may be shared by layers).
        attn_dropout: dropout probability on attention weights, in training only.
        qkv_bias: biases on the query, key and value projections (Qwen2), none on the output.
        q_norm, k_norm: norms over each head's query and key, before the rotary (Qwen3).
        output_gate: ``q_proj`` also gives each head a gate (per head, its query's
            ``head_dim`` channels then its gate's, as Qwen3.5 and Qwen3-Next store them), and
            the attention output is multiplied by ``sigmoid(gate)`` before ``output_proj``.
        attn_scale: the factor of the query-key products; None for ``head_dim ** -0.5``
            (Gemma's is ``query_pre_attn_scalar ** -0.5``).
        sliding_window: attend only to the ``sliding_window`` latest positions, this one
            included (Gemma's sliding-attention layers); None for all. The decoder gives such
            a layer its mask with the window applied (see ``TransformerDecoder.forward``);
            the layer itself attends as its mask says. Its KV cache keeps only the window
            (:class:`~fusion.decoder.kv_cache.SlidingWindowKVCache`).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        pos_embeddings: RotaryPositionalEmbeddings,
        attn_dropout: float = 0.0,
        qkv_bias: bool = False,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        output_gate: bool = False,
        *,
        attn_scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads: expected a divisor of num_heads={num_heads}, got {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.attn_dropout = attn_dropout
        self.output_gate = output_gate
        self.attn_scale = attn_scale
        if sliding_window is not None:
            check_int(sliding_window, "sliding_window", low=1)
        self.sliding_window = sliding_window
        q_width = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = FewRowsLinear(embed_dim, q_width, bias=qkv_bias)
        self.k_proj = FewRowsLinear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = FewRowsLinear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.output_proj = FewRowsLinear(num_heads * head_dim, embed_dim, bias=False)
        self.pos_embeddings = pos_embeddings
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.kv_cache: KVCache | None = None
        self.cache_enabled = False

    def setup_cache(
        self, batch_size: int, max_seq_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Allocate and enable a KV cache taking ``max_seq_len`` positions for each of
        ``batch_size`` sequences: a :class:`~fusion.decoder.kv_cache.KVCache` of that many
        slots, or for a ``sliding_window`` shorter than that, a ring of ``sliding_window``
        slots (:class:`~fusion.decoder.kv_cache.SlidingWindowKVCache`: the layer never
        attends further back)."""
        window = self.sliding_window
        shape = (self.num_kv_heads, self.head_dim, dtype, device)
        if window is not None and window < max_seq_len:
            self.kv_cache = SlidingWindowKVCache(batch_size, max_seq_len, window, *shape)
        else:
            self.kv_cache = KVCache(batch_size, max_seq_len, *shape)
        self.cache_enabled = True

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | PackedSegments | None,
        input_pos: torch.Tensor,
    ) -> torch.Tensor:
        """Attend ``x`` [b, s, d] to itself (and to the cache, when enabled).

        Args:
            mask: boolean [b, 1, s, kv_len], True where attention is allowed; None means causal
                over ``x`` (only valid without a cache). With a cache, attention reads its
                first ``kv_len`` slots (the whole cache, or the filled part); with a
                sliding-window cache, the columns its ``update`` returns (``kv_len`` as its
                ``key_slots``). Or the
                segments of packed rows ([b, s], without a cache): causal within each sample,
                within their ``window`` when they have one.
            input_pos: rotary positions, [b, s] or [s] (M-RoPE: also [3, b, s]).

        Returns:
            [b, s, d]
        """
        b, s, _ = x.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        gate = None
        if self.output_gate:
            q, gate = self.q_proj(x).view(b, s, heads, 2 * head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, s, heads * head_dim)
        else:
            q = self.q_proj(x).view(b, s, heads, head_dim)  # [b, s, h, hd]
        k = self.k_proj(x).view(b, s, kv_heads, head_dim)  # [b, s, h_kv, hd]
        v = self.v_proj(x).view(b, s, kv_heads, head_dim)  # [b, s, h_kv, hd]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.pos_embeddings.rotate_pair(q, k, input_pos)  # one table lookup
        dropout = self.attn_dropout if self.training else 0.0
        if isinstance(mask, PackedSegments):  # the decoder has refused it with a cache
            gqa, scale = heads != kv_heads, self.attn_scale
            if self._recomputes_concatenation(mask):
                parts = per_sample_attention(  # [n, h, hd] per segment
                    q, k, v, mask, dropout_p=dropout, enable_gqa=gqa, scale=scale
                )

                def gated_heads(*outputs: torch.Tensor) -> torch.Tensor:  # [b, s, h * hd]
                    return _gated(torch.cat(outputs).view(b, s, heads * head_dim), gate)

                return recomputed_projection(self.output_proj, gated_heads, *parts)
            out = packed_attention(  # [b, s, h, hd]
                q, k, v, mask, dropout_p=dropout, enable_gqa=gqa, scale=scale
            )
            return self._project(out.reshape(b, s, heads * head_dim), gate)  # [b, s, d]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, hd]
        if self.kv_cache is not None and self.cache_enabled:
            k, v = self.kv_cache.update(k, v)  # [b, h_kv, cache_len, hd]
            if mask is not None and mask.size(-1) < k.size(2):  # the slots the mask covers
                k, v = k[:, :, : mask.size(-1)], v[:, :, : mask.size(-1)]
        out = F.scaled_dot_product_attention(  # [b, h, s, hd]; GQA: h_kv heads shared by h
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=dropout,
            enable_gqa=heads != kv_heads,
            scale=self.attn_scale,
        )
        return self._project(out.transpose(1, 2).reshape(b, s, heads * head_dim), gate)

    def _recomputes_concatenation(self, segments: PackedSegments) -> bool:
        """Whether the per-sample outputs reach ``output_proj`` through a recomputed
        concatenation: when autograd records, eagerly (compiled, the per-sample loop is a
        graph break of its own), on the per-sample SDPA backend."""
        return (
            torch.is_grad_enabled()
            and segments.backend == "sdpa"
            and not torch.compiler.is_compiling()
        )

    def _project(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``output_proj`` of the heads' outputs [b, s, h * hd], gated when the layer is."""
        return self.output_proj(_gated(out, gate))


def _gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return out if gate is None else out * torch.sigmoid(gate)
