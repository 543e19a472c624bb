"""Linear layers on a decoding step's few rows, on the CPU: ``weight @ h.T`` instead of
``h @ weight.T``, the same product in the layout BLAS streams at the memory's speed.

The decoder's projections are :class:`FewRowsLinear` modules, an ``nn.Linear`` whose own
forward takes that product, so they are called as modules (their hooks run) and no private
torch attribute is read; a tied output, a weight tensor, takes :func:`tied_projection`."""

from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

#: Up to this many rows of float32 on the CPU, a linear layer's product is taken as
#: ``weight @ h.T`` (:func:`few_rows_product`).
FEW_ROWS = 4

#: The smallest weight (elements) :class:`FewRowsLinear` takes that product for: below it the
#: extra ops cost more than the product saves (2026-12-03, weights from memory: 128 x 512, 5
#: against 12 us; 512 x 512, 67 against 50 us on one thread, 29 on two).
FEW_ROWS_MIN_WEIGHT = 1 << 18


def few_rows_product(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(h, weight)`` (no bias) for ``weight`` [out, d] and ``h`` [..., d] with at most
    :data:`FEW_ROWS` rows of float32 on the CPU, without autocast, taken as ``weight @ h.T``
    (one row doubled, then cut back: one column would take BLAS's matrix-vector path, the
    slow one), where autograd records nothing (``no_grad``, inference mode: decoding); None
    for any other input, which the caller then computes as it would.

    BLAS then reads ``weight`` once at the memory's speed and on every thread, where
    ``F.linear``'s layout runs several times slower on a few rows, and on one thread only
    (MKL's matrix-vector product). Measured (2026-12-03, shared cores): 1536 x 512 float32
    weights from memory, 206 against 141 us on one thread, 209 against 127 us on two; the
    32768 x 1024 output table of the hybrid-stack decoding benchmark on two threads, 6.6 against
    3.0 ms for one row, 14.6 against 3.1 ms for four; from 8 rows on the gain shrinks (15.8
    against 10.4 ms) and turns to a loss on one thread. The sums run in another order: the
    outputs may differ from ``F.linear``'s in the last bits (about 1e-6 of their size).

    Returns:
        [..., out], or None.
    """
    # Where autograd records nothing only (decoding): a training forward's row count may be
    # symbolic under torch.compile (regional compilation, dynamic shapes), where this bound
    # would be a guard, and a recompilation for the rows on its other side.
    if torch.is_grad_enabled():
        return None
    rows = h.numel() // h.size(-1) if h.dim() and h.size(-1) else 0
    if not (
        0 < rows <= FEW_ROWS
        and h.device.type == "cpu"
        and h.dtype == weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
    ):
        return None
    flat = h.reshape(rows, h.size(-1))
    if rows == 1:  # [2, d]: the row twice (an expanded view would be copied less well)
        out = (weight @ torch.cat((flat, flat)).T)[:, 0]  # [out]
        return out.view(*h.shape[:-1], weight.size(0))
    return (weight @ flat.T).T.reshape(*h.shape[:-1], weight.size(0))


class FewRowsLinear(nn.Linear):
    """``nn.Linear`` (same arguments, same state-dict keys ``weight`` and ``bias``) whose
    forward takes :func:`few_rows_product` where that is the same computation: no bias, a
    weight that is a plain ``nn.Parameter`` (a DTensor or a quantized tensor keeps
    ``F.linear``, as their own types define it) of at least :data:`FEW_ROWS_MIN_WEIGHT`
    elements, few float32 rows on the CPU while autograd records nothing. It is the module's
    own forward: hooks (its own, global ones, adapters') run through ``__call__`` as always.

    Shapes: ``x`` [..., in], returns [..., out].
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            self.bias is None
            and type(weight) is nn.Parameter
            and weight.numel() >= FEW_ROWS_MIN_WEIGHT
        ):
            out = few_rows_product(x, weight)
            if out is not None:
                return out
        return F.linear(x, weight, self.bias)


#: The linear layers whose forward is ``F.linear``'s computation: ``nn.Linear`` and the
#: decoder's :class:`FewRowsLinear`, exactly (other subclasses, adapters', may compute
#: something else).
PLAIN_LINEARS: tuple[type[nn.Linear], ...] = (nn.Linear, FewRowsLinear)


def is_plain_linear(module: object) -> TypeGuard[nn.Linear]:
    """Whether ``module`` is exactly one of :data:`PLAIN_LINEARS` (no other subclass)."""
    return type(module) in PLAIN_LINEARS


def tied_projection(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(h, weight)`` for a tied output ``weight`` [vocab, d] and ``h`` [..., d]:
    :func:`few_rows_product` where it applies."""
    out = few_rows_product(h, weight)
    return F.linear(h, weight) if out is None else out
