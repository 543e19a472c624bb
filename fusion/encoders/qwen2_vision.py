"""Qwen2-VL's and Qwen2.5-VL's vision towers (patches -> merged rows of the decoder's width);
the module :mod:`fusion.encoders.qwen_vision` describes their inputs, outputs and parameter
names."""

from collections.abc import Sequence

import torch
from torch import nn

from fusion._validation import check_int, is_int
from fusion.encoders.qwen_vision_blocks import (
    PatchEmbed,
    PatchMerger,
    QwenVisionAttention,
    QwenVisionBlock,
    RMSNorm,
    SwiGLU,
)
from fusion.encoders.qwen_vision_plans import AttentionPlan, Grid, frame_plan, window_plan
from fusion.encoders.qwen_vision_tower import _heads, _QwenVisionTower
from fusion.encoders.vit_blocks import VisionMLP


class _PooledQwenVisionTower(_QwenVisionTower):
    """Qwen2-VL's and Qwen2.5-VL's forward: the merged rows alone."""

    merger: PatchMerger

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Patches of images concatenated -> their merged rows, images in order.

        Args:
            pixel_values: ``[n_patches, in_channels * temporal_patch_size * patch_size**2]``
                floating (the image processor's flattened patches); cast to the weights' dtype.
            image_grid_thw: ``[n_images, 3]`` integer, each image's (t, h, w) in patches; read
                on the host (keep it on the CPU). No image gives no row.

        Returns:
            ``[sum(t * h * w) / spatial_merge_size**2, out_dim]`` in the weights' dtype:
            transformers' ``pooler_output``.

        Raises:
            TypeError, ValueError: naming the argument, before any computation: patches of
                another shape or a non-floating dtype; a grid that is not an integer
                ``[n, 3]`` tensor, has a non-positive entry or an h or w that is not a multiple
                of ``spatial_merge_size``, or does not account for exactly ``n_patches``.
        """
        x, _ = self._hidden_states(pixel_values, image_grid_thw)
        return self.merger(x)


class Qwen2VisionTransformer(_PooledQwenVisionTower):
    """Qwen2-VL's vision tower: a patch embedding, ``depth`` LayerNorm blocks (every patch
    attends to its own frame) and a LayerNorm :class:`PatchMerger` to ``hidden_size``.

    Args:
        depth, embed_dim, hidden_size, mlp_ratio, num_heads, in_channels, patch_size,
        spatial_merge_size, temporal_patch_size, hidden_act: as in a Qwen2-VL vision config
            (``hidden_size`` is the merger's output width, the text decoder's width).
        rope_theta: the rotary base (the config's ``rope_parameters["rope_theta"]``).

    Attributes: the arguments, plus ``out_dim`` (= ``hidden_size``) and ``patch_dim`` (the
    width of a flattened patch).

    Raises:
        ValueError: a size that is not a positive integer, heads that do not divide
            ``embed_dim`` into multiples of 4, a non-positive ``mlp_ratio``, an unknown
            activation or ``rope_theta`` not above 1.
    """

    def __init__(
        self,
        *,
        depth: int,
        embed_dim: int,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float = 4,
        in_channels: int = 3,
        patch_size: int = 14,
        spatial_merge_size: int = 2,
        temporal_patch_size: int = 2,
        hidden_act: str = "quick_gelu",
        rope_theta: float = 10000.0,
    ) -> None:
        check_int(embed_dim, "embed_dim", low=1)
        check_int(hidden_size, "hidden_size", low=1)
        _heads("embed_dim", embed_dim, num_heads)
        check_int(depth, "depth", low=0)
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, int | float):
            raise ValueError(f"mlp_ratio: expected a positive number, got {mlp_ratio!r}")
        intermediate = int(embed_dim * mlp_ratio)
        if intermediate <= 0:
            raise ValueError(f"mlp_ratio: expected a positive number, got {mlp_ratio!r}")
        super().__init__(
            width=embed_dim,
            out_dim=hidden_size,
            num_heads=num_heads,
            in_channels=in_channels,
            patch_size=patch_size,
            spatial_merge_size=spatial_merge_size,
            temporal_patch_size=temporal_patch_size,
            hidden_act=hidden_act,
            rope_theta=rope_theta,
        )
        self.depth = depth
        self.embed_dim = embed_dim
        self.hidden_size = hidden_size
        self.mlp_ratio = mlp_ratio
        self.patch_embed = PatchEmbed(embed_dim, in_channels, patch_size, temporal_patch_size)
        self.blocks = nn.ModuleList(
            QwenVisionBlock(
                nn.LayerNorm(embed_dim, eps=1e-6),
                nn.LayerNorm(embed_dim, eps=1e-6),
                QwenVisionAttention(embed_dim, num_heads),
                VisionMLP(embed_dim, intermediate, hidden_act),
            )
            for _ in range(depth)
        )
        self.merger = PatchMerger(hidden_size, embed_dim, spatial_merge_size, norm="layer")


class Qwen25VisionTransformer(_PooledQwenVisionTower):
    """Qwen2.5-VL's vision tower: a patch embedding, ``depth`` RMSNorm SwiGLU blocks and an
    RMSNorm :class:`PatchMerger` to ``out_hidden_size``.

    Blocks in ``fullatt_block_indexes`` attend within each frame; the others within windows of
    ``window_size`` pixels square (``window_size // patch_size // spatial_merge_size`` merge
    blocks a side; smaller at a frame's bottom and right edges).

    Args:
        depth, hidden_size, intermediate_size, num_heads, in_channels, patch_size,
        spatial_merge_size, temporal_patch_size, window_size, fullatt_block_indexes,
        out_hidden_size, hidden_act: as in a Qwen2.5-VL vision config (``out_hidden_size`` is
            the text decoder's width).
        rope_theta: the rotary base (the config's ``rope_parameters["rope_theta"]``).

    Attributes: the arguments (``fullatt_block_indexes`` as a tuple), plus ``out_dim``
    (= ``out_hidden_size``), ``patch_dim`` and ``window_blocks`` (a window's side in merge
    blocks).

    Raises:
        ValueError: a size that is not a positive integer, heads that do not divide
            ``hidden_size`` into multiples of 4, a window smaller than one merge block
            (``patch_size * spatial_merge_size`` pixels), a full-attention index that is not a
            block's, an unknown activation or ``rope_theta`` not above 1.
    """

    def __init__(
        self,
        *,
        depth: int,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        out_hidden_size: int,
        in_channels: int = 3,
        patch_size: int = 14,
        spatial_merge_size: int = 2,
        temporal_patch_size: int = 2,
        window_size: int = 112,
        fullatt_block_indexes: Sequence[int] = (7, 15, 23, 31),
        hidden_act: str = "silu",
        rope_theta: float = 10000.0,
    ) -> None:
        check_int(hidden_size, "hidden_size", low=1)
        check_int(intermediate_size, "intermediate_size", low=1)
        check_int(out_hidden_size, "out_hidden_size", low=1)
        _heads("hidden_size", hidden_size, num_heads)
        check_int(depth, "depth", low=0)
        check_int(window_size, "window_size", low=1)
        check_int(patch_size, "patch_size", low=1)
        check_int(spatial_merge_size, "spatial_merge_size", low=1)
        window_blocks = window_size // spatial_merge_size // patch_size
        if window_blocks < 1:
            raise ValueError(
                f"window_size: expected at least patch_size * spatial_merge_size = "
                f"{patch_size * spatial_merge_size} pixels, got {window_size}"
            )
        full = tuple(fullatt_block_indexes)
        for index in full:
            if not is_int(index, 0, depth - 1):
                raise ValueError(
                    f"fullatt_block_indexes: expected block indices in [0, depth={depth}), got "
                    f"{list(full)}"
                )
        super().__init__(
            width=hidden_size,
            out_dim=out_hidden_size,
            num_heads=num_heads,
            in_channels=in_channels,
            patch_size=patch_size,
            spatial_merge_size=spatial_merge_size,
            temporal_patch_size=temporal_patch_size,
            hidden_act=hidden_act,
            rope_theta=rope_theta,
        )
        self.depth = depth
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.out_hidden_size = out_hidden_size
        self.window_size = window_size
        self.window_blocks = window_blocks
        self.fullatt_block_indexes = full
        self.patch_embed = PatchEmbed(hidden_size, in_channels, patch_size, temporal_patch_size)
        self.blocks = nn.ModuleList(
            QwenVisionBlock(
                RMSNorm(hidden_size),
                RMSNorm(hidden_size),
                QwenVisionAttention(hidden_size, num_heads),
                SwiGLU(hidden_size, intermediate_size, hidden_act),
            )
            for _ in range(depth)
        )
        self.merger = PatchMerger(out_hidden_size, hidden_size, spatial_merge_size, norm="rms")

    def _plans(self, grid: Grid) -> list[AttentionPlan]:
        full = frame_plan(grid)
        windows = window_plan(grid, self.spatial_merge_size, self.window_blocks)
        return [full if i in self.fullatt_block_indexes else windows for i in range(self.depth)]
