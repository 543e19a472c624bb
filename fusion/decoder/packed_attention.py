"""Attention over packed rows from their :class:`~fusion.decoder.packed.PackedSegments`,
without a dense ``[b, s, s]`` mask, by one of three backends:

- ``"sdpa"``: one ``F.scaled_dot_product_attention(is_causal=True)`` call per sample, on
  slices of q, k and v cut at the host-known lengths (no synchronisation), written into one
  output; on CPU each call takes the flash kernel. Runs on every device, with dropout.
  Padding is not computed: its outputs are zeros.
- ``"flex"``: compiled FlexAttention (``torch.compile(flex_attention)``) with a
  document-causal ``BlockMask`` made from the segment ids on the device, in
  O(s + (s / 128)^2) (no ``s x s`` evaluation of the mask); blocks that no sample attends are
  skipped. CUDA, forward and backward; on CPU torch 2.13 runs its forward only (no backward).
  Padding attends to nothing: its outputs are zeros.
- ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (flash attention over cumulative
  lengths, causal), CUDA with float16 or bfloat16 only, no dropout. Every token is in a
  segment, so padding attends causally among itself there (as the dense mask has it).

Segments with a ``window`` (a sliding-window layer's, :meth:`PackedSegments.with_window`)
attend within it in every backend: per-sample SDPA gives a sample longer than the window its
``[n, n]`` band mask, FlexAttention's block mask skips the blocks outside the window, varlen
takes it as flash attention's left window.

``"auto"`` picks per device and compute dtype (:func:`resolve_backend`): on CUDA varlen where
it runs, else flex; elsewhere per-sample SDPA, the fastest measured on CPU: at SmolVLM-256M's
attention shape on 4096 tokens of packed LLaVA-Instruct-like samples, 2 threads, its
forward+backward ran at 2.5x the dense mask's speed in rows of 1024 tokens, 5.2x in rows of
2048 and 11.8x in one row of 4096 (forward alone 2.5x to 12.6x; compiled FlexAttention's
forward, its block mask included, 2.7x to 8.3x; ``python benchmarks/packed_attention.py
--rounds 7``, medians, see benchmarks/README.md). Dropout in training takes per-sample SDPA
under ``"auto"``.

Under ``torch.compile`` (e.g. of each decoder layer): the per-sample SDPA loop runs in a
``torch.compiler.disable``'d function, a graph break, so the compiled graphs never see the
host lengths and layouts of any shape recompile nothing. Flex and varlen trace: they read
device tensors (segment ids, the block mask, cumulative lengths) and one host integer
(``max_length``, a power of two; ``cu_seqlens``'s length varies with the segment count), so a
graph is reused across layouts once those are dynamic (one recompile when they first change,
under automatic dynamic shapes). Importing this module imports neither ``torch._dynamo`` nor
FlexAttention: they come when first used.
"""

import functools
import importlib.util
import sys
from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.functional as F

from fusion.decoder.packed import PackedSegments, causal_band

#: FlexAttention's block size: the block mask is made at this granularity.
FLEX_BLOCK = 128

_compiled_flex: Any = None
_disabled_per_sample: Any = None


def resolve_backend(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    dropout: bool = False,
    blocks: bool = False,
) -> str:
    """The backend that runs ``backend`` (one of ``PACKED_BACKENDS``) on ``device`` for
    queries of ``dtype``, with attention dropout or not.

    ``"auto"``: per-sample SDPA with dropout or bidirectional ``blocks``; on CUDA
    ``"varlen"`` where it runs (:func:`varlen_supported`), else ``"flex"``; elsewhere (CPU,
    ...) ``"sdpa"``, which measured fastest on CPU (2.5x to 11.8x the dense mask's
    forward+backward; see the module docstring and benchmarks/README.md, "Packed attention").

    Raises:
        ValueError: ``"flex"`` or ``"varlen"`` with dropout (neither has any) or with
            ``blocks`` (only per-sample SDPA attends both ways), ``"varlen"`` where it cannot
            run.
    """
    if backend == "auto":
        if dropout or blocks:
            return "sdpa"
        if device.type == "cuda":
            return "varlen" if varlen_supported(device, dtype) else "flex"
        return "sdpa"
    if blocks and backend in ("flex", "varlen"):
        raise ValueError(
            f"mask: the {backend!r} backend has no bidirectional blocks (image placeholders "
            "attending both ways); use 'sdpa' or 'auto'"
        )
    if dropout and backend in ("flex", "varlen"):
        raise ValueError(
            f"mask: the {backend!r} backend has no attention dropout; use 'sdpa' or 'auto', "
            "or attn_dropout=0"
        )
    if backend == "varlen" and not varlen_supported(device, dtype):
        raise ValueError(
            "mask: the 'varlen' backend needs torch.nn.attention.varlen, a CUDA device of "
            f"compute capability 8.0 or more and float16 or bfloat16; got {device} and {dtype}"
        )
    return backend


def varlen_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``varlen_attn`` runs here: this torch has it, ``device`` is CUDA with flash
    attention (compute capability 8.0 or more), ``dtype`` is float16 or bfloat16."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _flash_capable(index)


@functools.cache
def _flash_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


def prepare(
    segments: PackedSegments, dtype: torch.dtype, *, dropout: bool = False
) -> PackedSegments:
    """``segments`` with a concrete backend for queries of ``dtype`` on their device, and for
    ``"flex"`` its block mask: made once per decoder forward, shared by every layer.

    Raises:
        ValueError: see :func:`resolve_backend`.
    """
    backend = resolve_backend(
        segments.backend,
        segments.device,
        dtype,
        dropout=dropout,
        blocks=segments.blocks is not None,
    )
    # Made here, eagerly, rather than on first use inside a compiled layer, where their
    # creation would cost that layer one more compilation.
    if backend == "flex":
        _flex_function()
    elif "torch._dynamo" in sys.modules:  # compilation is possible
        _per_sample_disabled()
    block_mask = (
        document_block_mask(segments.segment_ids, segments.window) if backend == "flex" else None
    )
    return replace(segments, backend=backend, block_mask=block_mask)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: PackedSegments,
    *,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each sample of packed rows (within the segments' ``window``
    when they have one).

    Args:
        q: [b, s, h, hd] queries (rotary applied).
        k, v: [b, s, h_kv, hd]; ``h_kv`` divides ``h`` (GQA with ``enable_gqa``, else equal).
        segments: the rows' segments ([b, s]), any backend (``"auto"`` is resolved here for
            ``q``'s device and dtype; the decoder resolves it once per forward instead, see
            :func:`prepare`).
        dropout_p: attention dropout probability (``"sdpa"`` only).
        enable_gqa: key/value heads shared by groups of query heads.
        scale: the factor of the query-key products (None: ``hd ** -0.5``).

    Returns:
        [b, s, h, hd]. Each sample's outputs equal its outputs alone (to float rounding);
        padding's are zeros (``"sdpa"``, ``"flex"``) or padding attending causally among
        itself (``"varlen"``), finite either way.
    """
    backend = segments.backend
    if backend == "auto":
        backend = resolve_backend(
            backend, q.device, q.dtype, dropout=dropout_p > 0, blocks=segments.blocks is not None
        )
    if backend == "sdpa":
        return _per_sample(q, k, v, segments, dropout_p, enable_gqa, scale)
    if backend == "flex":
        return _flex(q, k, v, segments, enable_gqa, scale)
    if backend == "varlen":
        return _varlen(q, k, v, segments, enable_gqa, scale)
    raise ValueError(f"mask: unknown packed attention backend {backend!r}")


# ---------------------------------------------------------------------- per-sample SDPA


def _per_sample(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: PackedSegments,
    dropout_p: float,
    enable_gqa: bool,
    scale: float | None,
) -> torch.Tensor:
    """:func:`_per_sample_sdpa`, behind a graph break while compiling."""
    if torch.compiler.is_compiling():
        return _per_sample_disabled()(q, k, v, segments, dropout_p, enable_gqa, scale)
    return _per_sample_sdpa(q, k, v, segments, dropout_p, enable_gqa, scale)


def _per_sample_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: PackedSegments,
    dropout_p: float,
    enable_gqa: bool,
    scale: float | None,
) -> torch.Tensor:
    """:func:`per_sample_attention`'s outputs concatenated back into [b, s, h, hd] (one copy,
    which also makes the result contiguous for the output projection)."""
    parts = per_sample_attention(
        q, k, v, segments, dropout_p=dropout_p, enable_gqa=enable_gqa, scale=scale
    )
    return torch.cat(parts).view(q.shape)


def per_sample_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: PackedSegments,
    *,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    scale: float | None = None,
) -> list[torch.Tensor]:
    """:func:`packed_attention`'s ``"sdpa"`` backend before its one concatenation: one causal
    SDPA call per sample on [b, s, h, hd] inputs (with a mask [n, n] for a sample longer than
    the segments' window, and for every sample with blocks), each segment's outputs [n, h,
    hd] in row order, zeros for padding: ``torch.cat(parts).view(b, s, h, hd)`` is
    ``packed_attention``'s result. SDPA keeps each sample's outputs for its backward pass; a
    caller that concatenates them inside a recomputed region keeps no second copy (see
    :class:`~fusion.decoder.attention.MultiHeadAttention`). Arguments as
    :func:`packed_attention`'s.

    The inputs are cut with one ``split`` of the flattened ``[b * s]`` positions, whose
    backward is one concatenation: slicing each sample instead costs, in backward, a zeroed
    input-sized gradient per sample and their sum (n times the work, and many more short
    parallel regions, which shared cores make slow). Samples of equal length are not batched
    into one call: stacking them would copy q, k and v, and LLaVA-like length mixes rarely
    repeat a length; the call overhead (tens of microseconds) is small beside a sample's
    attention."""
    b, s, h, hd = q.shape
    flat = [n for row in segments.lengths for n in row]
    padding = {  # the index in ``flat`` of each row's padding segment
        sum(len(row) for row in segments.lengths[: r + 1]) - 1
        for r, pad in enumerate(segments.padding)
        if pad
    }
    pieces = zip(  # [n, h or h_kv, hd] views
        q.reshape(b * s, h, hd).split(flat),
        k.reshape(b * s, k.size(2), hd).split(flat),
        v.reshape(b * s, v.size(2), hd).split(flat),
        strict=True,
    )
    blocks = None if segments.blocks is None else segments.blocks.reshape(b * s).split(flat)
    parts = []
    for i, (qi, ki, vi) in enumerate(pieces):
        if i in padding:  # never attended by a sample, never a target
            # One zero broadcast: a caller that keeps the parts keeps 4 bytes for the padding
            parts.append(q.new_zeros(()).expand(qi.shape))
            continue
        n, window = qi.size(0), segments.window
        band = None
        if blocks is not None:  # the sample's own blocks: none reaches another sample
            band = causal_band(n, window, q.device, blocks[i])
        elif window is not None and n > window:
            band = causal_band(n, window, q.device)
        out = F.scaled_dot_product_attention(  # [1, h, n, hd]
            qi.transpose(0, 1)[None],
            ki.transpose(0, 1)[None],
            vi.transpose(0, 1)[None],
            attn_mask=band,
            dropout_p=dropout_p,
            is_causal=band is None,
            enable_gqa=enable_gqa,
            scale=scale,
        )
        parts.append(out[0].transpose(0, 1))  # [n, h, hd]
    return parts


def _per_sample_disabled() -> Any:
    """:func:`_per_sample_sdpa` behind ``torch.compiler.disable``, made on first use under
    compilation (so that eager use never imports ``torch._dynamo``)."""
    global _disabled_per_sample
    if _disabled_per_sample is None:
        _disabled_per_sample = torch.compiler.disable(
            _per_sample_sdpa, reason="a Python loop over the host-known sample lengths"
        )
    return _disabled_per_sample


# ---------------------------------------------------------------------- FlexAttention


def document_block_mask(segment_ids: torch.Tensor, window: int | None = None) -> Any:
    """FlexAttention's ``BlockMask`` [b, 1, s, s] for document-causal attention over
    ``segment_ids`` (int32 [b, s], -1 for padding, as in ``PackedSegments``): a query attends
    to the keys at or before it in its own sample, with a ``window`` only to the ``window``
    latest (itself included); padding attends to nothing.

    Made from per-block segment ranges on the device: the ids increase along a row, so with
    padding taken as one last id, a block of queries meets a block of keys at or before it
    iff its smallest id is at most their largest, and attends to all of them iff both blocks
    hold one sample only. O(b * (s + (s / 128)^2)), no synchronisation."""
    from torch.nn.attention.flex_attention import BlockMask

    ids = segment_ids
    b, s = ids.shape
    n = -(-s // FLEX_BLOCK)
    # Padding's id is s, above every sample's, so that ids never decrease along a row; the
    # positions after s (the last block's rest) count as padding.
    doc = torch.where(ids >= 0, ids, s)
    doc = F.pad(doc, (0, n * FLEX_BLOCK - s), value=s).view(b, n, FLEX_BLOCK)
    low, high = doc.amin(-1), doc.amax(-1)  # [b, n]
    q_low, q_high = low[:, :, None], high[:, :, None]  # [b, n, 1] query blocks
    k_low, k_high = low[:, None, :], high[:, None, :]  # [b, 1, n] key blocks
    blocks = torch.arange(n, device=ids.device)
    at_or_before = blocks[None, :] <= blocks[:, None]  # [n, n]: key block <= query block
    some = at_or_before & (q_low <= k_high) & (q_low < s)
    whole = blocks[None, :] < blocks[:, None]
    if s % FLEX_BLOCK:  # the last query block has positions past s: never whole
        whole = whole & (blocks < n - 1)[:, None]
    full = whole & (k_low == q_high) & (q_high < s)
    if window is not None:
        # Block distance d: its nearest query and key are d * B - (B - 1) apart, its
        # farthest d * B + B - 1.
        distance = (blocks[:, None] - blocks[None, :]) * FLEX_BLOCK
        some = some & (distance - (FLEX_BLOCK - 1) < window)
        full = full & (distance + FLEX_BLOCK - 1 < window)
    partial = some & ~full

    def indices(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = chosen.sum(-1, dtype=torch.int32)[:, None]  # [b, 1, n]
        # The chosen key blocks first, in increasing order (a stable sort of 1s before 0s).
        order = torch.sort(chosen.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return counts, order.to(torch.int32)[:, None]  # [b, 1, n, n]

    def document_causal(
        batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        same = ids[batch, q_idx] == ids[batch, kv_idx]
        allowed = same & (q_idx >= kv_idx) & (ids[batch, q_idx] >= 0)
        return allowed if window is None else allowed & (q_idx - kv_idx < window)

    counts, order = indices(partial)
    full_counts, full_order = indices(full)
    return BlockMask.from_kv_blocks(
        counts,
        order,
        full_counts,
        full_order,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=document_causal,
        seq_lengths=(s, s),
    )


def _flex_function() -> Any:
    """``torch.compile(flex_attention)``, made on first use."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: PackedSegments,
    enable_gqa: bool,
    scale: float | None,
) -> torch.Tensor:
    if q.size(1) == 1:
        # Rows of one position: each attends to itself alone. Compiled CPU FlexAttention
        # (torch 2.13) fails to build its kernel for them once shapes are dynamic (b > 1).
        return _per_sample(q, k, v, segments, 0.0, enable_gqa, scale)
    block_mask = segments.block_mask
    if block_mask is None:
        block_mask = document_block_mask(segments.segment_ids, segments.window)
    out = _flex_function()(  # [b, h, s, hd]
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=block_mask,
        enable_gqa=enable_gqa,
        scale=scale,
    )
    return out.transpose(1, 2)


# ---------------------------------------------------------------------- varlen


def _varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: PackedSegments,
    enable_gqa: bool,
    scale: float | None,
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    b, s, h, hd = q.shape
    bound = segments.max_length
    out = varlen_attn(  # [b * s, h, hd]
        q.reshape(b * s, h, hd),
        k.reshape(b * s, k.size(2), hd),
        v.reshape(b * s, v.size(2), hd),
        segments.cu_seqlens,
        segments.cu_seqlens,
        bound,
        bound,
        # causal; flash attention's left window counts the keys before the query
        window_size=(-1 if segments.window is None else segments.window - 1, 0),
        enable_gqa=enable_gqa,
        scale=scale,
    )
    return cast(torch.Tensor, out).view(b, s, h, hd)  # no auxiliary outputs asked for
