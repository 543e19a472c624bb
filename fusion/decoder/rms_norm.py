import torch
import torch.nn.functional as F
from torch import nn

from fusion.decoder.recompute import recomputed

# Each norm's ``recompute`` (on by default): when training, only the input is kept for the
# backward pass and the normalised copy is recomputed there (:func:`recomputed`), one
# ``[..., dim]`` tensor fewer per norm, gradients unchanged bit for bit.


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned ``scale``, computed in float32.

    Args:
        dim: size of the last dimension of the input.
        eps: added to the mean square before the square root.
        recompute: when training, keep the input alone for the backward pass and recompute
            the normalised copy there (as every norm here does by default).

    Shapes: input ``[..., dim]``, output the same shape and dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5, recompute: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self._norm, x) if self.recompute else self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # The casts only where they convert: a no-op call still costs a dispatch, and a
        # decoding step runs two norms per layer.
        x_fp32 = x if x.dtype == torch.float32 else x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed if x.dtype == torch.float32 else normed.type_as(x)) * self.scale


class ZeroCenteredRMSNorm(nn.Module):
    """RMS norm whose learned ``scale`` is an offset from one: ``normed * (1 + scale)``, all
    in float32, then cast back (Qwen3.5, Qwen3-Next, Gemma). ``scale`` starts at zero, so a
    fresh norm is the identity scaling; weight decay pulls it towards one, not zero.

    Shapes: input ``[..., dim]``, output the same shape and dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6, recompute: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(dim))
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self._norm, x) if self.recompute else self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.scale.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMS norm of ``x`` times ``SiLU(gate)``: Gated DeltaNet's output norm, per head.

    The normed value is cast back to ``x``'s dtype before the (plain, one-initialised)
    ``scale``, and the gate applied in float32, as transformers' ``Qwen3_5RMSNormGated`` does,
    so that half-precision outputs round alike.

    Shapes: ``x`` and ``gate`` ``[..., dim]``, output the same shape and ``x``'s dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6, recompute: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))
        self.recompute = recompute

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return recomputed(self._norm, x, gate)
        return self._norm(x, gate)

    def _norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        scaled = self.scale * normed.to(x.dtype)
        return (scaled * F.silu(gate.float())).to(x.dtype)
