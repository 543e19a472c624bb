"""Single-pass CPU merge: a small C loop, compiled on first use, writes each output row once.

Output row ``i`` is one ``memcpy``: from ``table[text_ids[i]]``, or from the encoder row its
placeholder takes (``index`` writes the placeholder rows twice: the embedding, then the rows).
Where each row comes from is :func:`fusion.merge.sources.row_sources`: O(tokens) metadata, no
host synchronisation, no data-dependent shape. Rows are copied as bytes, so every dtype is
exact; the backward is :func:`fusion.merge.sources.merge_backward`, the reference's own ops.

The loop is built once per process with the system C compiler (``$CC``, else ``cc``; with
OpenMP where the compiler has it, on torch's threads), in a private temporary directory that
is removed once loaded: nothing is read from a shared cache. Building takes a fraction of a
second and serves every shape and dtype.

Where the loop cannot run (no compiler, a ``TorchDispatchMode`` that must see every op, a
column-major table) the merge is ``index``'s, with the same bits; strided rows are copied.
Under an enclosing ``torch.compile`` the merge is plain ops (:func:`select_rows`) for the outer
compile to fuse into one loop: no nested compilation, no graph break.
"""

import ctypes
import os
import shlex
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from fusion.merge.index import merge_index
from fusion.merge.placement import Placement, match_text
from fusion.merge.sources import merge_backward, row_sources

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* out[i] = the source row of output row i, copied as row_bytes bytes: encoder e's row
   source[i] - (rows before e) when source[i] >= 0, else table[ids[i]].
   Returns -1, or the first i whose source is out of range (nothing is read there). */
int64_t fusion_merge_rows(char *out, int64_t n, int64_t row_bytes, const int64_t *ids,
                          const char *table, int64_t vocab, int64_t table_stride,
                          const int64_t *source, int64_t encoders, const char *const *rows,
                          const int64_t *counts, const int64_t *strides, int64_t threads) {
    int64_t bad = n;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(min: bad)
    for (int64_t i = 0; i < n; ++i) {
        int64_t s = source[i], e = 0;
        const char *from;
        if (s < 0) {
            if (ids[i] < 0 || ids[i] >= vocab) { bad = i < bad ? i : bad; continue; }
            from = table + ids[i] * table_stride;
        } else {
            while (e < encoders && s >= counts[e]) s -= counts[e++];
            if (e == encoders) { bad = i < bad ? i : bad; continue; }
            from = rows[e] + s * strides[e];
        }
        memcpy(out + i * row_bytes, from, (size_t)row_bytes);
    }
    return bad == n ? -1 : bad;
}
"""
# Below this many output bytes one thread copies: waking the others costs more than it saves.
PARALLEL_MIN_BYTES = 1 << 20

# fusion_merge_rows' parameters, in order.
_ARGTYPES: list[type[ctypes.c_void_p] | type[ctypes.c_int64]] = [
    *(ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p),  # out, n, row_bytes, ids
    *(ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64),  # table, vocab, table_stride
    *(ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p),  # source, encoders, rows
    *(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64),  # counts, strides, threads
]
_LOCK = threading.Lock()
_UNBUILT = object()
_kernel_fn: object = _UNBUILT  # the C function, None where it could not be built


def kernel() -> Callable[..., int] | None:
    """The compiled row-copy loop, built on the first call of the process; None (warned once)
    where no C compiler could build it."""
    global _kernel_fn
    with _LOCK:
        if _kernel_fn is _UNBUILT:
            _kernel_fn = _build()
    return _kernel_fn  # type: ignore[return-value]


def _build() -> Callable[..., int] | None:
    cc = os.environ.get("CC") or "cc"  # may hold a command line: CC="ccache gcc"
    problem = ""
    with tempfile.TemporaryDirectory(prefix="fusion-merge-", ignore_cleanup_errors=True) as tmp:
        source = Path(tmp, "merge_rows.c")
        source.write_text(_SOURCE)
        for flags in ("-fopenmp", ""):  # without OpenMP the loop runs on one thread
            library = str(Path(tmp, f"merge_rows{len(flags)}.so"))
            try:
                command = [*shlex.split(cc), "-O2", "-shared", "-fPIC", *flags.split()]
                done = subprocess.run(
                    [*command, str(source), "-o", library],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if done.returncode == 0:
                    fn = ctypes.CDLL(library).fusion_merge_rows
                    fn.restype, fn.argtypes = ctypes.c_int64, _ARGTYPES
                    return fn
                last_line = done.stderr.strip().splitlines()[-1:]
                problem = last_line[0] if last_line else f"exit status {done.returncode}"
            except (OSError, ValueError, subprocess.SubprocessError) as e:
                problem = f"{type(e).__name__}: {e}"
    warnings.warn(
        f"impl 'compiled': could not build the merge loop with $CC or cc ({cc!r}: {problem}); "
        "merging as impl='index' instead (the same bits, two passes)",
        RuntimeWarning,
        stacklevel=5,
    )
    return None


def select_rows(
    text_ids: torch.Tensor, source: torch.Tensor, table: torch.Tensor, rows: list[torch.Tensor]
) -> torch.Tensor:
    """``out[i] = rows_e[source[i] - start_e]`` where ``source[i]`` falls in encoder ``e``'s
    rows, else ``table[text_ids[i]]``, as plain differentiable ops (one ``torch.where`` per
    encoder over two gathers, which inductor fuses into one loop).

    Args:
        text_ids: [n] ids into ``table``. source: [n] as :func:`row_sources` returns it.
        table: [vocab, d]. rows: per encoder [n_rows, d] (encoders without rows are skipped).

    Returns:
        [n, d].
    """
    out = F.embedding(text_ids, table)
    start = 0
    for r in rows:
        if r.size(0):
            local = source - start
            inside = (local >= 0) & (local < r.size(0))
            out = torch.where(inside[:, None], r[local.clamp(0, r.size(0) - 1)], out)
            start += r.size(0)
    return out


class _SinglePass(torch.autograd.Function):
    """The C loop forward and the reference-equal backward."""

    @staticmethod
    def forward(ctx, fn, text_ids, source, table, destinations, *rows):
        n, dim = text_ids.numel(), table.size(1)
        out = table.new_empty(n, dim)
        ids = text_ids.to(torch.int64).contiguous()
        size = table.element_size()
        threads = torch.get_num_threads() if out.nbytes >= PARALLEL_MIN_BYTES else 1
        bases = (ctypes.c_void_p * len(rows))(*[r.data_ptr() for r in rows])
        counts = (ctypes.c_int64 * len(rows))(*[r.size(0) for r in rows])
        strides = (ctypes.c_int64 * len(rows))(*[r.stride(0) * size for r in rows])
        table_rows = (table.data_ptr(), table.size(0), table.stride(0) * size)
        encoder_rows = (len(rows), bases, counts, strides)
        bad = -1
        if n and dim:
            bad = fn(out.data_ptr(), n, dim * size, ids.data_ptr(), *table_rows,
                     source.data_ptr(), *encoder_rows, threads)  # fmt: skip
        if bad >= 0:
            raise IndexError(
                f"tokens: text id {int(ids[bad])} at flat position {bad} is outside the "
                f"embedding table's {table.size(0)} rows"
            )
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
            table_grad=ctx.needs_input_grad[3],
            rows_grad=any(ctx.needs_input_grad[5:]),
        )
        unused = (None, None, None)
        if grad_rows is None:
            return *unused, grad_table, None, *([None] * len(destinations))
        return *unused, grad_table, None, *grad_rows


def merge_compiled(
    text_ids: torch.Tensor, table: torch.Tensor, placements: list[Placement]
) -> torch.Tensor:
    """Merge in one pass that writes each output row once; ``text_ids`` [b, s] -> [b, s, d].

    Args:
        text_ids: [b, s], 0 at placeholders. table: [vocab, d] on the CPU, a plain table (see
            :func:`fusion.merge.embedding_table`). placements: resolved by
            :func:`fusion.merge.placement.resolve_placements`.

    Returns:
        [b, s, d] in the table's dtype: the same bits as ``reference`` and, through autograd,
        the same gradients w.r.t. the table and the rows.

    Raises:
        IndexError: a text id outside the table's rows (checked before it is read).
    """
    placements = match_text(placements, table)
    batch, seq_len = text_ids.shape
    rows = [p.rows for p in placements]
    if torch.compiler.is_compiling():  # the enclosing compile fuses the plain ops
        source, _ = row_sources(text_ids, placements)
        out = select_rows(text_ids.reshape(-1), source, table, rows)
        return out.view(batch, seq_len, table.size(1))
    # A dispatch mode (FlopCounterMode, a debug mode) must see the ops, which the loop hides.
    # The loop copies whole rows: a table with strided rows (column-major) is read by index.
    plain = table.stride(-1) == 1 or table.size(-1) <= 1
    fn = kernel() if plain and not torch._C._len_torch_dispatch_stack() else None
    if fn is None:
        return merge_index(text_ids, lambda ids: F.embedding(ids, table), placements)
    source, destinations = row_sources(text_ids, placements)
    flat_ids = text_ids.reshape(-1)
    rows = [r if r.stride(-1) == 1 or r.size(-1) <= 1 else r.contiguous() for r in rows]
    out = _SinglePass.apply(fn, flat_ids, source, table, tuple(destinations), *rows)
    return out.view(batch, seq_len, table.size(1))
