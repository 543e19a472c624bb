"""Freed host memory handed back to the system at a CPU training step's two peaks.

glibc's ``malloc`` keeps the pages of freed blocks in its heap for later requests, but a
request it cannot place in the freed holes (too large, or the holes too cut up) gets fresh
pages on top. In a CPU training step the process's resident memory therefore climbs well past
what it holds alive: measured on the SmolVLM-shaped step of ``benchmarks/finetune.py``, the
heap held about 300 MiB of freed pages when the loss began and about 500 MiB when the
embedding's dense gradient was made, the two moments the step peaks. ``malloc_trim`` returns
those pages; the tensors made next get fresh ones, which costs their first touch and nothing
else (the resident memory is all that changes, never a value).
"""

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fusion.training.modules import decoder_of_model


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` from the process's own C library; None where it has none
    (musl, macOS)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def release_freed_host_memory() -> bool:
    """Hands the pages of freed host memory that the C library's heap keeps back to the system
    (glibc's ``malloc_trim(0)``). Returns whether any were; False where the C library has no
    ``malloc_trim``. Tensors and their values are untouched: only the resident memory changes,
    and the next allocations there take fresh pages."""
    trim = _malloc_trim()
    return trim is not None and trim(0) == 1


def _release_after_forward(module: nn.Module, args: Any, output: Any) -> None:
    if torch.is_grad_enabled() and _on_cpu(output):
        release_freed_host_memory()


def _release_when_gradient_arrives(module: nn.Module, args: Any, output: Any) -> None:
    if _on_cpu(output) and output.requires_grad:
        output.register_hook(_release_before_backward)


def _release_before_backward(grad: torch.Tensor) -> None:
    release_freed_host_memory()


def _on_cpu(output: Any) -> bool:
    """Whether ``output`` (a tensor, or the decoder's list of them: output chunks, hidden
    states before the output) is on the CPU, seen from its first tensor."""
    while isinstance(output, list | tuple) and output:
        output = output[0]
    return isinstance(output, torch.Tensor) and output.device.type == "cpu"


class MemoryRelease:
    """The hooks :func:`release_freed_memory` installed; :meth:`remove` takes them off."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def release_freed_memory(model: nn.Module) -> MemoryRelease:
    """Hand freed host memory back to the system (:func:`release_freed_host_memory`) at the
    two peaks of each CPU training step of ``model``'s decoder, applied from outside with
    hooks (no module replaced, no key changed):

    - after the decoder's forward in grad mode, before the loss: the forward's transients
      (an encoder's, the decoder's recomputed ones) are freed by then, while every saved
      activation is alive and the loss's chunks come next;
    - in the backward, when the gradient of the token embedding's output arrives: every
      layer's activations are freed by then, and the embedding's dense ``[vocab, d]``
      gradient comes next.

    Only where the decoder's hidden states are on the CPU; without a glibc heap nothing
    happens. Measured on the SmolVLM-shaped step of ``benchmarks/finetune.py``: the peak about
    180 MiB lower (2446 to 2274 MiB) for about 3% of the step's time, the freed pages' first
    touch again.

    Raises:
        ValueError: ``model`` is not (behind its wrappers) a decoder or a model over one.
    """
    decoder = decoder_of_model(model)
    return MemoryRelease(
        [
            decoder.register_forward_hook(_release_after_forward),
            decoder.tok_embeddings.register_forward_hook(_release_when_gradient_arrives),
        ]
    )
