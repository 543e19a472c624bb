"""Single-pass CPU merge: the merge as plain ops, compiled by inductor, writes each row once.

Output row ``i`` is ``table[text_ids[i]]``, or the encoder row its placeholder takes: one
``torch.where`` per encoder over two gathers, which inductor fuses into one loop that writes
the output once (``index`` writes the placeholder rows twice: the embedding, then the rows).
Where each row comes from is :func:`fusion.merge.sources.row_sources`: O(tokens) metadata, no
host synchronisation, no data-dependent shape.

Compilation: one graph per bucket, compiled on the first call in the bucket and cached for
the process. A bucket is the number of encoders with rows, the element view and whether the
table's rows are contiguous; token and row counts, the vocabulary and the width are
symbolic (``dynamic=True``, sizes 0 and 1 included), so a new batch shape or a new number of
images never recompiles. The kernel moves raw bits: rows are viewed as int32 when their bytes
allow it (fp32, bf16 with an even width), else as same-width integers, so every floating dtype
is exact. The backward pass is eager, with the same ATen ops as ``reference``
(:func:`fusion.merge.sources.merge_backward`): gradients are bitwise equal to its own.

Under an enclosing ``torch.compile`` (the merge inside a compiled ``EarlyFusion``) the same
ops run inline, differentiable, for the outer compile to fuse: no nested compilation, no
graph break.
"""

import contextlib
import types
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.fx.experimental._config as fx_config

from fusion.merge.placement import Placement, match_text
from fusion.merge.sources import merge_backward, row_sources

# Same-width integer views (bits move, values are never converted).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_COMPILED: dict[tuple, Callable[..., None]] = {}
_FAILED: set[tuple] = set()


def select_rows(
    text_ids: torch.Tensor, source: torch.Tensor, table: torch.Tensor, rows: list[torch.Tensor]
) -> torch.Tensor:
    """``out[i] = rows_e[source[i] - start_e]`` where ``source[i]`` falls in encoder ``e``'s
    rows, else ``table[text_ids[i]]``.

    Args:
        text_ids: [n] ids into ``table``. source: [n] as :func:`row_sources` returns it.
        table: [vocab, d]. rows: per encoder [n_rows, d], each with at least one row
            (an encoder without rows has nothing to read).

    Returns:
        [n, d]; plain ops, differentiable.
    """
    out = table[text_ids]
    start = 0
    for r in rows:
        local = source - start
        inside = (local >= 0) & (local < r.size(0))
        out = torch.where(inside[:, None], r[local.clamp(0, r.size(0) - 1)], out)
        start += r.size(0)
    return out


def _fill(
    out: torch.Tensor,
    text_ids: torch.Tensor,
    source: torch.Tensor,
    table: torch.Tensor,
    *rows: torch.Tensor,
) -> None:
    """:func:`select_rows` written into ``out`` [n, d] (inductor writes it in place)."""
    out.copy_(select_rows(text_ids, source, table, list(rows)))


def _compiled(bucket: tuple) -> Callable[..., None]:
    """The compiled :func:`_fill` of ``bucket``, built once.

    Each bucket compiles its own copy of ``_fill``'s code: dynamo keeps its cache (and its
    recompile limit) per code object, so buckets never evict each other.
    """
    fn = _COMPILED.get(bucket)
    if fn is None:
        code = _fill.__code__.replace()
        fill = types.FunctionType(code, _fill.__globals__, _fill.__name__)
        fn = _COMPILED[bucket] = torch.compile(fill, dynamic=True, fullgraph=True)
    return fn


def _view(t: torch.Tensor, bits: torch.dtype) -> torch.Tensor:
    """``t`` [m, d] viewed as ``bits`` (its rows' bytes reinterpreted)."""
    return t.view(bits) if t.dtype.itemsize != bits.itemsize else t.view(_BITS[t.dtype.itemsize])


def _bits(table: torch.Tensor, rows: list[torch.Tensor]) -> torch.dtype:
    """int32 when every row's bytes can be read as int32 (unit last stride, every other stride,
    the offset and the row a multiple of 4 bytes): 32 bytes per AVX2 vector for any dtype.
    Else same-width integers."""
    size = table.dtype.itemsize

    def widens(t: torch.Tensor) -> bool:
        offsets = (t.storage_offset(), *t.stride()[:-1], t.size(-1))
        return t.stride(-1) == 1 and all(o * size % 4 == 0 for o in offsets)

    if size < 4 and all(widens(t) for t in (table, *rows)):
        return torch.int32
    return _BITS[size]


class _SinglePass(torch.autograd.Function):
    """The compiled forward and the eager, reference-equal backward."""

    @staticmethod
    def forward(ctx, text_ids, source, table, destinations, *rows):
        n, dim = text_ids.numel(), table.size(1)
        out = table.new_empty(n, dim)
        used = [r for r in rows if r.size(0)]  # encoders without rows have nothing to read
        if not used:  # text only: one gather, a copy of table rows (no graph to compile)
            torch.index_select(table, 0, text_ids, out=out)
        elif n and dim:
            bits = _bits(table, used)
            # Detached: no input is a view, so dynamo's guards never see the bases (whose
            # dtype and rank vary with the caller's tensors). int64 ids: one graph for int32.
            out_bits, table_bits, *rows_bits = (
                _view(t, bits).detach() for t in (out, table, *used)
            )
            ids = text_ids.long().detach()
            bucket = (len(used), bits, table.is_contiguous())
            _run(bucket, out_bits, ids, source.detach(), table_bits, *rows_bits)
        ctx.save_for_backward(text_ids, source, *destinations)
        ctx.vocab = table.size(0)
        return out

    @staticmethod
    def backward(ctx, grad):
        text_ids, source, *destinations = ctx.saved_tensors
        grad_table, grad_rows = merge_backward(
            grad,
            text_ids,
            source,
            destinations,
            ctx.vocab,
            table_grad=ctx.needs_input_grad[2],
            rows_grad=any(ctx.needs_input_grad[4:]),
        )
        if grad_rows is None:
            return None, None, grad_table, None, *([None] * len(destinations))
        return None, None, grad_table, None, *grad_rows


@contextlib.contextmanager
def _symbolic_sizes() -> Iterator[None]:
    """Sizes neither specialised at 0 and 1 nor tied to each other when equal, so one graph
    serves every batch. Set directly: ``fx_config.patch`` costs about 50 us a call."""
    saved = fx_config.backed_size_oblivious, fx_config.use_duck_shape
    fx_config.backed_size_oblivious, fx_config.use_duck_shape = True, False
    try:
        yield
    finally:
        fx_config.backed_size_oblivious, fx_config.use_duck_shape = saved


def _run(bucket: tuple, out: torch.Tensor, *args: torch.Tensor) -> None:
    """Fill ``out`` with the bucket's compiled graph; if inductor cannot compile (e.g. no C++
    compiler), warn once and run the same ops eagerly (same bits, slower)."""
    # Dynamo does not compile under a TorchDispatchMode (FlopCounterMode, debug modes), and
    # a frame it skipped once it skips for good: such calls run the same ops uncompiled.
    if bucket not in _FAILED and not torch._C._len_torch_dispatch_stack():
        try:
            with _symbolic_sizes():
                _compiled(bucket)(out, *args)
            return
        except torch._dynamo.exc.BackendCompilerFailed as e:
            _FAILED.add(bucket)
            warnings.warn(
                f"impl 'compiled': inductor could not compile the merge "
                f"({type(e.inner_exception).__name__}: {e.inner_exception}); merging with the "
                "same ops uncompiled instead (the same bits, slower)",
                RuntimeWarning,
                stacklevel=4,
            )
    _fill(out, *args)


def merge_compiled(
    text_ids: torch.Tensor, table: torch.Tensor, placements: list[Placement]
) -> torch.Tensor:
    """Merge in one compiled pass; ``text_ids`` [b, s] -> embeddings [b, s, d].

    Args:
        text_ids: [b, s], 0 at placeholders. table: [vocab, d], a plain table (see
            :func:`fusion.merge.embedding_table`). placements: resolved by
            :func:`fusion.merge.placement.resolve_placements`.

    Returns:
        [b, s, d] in the table's dtype: the same bits as ``reference`` and, through autograd,
        the same gradients w.r.t. the table and the rows.
    """
    placements = match_text(placements, table)
    batch, seq_len = text_ids.shape
    source, destinations = row_sources(text_ids, placements)
    flat_ids = text_ids.reshape(-1)
    rows = [p.rows for p in placements]
    if torch.compiler.is_compiling():  # the enclosing compile fuses the plain ops
        used = [r for r in rows if r.size(0)]
        return select_rows(flat_ids, source, table, used).view(batch, seq_len, table.size(1))
    rows = [r if r.stride(-1) == 1 else r.contiguous() for r in rows]
    out = _SinglePass.apply(flat_ids, source, table, tuple(destinations), *rows)
    return out.view(batch, seq_len, table.size(1))
