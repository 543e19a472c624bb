import torch
from torch import nn

from fusion.decoder.attention import MultiHeadAttention
from fusion.decoder.feed_forward import FeedForward
from fusion.decoder.packed import PackedSegments
from fusion.decoder.rms_norm import RMSNorm


class TransformerSelfAttentionLayer(nn.Module):
    """Pre-norm decoder block: ``h = x + attn(sa_norm(x)); out = h + mlp(mlp_norm(h))``.

    Shapes: input and output ``[b, s, d]``.
    """

    def __init__(
        self, attn: MultiHeadAttention, mlp: FeedForward, sa_norm: RMSNorm, mlp_norm: RMSNorm
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
        mask: torch.Tensor | PackedSegments | None,
        input_pos: torch.Tensor,
    ) -> torch.Tensor:
        h = x + self.attn(self.sa_norm(x), mask=mask, input_pos=input_pos)
        return h + self.mlp(self.mlp_norm(h))
