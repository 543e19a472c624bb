import torch
import torch.nn.functional as F
from torch import nn

from fusion._validation import is_int
from fusion.decoder.few_rows import FewRowsLinear
from fusion.decoder.recompute import recomputed_projection


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu_tanh(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


#: The gated products of :class:`FeedForward`, by its ``activation``: SwiGLU's SiLU, and
#: GeGLU's tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``).
GATES = {"silu": swiglu, "gelu_tanh": geglu_tanh}
ACTIVATIONS = tuple(GATES)


class FeedForward(nn.Module):
    """Gated MLP: ``w2(act(w1(x)) * w3(x))``, no biases; SwiGLU by default, GeGLU with
    ``activation="gelu_tanh"``.

    Args:
        dim: the input and output width.
        hidden_dim: the width of ``w1`` and ``w3``.
        activation: one of :data:`ACTIVATIONS`.
        recompute: when training, keep ``w1(x)`` and ``w3(x)`` alone for the backward pass and
            recompute ``act(w1(x)) * w3(x)`` there (:func:`~fusion.decoder.recompute.
            recomputed`): two ``[b, s, hidden_dim]`` tensors kept instead of four
            (``act(w1(x))`` goes, and so does the gated product that ``w2`` keeps for its
            weight's gradient), gradients unchanged bit for bit. The recomputation stops once
            the gated product is back, before ``w2``'s product would run again
            (``torch.utils.checkpoint``'s early stop, on by default), so the backward pass
            runs the same matrix products as without it. A ``w2`` that is not a plain linear
            layer (an adapter, a wrapper) keeps its input as before: recomputing it would
            run its products again.
        chunk_rows: when training, run the ``b * s`` rows through the MLP ``chunk_rows`` at a
            time (None: all at once). The same tensors are kept for the backward pass and the
            same matrix products run, but the ``[rows, hidden_dim]`` intermediates that live
            only while a chunk is computed (the gated product in the forward; the gradients
            of the gate, the up projection and the product in the backward, about five of
            them) are a chunk's, not the whole batch's: on a packed Qwen2.5-VL-3B row of 5,483
            tokens (hidden 11,008, fp32) the peak of the last layer's backward was 730 MiB
            lower (measured). Without gradients (inference) and under ``torch.compile`` the
            rows go at once.

    Shapes: input ``[b, s, dim]``, output ``[b, s, dim]``.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        activation: str = "silu",
        recompute: bool = True,
        chunk_rows: int | None = 1024,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        if chunk_rows is not None and not is_int(chunk_rows, 1):
            raise ValueError(f"chunk_rows: expected None or an int >= 1, got {chunk_rows!r:.40}")
        self.activation = activation
        self.w1 = FewRowsLinear(dim, hidden_dim, bias=False)
        self.w2 = FewRowsLinear(hidden_dim, dim, bias=False)
        self.w3 = FewRowsLinear(dim, hidden_dim, bias=False)
        self.recompute = recompute
        self.chunk_rows = chunk_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.size(-1) if x.size(-1) else 0
        if (
            self.chunk_rows is None
            or rows <= self.chunk_rows
            or not torch.is_grad_enabled()
            # Compiled, the chunk count would be one more guard on the row count (a graph per
            # count); the compiler fuses the elementwise work and frees its buffers itself.
            or torch.compiler.is_compiling()
        ):
            return self._mlp(x)
        # Chunks of rows: each chunk's backward runs (and frees its intermediates) before the
        # next's, in the reverse order of the forward.
        chunks = x.reshape(rows, x.size(-1)).split(self.chunk_rows)
        return torch.cat([self._mlp(chunk) for chunk in chunks]).view(*x.shape[:-1], -1)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        gated = GATES[self.activation]
        if not self.recompute:
            return self.w2(gated(gate, up))
        return recomputed_projection(self.w2, gated, gate, up)
