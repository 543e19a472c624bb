import torch
import torch.nn.functional as F
from torch import nn

from fusion.decoder.few_rows import FewRowsLinear
from fusion.decoder.recompute import recomputed


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
            recomputed`): three ``[b, s, hidden_dim]`` tensors kept instead of four
            (``act(w1(x))`` goes), gradients unchanged bit for bit.

    Shapes: input ``[b, s, dim]``, output ``[b, s, dim]``.
    """

    def __init__(
        self, dim: int, hidden_dim: int, activation: str = "silu", recompute: bool = True
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.w1 = FewRowsLinear(dim, hidden_dim, bias=False)
        self.w2 = FewRowsLinear(hidden_dim, dim, bias=False)
        self.w3 = FewRowsLinear(dim, hidden_dim, bias=False)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = GATES[self.activation]
        gate, up = self.w1(x), self.w3(x)
        hidden = recomputed(gated, gate, up) if self.recompute else gated(gate, up)
        return self.w2(hidden)
