import torch
from torch import nn

from fusion.decoder.attention import MultiHeadAttention
from fusion.decoder.feed_forward import FeedForward
from fusion.decoder.gated_deltanet import GatedDeltaNet, TokenLayout
from fusion.decoder.packed import PackedSegments


class TransformerSelfAttentionLayer(nn.Module):
    """Pre-norm decoder block: ``h = x + sa_scale(attn(sa_norm(x)));
    out = h + mlp_scale(mlp(mlp_norm(h)))``.

    ``attn`` is the token mixer: attention, or in a hybrid stack a recurrent
    :class:`~fusion.decoder.GatedDeltaNet` (which the decoder gives its own form of the mask).
    The norms are any ``[..., d] -> [..., d]`` modules (RMSNorm, zero-centred RMSNorm).
    ``sa_scale`` and ``mlp_scale`` (torchtune's names) act on the mixer's and the MLP's outputs
    before the residual sums: Gemma's post-attention and post-feedforward norms; None (the
    default, no keys) leaves the outputs as they are.

    Shapes: input and output ``[b, s, d]``.
    """

    def __init__(
        self,
        attn: MultiHeadAttention | GatedDeltaNet,
        mlp: FeedForward,
        sa_norm: nn.Module,
        mlp_norm: nn.Module,
        *,
        sa_scale: nn.Module | None = None,
        mlp_scale: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.sa_norm = sa_norm
        self.attn = attn
        self.mlp_norm = mlp_norm
        self.mlp = mlp
        self.sa_scale = sa_scale
        self.mlp_scale = mlp_scale

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | PackedSegments | TokenLayout | None,
        input_pos: torch.Tensor,
    ) -> torch.Tensor:
        attended = self.attn(self.sa_norm(x), mask=mask, input_pos=input_pos)
        h = x + (attended if self.sa_scale is None else self.sa_scale(attended))
        out = self.mlp(self.mlp_norm(h))
        return h + (out if self.mlp_scale is None else self.mlp_scale(out))
