"""The captioner's small vision transformer; not the library's CLIP / SigLIP towers
(:mod:`fusion.encoders.vit_blocks`): its fused ``qkv`` projections make its checkpoint keys and
initialisation (hence the trained results) its own."""

import torch
import torch.nn.functional as F
from torch import nn

from fusion import register_fusion_module
from fusion.encoders.vit_blocks import check_pixels


class PatchEmbedding(nn.Module):
    """Each ``patch_size`` square of an image embedded in ``dim``, plus learned positions."""

    def __init__(self, image_size: int, patch_size: int, in_channels: int, dim: int) -> None:
        super().__init__()
        self.image_size = image_size
        self.num_patches = (image_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.pos_embedding = nn.Parameter(torch.randn(self.num_patches, dim) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images [n, c, h, w] -> patch embeddings [n, num_patches, dim], row-major order."""
        # [n, dim, h / p, w / p] -> [n, dim, num_patches] -> [n, num_patches, dim]
        patches = self.proj(images).flatten(2).transpose(1, 2)
        return patches + self.pos_embedding


class VisionTransformerLayer(nn.Module):
    """``x + attn(norm(x))``, every patch attending to every patch, then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
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
        # [n, p, 3 * dim] -> [n, p, 3, heads, head_dim]
        qkv = self.qkv(self.attn_norm(x)).view(n, p, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [n, heads, p, head_dim]
        attended = F.scaled_dot_product_attention(q, k, v)
        # [n, heads, p, head_dim] -> [n, p, heads, head_dim] -> [n, p, dim]
        x = x + self.attn_out(attended.transpose(1, 2).reshape(n, p, dim))
        return x + self.mlp(self.mlp_norm(x))


class VisionEncoder(nn.Module):
    """Patch embedding, ``num_layers`` pre-norm blocks of width ``dim``, a final norm and a
    projection head to the decoder's width ``out_dim`` (a fusion module:
    ``EarlyFusion(fusion_trainable=...)`` governs it); each image becomes ``tokens_per_image``
    rows, one per patch, row-major. Sizes that do not fit are a ``ValueError``."""

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        dim: int,
        num_layers: int,
        num_heads: int,
        out_dim: int,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("out_dim", out_dim), ("in_channels", in_channels)):
            if value <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {value}")
        if num_layers < 0:
            raise ValueError(f"num_layers: expected a non-negative integer, got {num_layers}")
        if patch_size <= 0 or image_size <= 0 or image_size % patch_size:
            raise ValueError(
                f"image_size: expected a positive multiple of patch_size={patch_size}, "
                f"got {image_size}"
            )
        if num_heads <= 0 or dim % num_heads:
            raise ValueError(f"num_heads: expected a divisor of dim={dim}, got {num_heads}")
        self.in_channels = in_channels
        # Each pixel's channels, its difference from the image's background, and the size of
        # that difference (see forward).
        self.patch_embedding = PatchEmbedding(image_size, patch_size, 2 * in_channels + 1, dim)
        self.layers = nn.ModuleList(
            VisionTransformerLayer(dim, num_heads) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.projection = nn.Linear(dim, out_dim)
        register_fusion_module(self.projection)

    @property
    def tokens_per_image(self) -> int:
        return self.patch_embedding.num_patches

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Floating images [n, in_channels, image_size, image_size] (else a ``ValueError``) ->
        rows [n, tokens_per_image, out_dim] in the projection's dtype."""
        check_pixels(images, self.in_channels, self.patch_embedding.image_size, "images")
        images = images.to(self.projection.weight.dtype)
        # The background, whatever its colour, is most of the image: its per-channel median.
        # The size of the difference from it is the shape's silhouette alike on black, white
        # or any colour, which a linear patch embedding cannot compute from the pixels.
        background = images.flatten(2).median(dim=2).values[:, :, None, None]  # [n, c, 1, 1]
        difference = images - background
        contrast = difference.norm(dim=1, keepdim=True)  # [n, 1, h, w]
        x = self.patch_embedding(torch.cat([images, difference, contrast], dim=1))
        for layer in self.layers:
            x = layer(x)
        return self.projection(self.norm(x))
