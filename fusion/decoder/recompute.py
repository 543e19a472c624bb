"""Selective recomputation: cheap work (norms, SwiGLU's gate, packed attention's
concatenation of its samples' outputs) redone in the backward pass instead of its
intermediates kept from the forward.

On a Qwen2.5-VL-3B-wide SwiGLU (2048 -> 11008, 1024 tokens, fp32) the forward keeps 180 MiB
for the backward; recomputing ``silu(gate) * up`` (with the down projection inside the
recomputed region, so that the product it keeps for its weight's gradient goes too) keeps 94
MiB, for one more elementwise pass (about 40 ms on 2 CPU threads, under the three matrix
products' seconds). An RMSNorm keeps its input alone instead of also its normalised copy. The
same operations run again on the same values, so losses and gradients are bitwise those
without recomputation.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusion.decoder.few_rows import is_plain_linear


def recomputed(function: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``function(*inputs)``, keeping only ``inputs`` (and the parameters ``function`` reads)
    for the backward pass: its intermediates are recomputed there (``torch.utils.checkpoint``,
    non-reentrant, no RNG state: ``function`` must draw no random numbers). Where autograd
    records nothing (no grad mode, inference mode) it is a plain call, so inference pays
    nothing."""
    if torch.is_grad_enabled():
        return checkpoint(function, *inputs, use_reentrant=False, preserve_rng_state=False)
    return function(*inputs)


def recomputed_projection(
    projection: nn.Module, function: Callable[..., torch.Tensor], *inputs: torch.Tensor
) -> torch.Tensor:
    """``projection(function(*inputs))`` with ``function``'s work recomputed in the backward
    pass (:func:`recomputed`). A plain linear ``projection`` goes inside the recomputed region
    too, so the input it keeps for its weight's gradient is recomputed rather than kept; the
    recomputation stops once that input is back (``torch.utils.checkpoint``'s early stop),
    before the projection's own product, so no matrix product runs twice. Any other
    ``projection`` (an adapter, a wrapper) stays outside the region and keeps its input:
    recomputing it would run its products again. The module is called either way, so its
    hooks (FSDP2, tensor parallel, adapters) run."""
    if is_plain_linear(projection):
        return recomputed(lambda *args: projection(function(*args)), *inputs)
    return projection(recomputed(function, *inputs))
