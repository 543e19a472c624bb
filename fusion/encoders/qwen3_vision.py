"""Qwen3-VL's vision tower (patches -> merged rows of the decoder's width, and DeepStack rows
of the same shape from intermediate blocks); the module :mod:`fusion.encoders.qwen_vision`
describes its inputs, outputs and parameter names."""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fusion._validation import check_int, is_int
from fusion.encoders.qwen_vision_blocks import (
    PatchEmbed,
    Qwen3PatchMerger,
    Qwen3VisionMLP,
    QwenVisionAttention,
    QwenVisionBlock,
)
from fusion.encoders.qwen_vision_plans import Grid, bilinear_taps
from fusion.encoders.qwen_vision_tower import _heads, _QwenVisionTower


class Qwen3VisionTransformer(_QwenVisionTower):
    """Qwen3-VL's vision tower: a biased patch embedding plus a learned position table resampled
    to each image's grid, ``depth`` LayerNorm blocks (every patch attends to its own frame), a
    :class:`Qwen3PatchMerger` to ``out_hidden_size``, and one more merger per DeepStack layer.

    The position table ``pos_embed`` (``num_position_embeddings`` = side x side rows) is
    interpolated bilinearly (``align_corners=True``) to each frame's (h, w) patches, in the
    tower's merge-block order (:func:`bilinear_taps`), in float32 and cast to the patches'
    dtype, and added to the patch embedding. After block ``deepstack_visual_indexes[j]`` the
    hidden states also go through ``deepstack_merger_list[j]`` (norm after the 2 x 2
    concatenation): rows the decoder adds to its hidden states after its layer ``j``.

    Args:
        depth, hidden_size, hidden_act, intermediate_size, num_heads, in_channels, patch_size,
            spatial_merge_size, temporal_patch_size, out_hidden_size, num_position_embeddings,
            deepstack_visual_indexes: as in a Qwen3-VL vision config (``out_hidden_size`` is the
            text decoder's width).
        rope_theta: the rotary base (the config's ``rope_parameters["rope_theta"]``).

    Attributes: the arguments (``deepstack_visual_indexes`` as a tuple), plus ``out_dim``
    (= ``out_hidden_size``), ``patch_dim``, ``num_grid_per_side`` (the position table's side)
    and ``deepstack_layers`` (the number of DeepStack mergers).

    Raises:
        ValueError: a size that is not a positive integer, heads that do not divide
            ``hidden_size`` into multiples of 4, a ``num_position_embeddings`` that is not a
            square, DeepStack indices that are not increasing block indices, an unknown
            activation or ``rope_theta`` not above 1.
    """

    def __init__(
        self,
        *,
        depth: int,
        hidden_size: int,
        hidden_act: str = "gelu_pytorch_tanh",
        intermediate_size: int,
        num_heads: int,
        in_channels: int = 3,
        patch_size: int = 16,
        spatial_merge_size: int = 2,
        temporal_patch_size: int = 2,
        out_hidden_size: int,
        num_position_embeddings: int = 2304,
        deepstack_visual_indexes: Sequence[int] = (8, 16, 24),
        rope_theta: float = 10000.0,
    ) -> None:
        check_int(hidden_size, "hidden_size", low=1)
        check_int(intermediate_size, "intermediate_size", low=1)
        check_int(out_hidden_size, "out_hidden_size", low=1)
        _heads("hidden_size", hidden_size, num_heads)
        check_int(depth, "depth", low=0)
        check_int(num_position_embeddings, "num_position_embeddings", low=1)
        side = math.isqrt(num_position_embeddings)
        if side * side != num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings: expected a square (the side of the position table "
                f"squared), got {num_position_embeddings}"
            )
        deepstack = tuple(deepstack_visual_indexes)
        if any(not is_int(index, 0, depth - 1) for index in deepstack) or list(deepstack) != sorted(
            set(deepstack)
        ):
            raise ValueError(
                f"deepstack_visual_indexes: expected increasing block indices in [0, "
                f"depth={depth}), got {list(deepstack)}"
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
        self.num_position_embeddings = num_position_embeddings
        self.num_grid_per_side = side
        self.deepstack_visual_indexes = deepstack
        self.deepstack_layers = len(deepstack)
        # Registered in the checkpoints' order.
        self.patch_embed = PatchEmbed(
            hidden_size, in_channels, patch_size, temporal_patch_size, bias=True
        )
        self.pos_embed = nn.Embedding(num_position_embeddings, hidden_size)
        self.blocks = nn.ModuleList(
            QwenVisionBlock(
                nn.LayerNorm(hidden_size, eps=1e-6),
                nn.LayerNorm(hidden_size, eps=1e-6),
                QwenVisionAttention(hidden_size, num_heads),
                Qwen3VisionMLP(hidden_size, intermediate_size, hidden_act),
            )
            for _ in range(depth)
        )
        self.merger = Qwen3PatchMerger(
            out_hidden_size, hidden_size, spatial_merge_size, postshuffle_norm=False
        )
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(
                out_hidden_size, hidden_size, spatial_merge_size, postshuffle_norm=True
            )
            for _ in deepstack
        )

    def _embed(self, pixel_values: torch.Tensor, grid: Grid) -> torch.Tensor:
        x = self.patch_embed(pixel_values)
        taps, weights = bilinear_taps(grid, self.spatial_merge_size, self.num_grid_per_side)
        table = self.pos_embed.weight
        # In float32 whatever the table's dtype (transformers' float32 weights promote it).
        positions = F.embedding_bag(
            taps.to(table.device),
            table.float(),
            per_sample_weights=weights.to(table.device),
            mode="sum",
        )
        return x + positions.to(x.dtype)

    def forward(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Patches of images concatenated -> their merged rows and DeepStack rows, images in
        order.

        Args:
            pixel_values: ``[n_patches, in_channels * temporal_patch_size * patch_size**2]``
                floating (the image processor's flattened patches); cast to the weights' dtype.
            image_grid_thw: ``[n_images, 3]`` integer, each image's (t, h, w) in patches; read
                on the host (keep it on the CPU). No image gives no row.

        Returns:
            The rows ``[sum(t * h * w) / spatial_merge_size**2, out_dim]`` (transformers'
            ``pooler_output``) and a tuple of ``deepstack_layers`` tensors of that shape, in
            ``deepstack_visual_indexes`` order (transformers' ``deepstack_features``), all in
            the weights' dtype.

        Raises:
            TypeError, ValueError: as :class:`Qwen2VisionTransformer`'s forward, before any
                computation.
        """
        x, kept = self._hidden_states(pixel_values, image_grid_thw, self.deepstack_visual_indexes)
        deepstack = tuple(
            merger(hidden) for merger, hidden in zip(self.deepstack_merger_list, kept, strict=True)
        )
        return self.merger(x), deepstack


class Qwen35VisionTransformer(Qwen3VisionTransformer):
    """Qwen3.5's vision tower: Qwen3-VL's with no DeepStack (transformers'
    ``Qwen3_5VisionModel``), so its forward returns the merged rows alone.

    Args: as :class:`Qwen3VisionTransformer`'s, without ``deepstack_visual_indexes``.
    """

    def __init__(
        self,
        *,
        depth: int,
        hidden_size: int,
        hidden_act: str = "gelu_pytorch_tanh",
        intermediate_size: int,
        num_heads: int,
        in_channels: int = 3,
        patch_size: int = 16,
        spatial_merge_size: int = 2,
        temporal_patch_size: int = 2,
        out_hidden_size: int,
        num_position_embeddings: int = 2304,
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__(
            depth=depth,
            hidden_size=hidden_size,
            hidden_act=hidden_act,
            intermediate_size=intermediate_size,
            num_heads=num_heads,
            in_channels=in_channels,
            patch_size=patch_size,
            spatial_merge_size=spatial_merge_size,
            temporal_patch_size=temporal_patch_size,
            out_hidden_size=out_hidden_size,
            num_position_embeddings=num_position_embeddings,
            deepstack_visual_indexes=(),
            rope_theta=rope_theta,
        )

    def forward(  # type: ignore[override]
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> torch.Tensor:
        """Patches of images concatenated -> their merged rows ``[n_rows, out_dim]``, as
        :class:`Qwen3VisionTransformer`'s forward without the DeepStack rows."""
        rows, _ = super().forward(pixel_values, image_grid_thw)
        return rows
