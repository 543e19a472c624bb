"""What Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision towers share (:class:`_QwenVisionTower`):
the argument checks, the input checks and the run of the patches through the blocks.

The grid is read on the host, and the attention plans built from it are copied to the patches'
device once per forward, not once per block. The rotary frequencies are computed in each
forward, not kept in a buffer: nothing is in the state dict that the checkpoints lack, and a
tower built on the meta device and materialised with ``to_empty`` needs no re-initialisation.
"""

from collections.abc import Sequence

import torch
from torch import nn

from fusion._validation import check_int
from fusion.encoders.qwen_vision_blocks import PatchEmbed, rotary_angles
from fusion.encoders.qwen_vision_plans import (
    AttentionPlan,
    Grid,
    frame_plan,
    merge_block_positions,
)
from fusion.encoders.vit_blocks import Activation


def _heads(width_name: str, width: int, num_heads: int) -> int:
    """The head width, checked: rotary angles come in (h, w) pairs of sin/cos halves, so it must
    be a multiple of 4."""
    check_int(num_heads, "num_heads", low=1)
    if width % num_heads or (width // num_heads) % 4:
        raise ValueError(
            f"num_heads: expected a divisor of {width_name}={width} leaving a head width that "
            f"is a multiple of 4, got {num_heads}"
        )
    return width // num_heads


class _QwenVisionTower(nn.Module):
    """What the towers share: the config, the input checks, and the run through the blocks."""

    patch_embed: PatchEmbed
    blocks: nn.ModuleList

    def __init__(
        self,
        *,
        width: int,
        out_dim: int,
        num_heads: int,
        in_channels: int,
        patch_size: int,
        spatial_merge_size: int,
        temporal_patch_size: int,
        hidden_act: str,
        rope_theta: float,
    ) -> None:
        super().__init__()
        self.in_channels = check_int(in_channels, "in_channels", low=1)
        self.patch_size = check_int(patch_size, "patch_size", low=1)
        self.spatial_merge_size = check_int(spatial_merge_size, "spatial_merge_size", low=1)
        self.temporal_patch_size = check_int(temporal_patch_size, "temporal_patch_size", low=1)
        self.num_heads = num_heads
        self.out_dim = check_int(out_dim, "out_dim", low=1)
        Activation(hidden_act)  # refuses an unknown name before anything is built
        self.hidden_act = hidden_act
        if (
            isinstance(rope_theta, bool)
            or not isinstance(rope_theta, int | float)
            or rope_theta <= 1
        ):
            raise ValueError(f"rope_theta: expected a number above 1, got {rope_theta!r}")
        self.rope_theta = float(rope_theta)
        self.patch_dim = in_channels * temporal_patch_size * patch_size**2
        self._width = width
        self._head_dim = width // num_heads

    def rows_per_image(self, image_grid_thw: torch.Tensor) -> list[int]:
        """Output rows of each image: ``t * h * w / spatial_merge_size**2``.

        Raises:
            TypeError, ValueError: as :meth:`forward`, for the grid.
        """
        return [t * h * w // self.spatial_merge_size**2 for t, h, w in self._grid(image_grid_thw)]

    def _grid(self, image_grid_thw: object) -> Grid:
        """The checked grid as Python integers (read on the host)."""
        name = "image_grid_thw"
        if not isinstance(image_grid_thw, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(image_grid_thw).__name__}")
        dtype = image_grid_thw.dtype
        if (
            image_grid_thw.dim() != 2
            or image_grid_thw.shape[1] != 3
            or dtype.is_floating_point
            or dtype.is_complex
            or dtype == torch.bool
        ):
            raise ValueError(
                f"{name}: expected an integer tensor [n_images, 3] of (t, h, w) in patches, got "
                f"shape {list(image_grid_thw.shape)}, dtype {dtype}"
            )
        grid: Grid = [(int(t), int(h), int(w)) for t, h, w in image_grid_thw.tolist()]
        m = self.spatial_merge_size
        for i, (t, h, w) in enumerate(grid):
            if min(t, h, w) <= 0:
                raise ValueError(f"{name}: expected positive entries, got row {i} = {[t, h, w]}")
            if h % m or w % m:
                raise ValueError(
                    f"{name}: expected h and w multiples of spatial_merge_size={m}, got row {i} "
                    f"= {[t, h, w]}"
                )
        return grid

    def _check(self, pixel_values: object, image_grid_thw: object) -> Grid:
        name = "pixel_values"
        if not isinstance(pixel_values, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(pixel_values).__name__}")
        if (
            pixel_values.dim() != 2
            or pixel_values.shape[1] != self.patch_dim
            or not pixel_values.is_floating_point()
        ):
            raise ValueError(
                f"{name}: expected floating patches [n_patches, {self.patch_dim}] (in_channels "
                f"* temporal_patch_size * patch_size**2), got shape {list(pixel_values.shape)}, "
                f"dtype {pixel_values.dtype}"
            )
        grid = self._grid(image_grid_thw)
        total = sum(t * h * w for t, h, w in grid)
        if pixel_values.shape[0] != total:
            raise ValueError(
                f"{name}: expected {total} patches (the sum of t * h * w over image_grid_thw), "
                f"got {pixel_values.shape[0]}"
            )
        return grid

    def _plans(self, grid: Grid) -> list[AttentionPlan]:
        """Each block's attention plan (host-side): by default, every block attends within each
        frame."""
        return [frame_plan(grid)] * len(self.blocks)

    def _embed(self, pixel_values: torch.Tensor, grid: Grid) -> torch.Tensor:
        """The blocks' input ``[n_patches, width]``."""
        return self.patch_embed(pixel_values)

    def _hidden_states(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, keep: Sequence[int] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Checks the inputs, then runs the patches through the blocks: the last block's output
        ``[n_patches, width]`` and the outputs of the blocks listed in ``keep`` (in block
        order)."""
        grid = self._check(pixel_values, image_grid_thw)
        device = pixel_values.device
        cos, sin = rotary_angles(
            merge_block_positions(grid, self.spatial_merge_size),
            self._head_dim,
            self.rope_theta,
            device,
        )
        # Blocks share a few plans (one object each): each is moved to the device, and the
        # angles gathered into its order, once per forward rather than once per block.
        steps: dict[int, tuple[AttentionPlan, torch.Tensor, torch.Tensor]] = {}
        schedule = []
        for plan in self._plans(grid):
            if id(plan) not in steps:
                moved = plan.to(device)
                if moved.order is None:
                    steps[id(plan)] = (moved, cos, sin)
                else:
                    steps[id(plan)] = (moved, cos[moved.order], sin[moved.order])
            schedule.append(steps[id(plan)])
        x = self._embed(pixel_values, grid)
        kept = []
        for i, (block, (plan, plan_cos, plan_sin)) in enumerate(
            zip(self.blocks, schedule, strict=True)
        ):
            x = block(x, plan_cos, plan_sin, plan)
            if i in keep:
                kept.append(x)
        return x, kept
