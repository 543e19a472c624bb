"""Fused merge: one Triton kernel writes every output row once, from the table or an encoder.

Each output row is read from exactly one place, the embedding table for text tokens or an
encoder's rows for placeholders, and written once: the bytes moved are the floor (output
written once, its source rows read once). Per output row the kernel reads a text id and a
source row (``-1`` for text), built from :meth:`Placement.destinations` in O(tokens) with no
host synchronisation and no data-dependent shape, so the merge can be captured in a CUDA
graph (``benchmarks/gpu_check.py`` checks both on a GPU).

The kernel moves raw bits (floats viewed as same-width integers), so it is bitwise exact for
every dtype. It runs compiled on CUDA and, for tests, on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, read when the kernel is first used in that mode). Triton is an
optional extra (``triton``: ``pip install 'triton>=3.3'``). The backward pass uses the same ATen ops
as the reference (:func:`fusion.merge.sources.merge_backward`), so gradients are bitwise equal
to it.
"""

import os

import torch

from fusion.merge.placement import Placement, match_text
from fusion.merge.sources import merge_backward, row_sources

try:
    import triton
    import triton.language as tl
except ImportError:  # optional extra: impl="auto" falls back, impl="fused" raises
    triton = None

# Same-width integer views: the kernel copies bits, never converts values.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _interpreting() -> bool:
    """Whether Triton runs kernels on its interpreter: ``TRITON_INTERPRET`` read as Triton
    reads it, straight from the environment so that ``torch.compile`` can trace the check."""
    flag = os.environ.get("TRITON_INTERPRET", "0").lower()
    return triton is not None and flag in ("1", "true", "on")


def check_fused(device: torch.device, dtype: torch.dtype) -> None:
    """Raise unless ``impl="fused"`` can run on ``device`` and ``dtype``.

    Raises:
        ImportError: Triton is not installed.
        ValueError: ``device`` is neither CUDA nor CPU under Triton's interpreter, or the
            element size is not 1, 2, 4 or 8 bytes.
    """
    if triton is None:
        raise ImportError(
            "impl: 'fused' needs Triton, which is not installed (pip install 'triton>=3.3'); "
            "use impl='auto' or 'index'"
        )
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        raise ValueError(
            "impl: 'fused' expected CUDA tensors (or CPU tensors under Triton's interpreter, "
            f"TRITON_INTERPRET=1, for testing), got device {device}"
        )
    if dtype.itemsize not in _BITS:
        raise ValueError(f"impl: 'fused' expected elements of 1, 2, 4 or 8 bytes, got {dtype}")


def fused_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`check_fused` passes."""
    try:
        check_fused(device, dtype)
    except (ImportError, ValueError):
        return False
    return True


if triton is not None:

    def _merge_rows_kernel(
        out_ptr,
        weight_ptr,
        ids_ptr,
        source_ptr,
        rows_ptrs,
        rows_stride0,
        rows_stride1,
        rows_offsets,
        rows_counts,
        n,
        dim,
        weight_stride0,
        weight_stride1,
        NUM_ENCODERS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """out[i] = rows_e[source[i] - offset_e] where source[i] >= 0, else weight[ids[i]].

        A program covers ``BLOCK_R`` output rows x ``BLOCK_D`` columns. Masked loads touch no
        memory, so every output element is read from one source only and stored once.
        """
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        row_ok = r < n
        col_ok = c[None, :] < dim
        c = c.to(tl.int64)  # offsets past 2**31 elements (e.g. a column-major table)
        source = tl.load(source_ptr + r, mask=row_ok, other=-1).to(tl.int64)
        ids = tl.load(ids_ptr + r, mask=row_ok, other=0).to(tl.int64)
        is_text = row_ok & (source < 0)
        text_ptrs = weight_ptr + ids[:, None] * weight_stride0 + c[None, :] * weight_stride1
        values = tl.load(text_ptrs, mask=is_text[:, None] & col_ok)
        for e in tl.static_range(NUM_ENCODERS):
            local = source - rows_offsets[e]
            inside = row_ok & (local >= 0) & (local < rows_counts[e])
            ptrs = rows_ptrs[e] + local[:, None] * rows_stride0[e] + c[None, :] * rows_stride1[e]
            values = tl.where(inside[:, None], tl.load(ptrs, mask=inside[:, None] & col_ok), values)
        out_ptrs = out_ptr + r[:, None].to(tl.int64) * dim + c[None, :]
        tl.store(out_ptrs, values, mask=row_ok[:, None] & col_ok)


_KERNELS: dict[bool, object] = {}


def _kernel():
    """The jitted kernel for the current mode (compiled or interpreted), built on first use."""
    interpret = _interpreting()
    if interpret not in _KERNELS:
        _KERNELS[interpret] = triton.jit(_merge_rows_kernel)
    return _KERNELS[interpret]


def launch_config(dim: int, itemsize: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_D, num_warps)``: 4 KiB row chunks, 16 KiB per program, 4 warps.

    A copy-like kernel saturates bandwidth with 16-byte vectors and a few KiB in flight per
    program; small ``dim`` packs more rows into a program instead.
    """
    block_d = min(triton.next_power_of_2(max(dim, 1)), 4096 // itemsize)
    block_r = min(64, max(1, 16384 // (block_d * itemsize)))
    return block_r, block_d, 4


def launch(
    out: torch.Tensor,
    weight: torch.Tensor,
    text_ids: torch.Tensor,
    source: torch.Tensor,
    rows: list[torch.Tensor],
    config: tuple[int, int, int] | None = None,
) -> None:
    """Fill ``out`` [n, d] (contiguous) in one kernel launch; see :func:`_merge_rows_kernel`."""
    n, dim = out.shape
    if n == 0 or dim == 0:
        return
    bits = _BITS[weight.element_size()]
    block_r, block_d, num_warps = config or launch_config(dim, weight.element_size())
    offsets, counts, used, start = [], [], [], 0
    for r in rows:
        if r.size(0):  # encoders without rows have nothing to read
            offsets.append(start)
            counts.append(r.size(0))
            used.append(r.view(bits))
        start += r.size(0)
    grid = (triton.cdiv(n, block_r), triton.cdiv(dim, block_d))
    _kernel()[grid](
        out.view(bits),
        weight.view(bits),
        text_ids,
        source,
        tuple(used),
        tuple(r.stride(0) for r in used),
        tuple(r.stride(1) for r in used),
        tuple(offsets),
        tuple(counts),
        n,
        dim,
        weight.stride(0),
        weight.stride(1),
        NUM_ENCODERS=len(used),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )


@torch.library.custom_op("fusion::merge_rows", mutates_args=())
def merge_rows(
    text_ids: torch.Tensor,
    weight: torch.Tensor,
    source: torch.Tensor,
    rows: list[torch.Tensor],
    destinations: list[torch.Tensor],
) -> torch.Tensor:
    """The fused merge as an operator (opaque to ``torch.compile``, differentiable).

    Args:
        text_ids: [n] ids into ``weight`` (0 at placeholders).
        weight: [vocab, d].
        source: [n] row of the encoders' rows concatenated in order, -1 for text tokens.
        rows: per encoder [n_rows, d], any strides.
        destinations: per encoder [n_rows], the output row of each row (n = dropped);
            used by the backward pass only.

    Returns:
        [n, d], contiguous, in ``weight``'s dtype.
    """
    check_fused(weight.device, weight.dtype)
    out = weight.new_empty(text_ids.numel(), weight.size(1))
    if weight.device.type == "cuda":
        with torch.cuda.device(weight.device):  # Triton launches on the current device
            launch(out, weight, text_ids, source, rows)
    else:
        launch(out, weight, text_ids, source, rows)
    return out


@merge_rows.register_fake
def _(text_ids, weight, source, rows, destinations):
    return weight.new_empty(text_ids.numel(), weight.size(1))


def _setup_context(ctx, inputs, output) -> None:
    text_ids, weight, source, _rows, destinations = inputs
    ctx.save_for_backward(text_ids, source, *destinations)
    ctx.vocab = weight.size(0)


def _backward(ctx, grad: torch.Tensor):
    text_ids, source, *destinations = ctx.saved_tensors
    grad_weight, grad_rows = merge_backward(
        grad,
        text_ids,
        source,
        destinations,
        ctx.vocab,
        table_grad=ctx.needs_input_grad[1],
        rows_grad=ctx.needs_input_grad[3],
    )
    return None, grad_weight, None, grad_rows, [None] * len(destinations)


merge_rows.register_autograd(_backward, setup_context=_setup_context)


def merge_fused(
    text_ids: torch.Tensor, weight: torch.Tensor, placements: list[Placement]
) -> torch.Tensor:
    """Merge by one Triton kernel; ``text_ids`` [b, s] -> embeddings [b, s, d]."""
    placements = match_text(placements, weight)
    batch, seq_len = text_ids.shape
    source, destinations = row_sources(text_ids, placements)
    out = merge_rows(
        text_ids.reshape(-1), weight, source, [p.rows for p in placements], destinations
    )
    return out.view(batch, seq_len, weight.size(1))
