import torch
from torch import nn

from fusion.decoder.attention import MultiHeadAttention
from fusion.decoder.feed_forward import FeedForward
from fusion.decoder.gated_deltanet import GatedDeltaNet, TokenLayout
from fusion.decoder.packed import PackedSegments


class TransformerSelfAttentionLayer(nn.Module):
    """Pre-norm decoder block: ``h = x + attn(sa_norm(x)); out = h + mlp(mlp_norm(h))``.

    ``attn`` is the token mixer: attention, or in a hybrid stack a recurrent
    :class:`~fusion.decoder.GatedDeltaNet` (which the decoder gives its own form of the mask).
    The norms are any ``[..., d] -> [..., d]`` modules (RMSNorm, zero-centred RMSNorm).

    Shapes: input and output ``[b, s, d]``.
    """

    def __init__(
        self,
        attn: MultiHeadAttention | GatedDeltaNet,
        mlp: FeedForward,
        sa_norm: nn.Module,
        mlp_norm: nn.Module,
    ) -> None:
        super().__init__()
        self.sa_norm = sa_norm
        self.attn = attn
        self.mlp_norm = mlp_norm
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | PackedSegments | TokenLayout,
        input_pos: torch.Tensor,
    ) -> torch.Tensor:
        h = x + self.attn(self.sa_norm(x), mask=mask, input_pos=input_pos)
        return h + self.mlp(self.mlp_norm(h))
