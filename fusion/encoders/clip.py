"""CLIP's vision transformer (the vision tower of LLaVA), in plain PyTorch.

Parameter names are those of CLIP vision checkpoints without their ``vision_model.`` prefix
(``embeddings.class_embedding``, ``pre_layrnorm.weight``, ``encoder.layers.{i}...``,
``post_layernorm.weight``), so such checkpoints load by prefix alone.
"""

from collections.abc import Sequence

import torch
from torch import nn

from fusion._validation import is_int
from fusion.encoders.vit_blocks import VisionTower, check_pixels


class ClipVisionEmbeddings(nn.Module):
    """Patches (a bias-free convolution) after a learned class token, plus learned positions."""

    def __init__(
        self, hidden_size: int, image_size: int, patch_size: int, num_channels: int
    ) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.randn(hidden_size))
        self.patch_embedding = nn.Conv2d(
            num_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=False
        )
        self.num_patches = (image_size // patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches + 1, hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, c, s, s] -> [n, 1 + num_patches, d], the class token first."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.size(0), 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipVisionTransformer(VisionTower):
    """CLIP's vision transformer: embeddings, ``pre_layrnorm``, the encoder layers and
    ``post_layernorm`` (which only CLIP's pooled output uses; kept so checkpoints round-trip).

    Hidden states are numbered as Hugging Face numbers them: 0 is the input of the first layer
    (the embeddings after ``pre_layrnorm``), ``i`` the output of layer ``i``; negative numbers
    count from the end (``-1`` is the last layer's output, ``-2`` LLaVA's default).

    Args:
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, image_size,
        patch_size, num_channels, hidden_act, layer_norm_eps: as in a CLIP vision config.
        chunk_rows: the positions the tower runs at a time (see
            :class:`~fusion.encoders.vit_blocks.VisionTower`; None: all images at once).

    Raises:
        ValueError: a size that is not a positive integer, ``image_size`` not a multiple of
            ``patch_size``, heads that do not divide ``hidden_size``, an unknown activation,
            an ``layer_norm_eps`` outside (0, 1), or ``chunk_rows`` neither None nor a
            positive int.
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
        hidden_act: str = "quick_gelu",
        layer_norm_eps: float = 1e-5,
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
        self.embeddings = ClipVisionEmbeddings(hidden_size, image_size, patch_size, num_channels)
        self.pre_layrnorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.encoder = self.layer_stack()
        self.post_layernorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)

    def resolve_layer(self, layer: int) -> int:
        """Hidden-state number ``layer`` (negative counts from the end) in ``[0, num_layers]``.

        Raises:
            ValueError: not an int, or outside ``[-(num_layers + 1), num_layers]``.
        """
        count = self.num_layers + 1
        if not is_int(layer) or not -count <= layer < count:
            raise ValueError(
                f"vision_feature_layer: expected an int in [{-count}, {count - 1}] (hidden "
                f"states of a {self.num_layers}-layer tower), got {layer!r}"
            )
        return layer % count

    def hidden_states(
        self, pixel_values: torch.Tensor, layers: Sequence[int]
    ) -> list[torch.Tensor]:
        """The hidden states numbered ``layers`` (see the class), each [n, 1 + num_patches, d];
        the layers after the last one asked for are not run.

        Raises:
            TypeError, ValueError: ``pixel_values`` not floating [n, num_channels, image_size,
                image_size]; a layer number out of range.
        """
        check_pixels(pixel_values, self.num_channels, self.image_size)
        wanted = [self.resolve_layer(layer) for layer in layers]
        chunks = self.image_chunks(pixel_values, 1 + self.num_patches)
        per_chunk = [self._hidden_states(chunk, wanted) for chunk in chunks]
        if len(per_chunk) == 1:
            return per_chunk[0]
        return [torch.cat(states) for states in zip(*per_chunk, strict=True)]

    def _hidden_states(self, pixel_values: torch.Tensor, wanted: list[int]) -> list[torch.Tensor]:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers[: max(wanted, default=0)]:
            x = layer(x)
            states.append(x)
        return [states[i] for i in wanted]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The last layer's output [n, 1 + num_patches, d] (before ``post_layernorm``, as
        Hugging Face's ``last_hidden_state``)."""
        return self.hidden_states(pixel_values, [-1])[0]
