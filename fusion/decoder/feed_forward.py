import torch
import torch.nn.functional as F
from torch import nn

#: The gate activations of :class:`FeedForward`: SwiGLU's SiLU, and GeGLU's tanh-approximated
#: GELU (Gemma's ``gelu_pytorch_tanh``).
ACTIVATIONS = ("silu", "gelu_tanh")


class FeedForward(nn.Module):
    """Gated MLP: ``w2(act(w1(x)) * w3(x))``, no biases; SwiGLU by default, GeGLU with
    ``activation="gelu_tanh"``.

    Shapes: input ``[b, s, dim]``, output ``[b, s, dim]``.
    """

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.w2(gate * self.w3(x))
