"""One pre-norm vision transformer block: bidirectional self-attention and a GELU MLP."""

import torch
import torch.nn.functional as F
from torch import nn


class VisionTransformerLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``; every patch attends to every patch.

    Args:
        dim: width.
        num_heads: attention heads; must divide ``dim``.
        mlp_ratio: hidden width of the MLP as a multiple of ``dim``.

    Raises:
        ValueError: ``num_heads`` does not divide ``dim``.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        if num_heads <= 0 or dim % num_heads:
            raise ValueError(f"num_heads: expected a divisor of dim={dim}, got {num_heads}")
        self.num_heads = num_heads
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, p, dim] -> [n, p, dim]."""
        n, p, dim = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(n, p, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [n, heads, p, head_dim]
        attended = F.scaled_dot_product_attention(q, k, v)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(n, p, dim))
        return x + self.mlp(self.mlp_norm(x))
