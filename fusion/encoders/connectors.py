"""Connectors: what maps a vision tower's patch features to a text decoder's width.

Parameter names follow the checkpoints (LLaVA's ``multi_modal_projector.linear_1``, Idefics3's
``connector.modality_projection.proj``), so they load by prefix alone.
"""

import math

import torch
from torch import nn

from fusion._validation import check_int
from fusion.encoders.vit_blocks import Activation


class LlavaProjector(nn.Module):
    """LLaVA's two-layer MLP: ``linear_2(act(linear_1(features)))``.

    Args:
        in_features: the vision width times the number of feature layers concatenated.
        out_features: the text decoder's width.
        hidden_act: the activation's config name (``projector_hidden_act``).
        bias: whether both linear maps have a bias (``multimodal_projector_bias``).

    Raises:
        ValueError: a width that is not a positive integer, or an unknown activation.
    """

    def __init__(
        self, in_features: int, out_features: int, hidden_act: str = "gelu", bias: bool = True
    ) -> None:
        super().__init__()
        check_int(in_features, "in_features", low=1)
        check_int(out_features, "out_features", low=1)
        self.linear_1 = nn.Linear(in_features, out_features, bias=bias)
        self.act = Activation(hidden_act)
        self.linear_2 = nn.Linear(out_features, out_features, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[..., in_features] -> [..., out_features]."""
        return self.linear_2(self.act(self.linear_1(features)))


class _ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def pixel_shuffle(features: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """Fold each ``scale_factor`` x ``scale_factor`` block of a square patch grid into one row.

    [n, side * side, d] (row-major grid) -> [n, (side / s)**2, d * s * s]: one output row per
    block, blocks in row-major order, each row the block's ``s * s`` patches concatenated in
    row-major order. This is the order of Idefics3's connector, so its weights apply.

    Raises:
        ValueError: the patches do not form a square grid whose side ``scale_factor`` divides.
    """
    n, seq, d = features.shape
    side = math.isqrt(seq)
    s = scale_factor
    if side * side != seq or side % s:
        raise ValueError(
            f"features: expected a square grid of patches whose side is a multiple of "
            f"scale_factor={s}, got {seq} patches"
        )
    # Merge s horizontally adjacent patches, then s vertically adjacent merged groups.
    x = features.reshape(n, side, side // s, d * s)  # [n, row, column block, s * d]
    x = x.transpose(1, 2).reshape(n, side // s, side // s, d * s * s)  # [n, col blk, row blk]
    return x.transpose(1, 2).reshape(n, seq // (s * s), d * s * s)


class Idefics3Connector(nn.Module):
    """Idefics3's connector: :func:`pixel_shuffle` by ``scale_factor``, then a bias-free linear
    map (``modality_projection.proj``) to the decoder's width.

    Args:
        vision_hidden_size: the vision tower's width.
        text_hidden_size: the decoder's width.
        scale_factor: the side of the square of patches folded into one row.

    Raises:
        ValueError: a size that is not a positive integer.
    """

    def __init__(
        self, vision_hidden_size: int, text_hidden_size: int, scale_factor: int = 2
    ) -> None:
        super().__init__()
        check_int(vision_hidden_size, "vision_hidden_size", low=1)
        check_int(text_hidden_size, "text_hidden_size", low=1)
        self.scale_factor = check_int(scale_factor, "scale_factor", low=1)
        self.modality_projection = _ModalityProjection(
            vision_hidden_size * scale_factor**2, text_hidden_size
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[n, side * side, vision width] -> [n, (side / scale_factor)**2, text width]."""
        return self.modality_projection(pixel_shuffle(features, self.scale_factor))
