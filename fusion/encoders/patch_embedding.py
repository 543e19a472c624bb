"""Patch embedding: non-overlapping image patches projected to vectors, plus learned positions."""

import torch
from torch import nn


class PatchEmbedding(nn.Module):
    """Split images into ``patch_size`` squares and embed each one.

    Args:
        image_size: side of the square input images, a multiple of ``patch_size``.
        patch_size: side of a patch.
        in_channels: image channels.
        dim: embedding width.

    Raises:
        ValueError: ``image_size`` is not a positive multiple of ``patch_size``.
    """

    def __init__(self, image_size: int, patch_size: int, in_channels: int, dim: int) -> None:
        super().__init__()
        if patch_size <= 0 or image_size <= 0 or image_size % patch_size:
            raise ValueError(
                f"image_size: expected a positive multiple of patch_size={patch_size}, "
                f"got {image_size}"
            )
        self.image_size = image_size
        self.in_channels = in_channels
        self.num_patches = (image_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.pos_embedding = nn.Parameter(torch.randn(self.num_patches, dim) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images [n, c, h, w] -> patch embeddings [n, num_patches, dim], row-major order."""
        patches = self.proj(images).flatten(2).transpose(1, 2)
        return patches + self.pos_embedding
