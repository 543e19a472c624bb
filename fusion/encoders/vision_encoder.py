"""A small vision transformer whose projection head maps patches into a decoder's width."""

import torch
from torch import nn

from fusion._validation import describe
from fusion.early_fusion import register_fusion_module
from fusion.encoders.patch_embedding import PatchEmbedding
from fusion.encoders.vision_layer import VisionTransformerLayer


class VisionEncoder(nn.Module):
    """Patch embedding, ``num_layers`` transformer blocks, a final norm and a projection head.

    The head (``self.projection``, a linear map from ``dim`` to ``out_dim``) is registered with
    :func:`fusion.register_fusion_module`, so ``EarlyFusion(fusion_trainable=...)`` governs it.
    Each image becomes ``tokens_per_image`` rows, one per patch, row-major.

    Args:
        image_size: side of the square input images, a multiple of ``patch_size``.
        patch_size: side of a patch.
        dim: the encoder's width.
        num_layers: transformer blocks.
        num_heads: attention heads per block; must divide ``dim``.
        out_dim: the decoder's embedding width.
        in_channels: image channels.

    Raises:
        ValueError: a non-positive size, or sizes that do not divide as required.
    """

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
        self.patch_embedding = PatchEmbedding(image_size, patch_size, in_channels, dim)
        self.layers = nn.ModuleList(
            VisionTransformerLayer(dim, num_heads) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.projection = register_fusion_module(nn.Linear(dim, out_dim))

    @property
    def tokens_per_image(self) -> int:
        return self.patch_embedding.num_patches

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Encode images.

        Args:
            images: float [n, in_channels, image_size, image_size].

        Returns:
            packed rows [n, tokens_per_image, out_dim] in the projection's dtype, ready for
            :class:`fusion.EarlyFusion` (image ``i``'s rows fill the ``i``-th run of placeholders).

        Raises:
            ValueError: wrong shape or a non-floating dtype, before any computation.
        """
        size, channels = self.patch_embedding.image_size, self.patch_embedding.in_channels
        if (
            images.dim() != 4
            or images.shape[1:] != (channels, size, size)
            or (not images.dtype.is_floating_point)
        ):
            raise ValueError(
                f"images: expected floating images [n, {channels}, {size}, {size}], "
                f"got {describe(images)}"
            )
        x = self.patch_embedding(images.to(self.projection.weight.dtype))
        for layer in self.layers:
            x = layer(x)
        return self.projection(self.norm(x))
