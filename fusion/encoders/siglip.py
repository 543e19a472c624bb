"""SigLIP's vision transformer (the vision tower of Idefics3 and SmolVLM), in plain PyTorch.

Parameter names are those of SigLIP / Idefics3 vision checkpoints without their
``vision_model.`` prefix (``embeddings.patch_embedding.weight``, ``encoder.layers.{i}...``,
``post_layernorm.weight``), so such checkpoints load by prefix alone. SigLIP's attention-pooling
head, which vision-language models do not use, is not part of this module.
"""

import torch
from torch import nn

from fusion.encoders.vit_blocks import VisionTower, check_pixels

POSITION_SCHEMES = ("fixed", "bucketed")


def bucketed_position_ids(patches_per_side: int, rows: int, cols: int) -> torch.Tensor:
    """Position ids [rows * cols] of a ``rows`` x ``cols`` patch grid, as Idefics3 assigns them
    (each patch's fractional coordinates bucketed into the ``patches_per_side`` square grid the
    position table was trained on), computed with the same float32 operations so that the
    ids agree even where float rounding makes them differ from ``arange`` (e.g. 25 patches per
    side)."""
    side = patches_per_side
    boundaries = torch.arange(1 / side, 1.0, 1 / side, dtype=torch.float32)

    def buckets(count: int) -> torch.Tensor:
        step = 1.0 / torch.tensor([count])  # float32, as the reference divides a long count
        fractions = torch.arange(count, dtype=torch.float32)[None, :] * step[:, None]
        fractions = torch.clamp(fractions, max=1.0 - 1e-6)
        return torch.bucketize(fractions, boundaries, right=True)[0]

    return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).reshape(-1)


class SiglipVisionEmbeddings(nn.Module):
    """Patches (a convolution with bias) plus learned positions (no class token).

    ``position_scheme="fixed"``: patch ``i`` gets position ``i`` (SigLIP).
    ``"bucketed"``: positions from :func:`bucketed_position_ids` (Idefics3, SmolVLM).
    """

    def __init__(
        self,
        hidden_size: int,
        image_size: int,
        patch_size: int,
        num_channels: int,
        position_scheme: str = "fixed",
    ) -> None:
        super().__init__()
        if position_scheme not in POSITION_SCHEMES:
            raise ValueError(
                f"position_scheme: expected one of {list(POSITION_SCHEMES)}, "
                f"got {position_scheme!r}"
            )
        self.position_scheme = position_scheme
        self.patches_per_side = image_size // patch_size
        self.num_patches = self.patches_per_side**2
        self.patch_embedding = nn.Conv2d(
            num_channels, hidden_size, kernel_size=patch_size, stride=patch_size
        )
        self.position_embedding = nn.Embedding(self.num_patches, hidden_size)

    def position_ids(self, device: torch.device) -> torch.Tensor:
        side = self.patches_per_side
        if self.position_scheme == "fixed":
            return torch.arange(self.num_patches, device=device)
        return bucketed_position_ids(side, side, side).to(device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, c, s, s] -> [n, num_patches, d]."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        return patches + self.position_embedding(self.position_ids(patches.device))


class SiglipVisionTransformer(VisionTower):
    """SigLIP's vision transformer: embeddings, the encoder layers and ``post_layernorm``.

    Args:
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, image_size,
        patch_size, num_channels, hidden_act, layer_norm_eps: as in a SigLIP (or Idefics3
            vision) config.
        position_scheme: ``"fixed"`` (SigLIP) or ``"bucketed"`` (Idefics3); see
            :class:`SiglipVisionEmbeddings`.
        chunk_rows: the positions the tower runs at a time (see
            :class:`~fusion.encoders.vit_blocks.VisionTower`; None: all images at once).

    Raises:
        ValueError: a size that is not a positive integer, ``image_size`` not a multiple of
            ``patch_size``, heads that do not divide ``hidden_size``, an unknown activation,
            ``layer_norm_eps`` outside (0, 1), an unknown position scheme or ``chunk_rows``
            neither None nor a positive int.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_hidden_layers: int,
        num_attention_heads: int,
        image_size: int,
        patch_size: int,
        num_channels: int = 3,
        hidden_act: str = "gelu_pytorch_tanh",
        layer_norm_eps: float = 1e-6,
        position_scheme: str = "fixed",
        chunk_rows: int | None = 1024,
    ) -> None:
        super().__init__(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            image_size=image_size,
            patch_size=patch_size,
            num_channels=num_channels,
            hidden_act=hidden_act,
            layer_norm_eps=layer_norm_eps,
            chunk_rows=chunk_rows,
        )
        self.embeddings = SiglipVisionEmbeddings(
            hidden_size, image_size, patch_size, num_channels, position_scheme
        )
        self.encoder = self.layer_stack()
        self.post_layernorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images [n, num_channels, image_size, image_size] -> ``post_layernorm`` of the last
        layer's output [n, num_patches, d], patches in row-major order.

        Raises:
            TypeError, ValueError: ``pixel_values`` of another type, shape or a non-floating
                dtype, before any computation.
        """
        check_pixels(pixel_values, self.num_channels, self.image_size)
        chunks = [
            self._encode(chunk) for chunk in self.image_chunks(pixel_values, self.num_patches)
        ]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
