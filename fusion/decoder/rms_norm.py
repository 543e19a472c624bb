import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned ``scale``, computed in float32.

    Args:
        dim: size of the last dimension of the input.
        eps: added to the mean square before the square root.

    Shapes: input ``[..., dim]``, output the same shape and dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.scale
