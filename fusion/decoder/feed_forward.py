import torch
import torch.nn.functional as F
from torch import nn

from fusion.decoder.recompute import recomputed


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``, no biases.

    Args:
        dim: the input and output width.
        hidden_dim: the width of ``w1`` and ``w3``.
        recompute: when training, keep ``w1(x)`` and ``w3(x)`` alone for the backward pass and
            recompute ``silu(w1(x)) * w3(x)`` there (:func:`~fusion.decoder.recompute.
            recomputed`): three ``[b, s, hidden_dim]`` tensors kept instead of four
            (``silu(w1(x))`` goes), gradients unchanged bit for bit.

    Shapes: input ``[b, s, dim]``, output ``[b, s, dim]``.
    """

    def __init__(self, dim: int, hidden_dim: int, recompute: bool = True) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return self.w2(recomputed(swiglu, self.w1(x), self.w3(x)))
        return self.w2(swiglu(self.w1(x), self.w3(x)))
