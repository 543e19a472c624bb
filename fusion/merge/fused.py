"""Fused merge: one Triton kernel writes every output row once, from the table or an encoder.

The bytes moved are the floor (each output row written once, its source row read once), with
no host synchronisation and no data-dependent shape, so CUDA graphs can capture it
(``benchmarks/gpu_check.py``). Rows move as raw bits (same-width integer views), exact for every
dtype; the backward uses the reference's ATen ops. On CPU it runs only under Triton's
interpreter, for tests (``TRITON_INTERPRET=1``). Triton is the optional extra ``triton``.
"""

import contextlib
import functools
import os

import torch

from fusion.merge.placement import Placement, match_text

try:
    import triton
    import triton.language as tl
except ImportError:  # optional extra: impl="auto" falls back, impl="fused" raises
    triton = None

# Same-width integer views: the kernel copies bits, never converts values.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _interpreting() -> bool:
    """``TRITON_INTERPRET`` read as Triton reads it, from the environment (traceable)."""
    flag = os.environ.get("TRITON_INTERPRET", "0").lower()
    return triton is not None and flag in ("1", "true", "on")


def check_fused(device: torch.device, dtype: torch.dtype) -> None:
    """Raise unless ``impl="fused"`` can run on ``device`` and ``dtype``."""
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
    with contextlib.suppress(ImportError, ValueError):
        check_fused(device, dtype)
        return True
    return False


if triton is not None:

    def _merge_rows_kernel(
        out_ptr, weight_ptr, ids_ptr, source_ptr,
        rows_ptrs, rows_stride0, rows_stride1, rows_offsets, rows_counts,  # per encoder
        n, dim, weight_stride0, weight_stride1,
        NUM_ENCODERS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """out[i] = rows_e[source[i] - offset_e] where source[i] >= 0, else weight[ids[i]], by
        programs of ``BLOCK_R`` rows x ``BLOCK_D`` columns (masked loads touch no memory)."""
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


@functools.cache
def _kernel(interpret: bool):
    """The kernel jitted for a mode (Triton reads ``TRITON_INTERPRET`` when it jits)."""
    return triton.jit(_merge_rows_kernel)


def launch_config(dim: int, itemsize: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_D, num_warps)``: 4 KiB row chunks, 16 KiB per program, 4 warps (a
    copy-like kernel saturates bandwidth with a few KiB in flight per program; small ``dim``
    packs more rows into a program instead)."""
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
    used = [r.view(bits) for r in rows if r.size(0)]  # encoders without rows: nothing to read
    counts = [r.size(0) for r in used]
    offsets = [sum(counts[:e]) for e in range(len(used))]
    grid = (triton.cdiv(n, block_r), triton.cdiv(dim, block_d))
    _kernel(_interpreting())[grid](
        out.view(bits), weight.view(bits), text_ids, source,
        tuple(used), tuple(r.stride(0) for r in used), tuple(r.stride(1) for r in used),
        tuple(offsets), tuple(counts),
        n, dim, weight.stride(0), weight.stride(1),
        NUM_ENCODERS=len(used), BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip


@torch.library.custom_op("fusion::merge_rows", mutates_args=())
def merge_rows(
    text_ids: torch.Tensor,
    weight: torch.Tensor,
    source: torch.Tensor,
    rows: list[torch.Tensor],
    destinations: list[torch.Tensor],
) -> torch.Tensor:
    """The fused merge as an operator (opaque to ``torch.compile``, differentiable; callers
    checked :func:`check_fused`): [n, d] from ``text_ids`` [n] into ``weight`` [vocab, d], or
    where ``source`` [n] is not -1, from that row of the encoders' ``rows`` in order;
    ``destinations``: per encoder, each row's output row (n: dropped), for the backward."""
    out = weight.new_empty(text_ids.numel(), weight.size(1))
    cuda = weight.device.type == "cuda"  # Triton launches on the current device
    with torch.cuda.device(weight.device) if cuda else contextlib.nullcontext():
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
    """What the reference's ``F.embedding`` and ``masked_scatter`` pass back, bit for bit:
    the table's gradient from the output's with placeholder rows zeroed, each row's gradient
    from its output row (zeros for padding rows, which land on the spill row ``n``)."""
    text_ids, source, *destinations = ctx.saved_tensors
    n = text_ids.numel()
    grad_weight = grad_rows = None
    if ctx.needs_input_grad[1]:
        text_grad = grad.masked_fill((source >= 0)[:, None], 0)
        grad_weight = torch.ops.aten.embedding_dense_backward(
            text_grad, text_ids, ctx.vocab, -1, False
        )
    if ctx.needs_input_grad[3]:
        grad_rows = [
            grad.new_zeros(dest.numel(), grad.size(1))
            if n == 0
            else grad.index_select(0, dest.clamp(max=n - 1)).masked_fill_((dest == n)[:, None], 0)
            for dest in destinations
        ]
    return None, grad_weight, None, grad_rows, [None] * len(destinations)


merge_rows.register_autograd(_backward, setup_context=_setup_context)


def merge_fused(
    text_ids: torch.Tensor, weight: torch.Tensor, placements: list[Placement]
) -> torch.Tensor:
    """Merge by one Triton kernel; ``text_ids`` [b, s] -> embeddings [b, s, d]. Padding rows'
    destinations are the spill slot ``b * s`` of ``source``, which no output row reads."""
    placements = match_text(placements, weight)
    batch, seq_len = text_ids.shape
    n = text_ids.numel()
    source = torch.full((n + 1,), -1, dtype=torch.int64, device=text_ids.device)
    destinations, start = [p.destinations() for p in placements], 0
    for p, dest in zip(placements, destinations, strict=True):
        source.index_copy_(0, dest, torch.arange(start, start + p.rows.size(0), device=dest.device))
        start += p.rows.size(0)
    rows = [p.rows for p in placements]
    out = merge_rows(text_ids.reshape(-1), weight, source[:n], rows, destinations)
    return out.view(batch, seq_len, weight.size(1))
