"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision towers (patches -> merged rows of the
decoder's width), in plain PyTorch.

All take the image processor's flattened patches of any number of images (or videos) of any
size, concatenated, and a grid ``[n_images, 3]`` of each one's (t, h, w) in patches; they return
one row per ``spatial_merge_size`` x ``spatial_merge_size`` block of patches, images in order:
what transformers' vision model returns as ``pooler_output``. Qwen3-VL's also returns, per
DeepStack layer, rows of the same shape from an intermediate block (``deepstack_features``).

Parameter names are those of the checkpoints' ``visual.`` module without that prefix
(``patch_embed.proj.weight``, ``blocks.{i}.norm1``, ``blocks.{i}.attn.qkv``,
``blocks.{i}.attn.proj``, ``blocks.{i}.mlp...``, ``merger.ln_q``, ``merger.mlp.0``,
``merger.mlp.2``; Qwen3-VL: ``pos_embed``, ``merger.norm``, ``merger.linear_fc1``,
``merger.linear_fc2``, ``deepstack_merger_list.{j}...``), so they load by prefix alone. The
rotary frequencies are computed in each forward, not kept in a buffer: nothing is in the state
dict that the checkpoints lack, and a tower built on the meta device and materialised with
``to_empty`` needs no re-initialisation.

The mergers are the connectors to the text decoder. This layer imports nothing above it, so
marking them for ``EarlyFusion(fusion_trainable=...)`` is the model builder's job
(``register_fusion_module(tower.merger)``, and each of Qwen3-VL's ``deepstack_merger_list``),
as for LLaVA's projector.

Grids are read on the host: keep ``image_grid_thw`` on the CPU, as preprocessing gives it (on
an accelerator, reading it costs one synchronisation). The attention plans built from it are
copied to the patches' device once per forward.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fusion.encoders.vit_blocks import Activation, VisionMLP

Grid = list[tuple[int, int, int]]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _non_negative(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
    return value


def _heads(width_name: str, width: int, num_heads: int) -> int:
    """The head width, checked: rotary angles come in (h, w) pairs of sin/cos halves, so it must
    be a multiple of 4."""
    _positive("num_heads", num_heads)
    if width % num_heads or (width // num_heads) % 4:
        raise ValueError(
            f"num_heads: expected a divisor of {width_name}={width} leaving a head width that "
            f"is a multiple of 4, got {num_heads}"
        )
    return width // num_heads


class RMSNorm(nn.Module):
    """Qwen's root-mean-square norm with a learned ``weight``: normalised in float32, cast back
    to the input's dtype, then scaled (in that order, as the checkpoints were trained).

    Shapes: input ``[..., dim]``, output the same shape and dtype as ``weight * input``.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class PatchEmbed(nn.Module):
    """Flattened patches ``[n_patches, in_channels * temporal_patch_size * patch_size**2]``
    (channel-major, then time, then rows, then columns) -> ``[n_patches, embed_dim]``.

    The weight is the checkpoints' ``Conv3d`` kernel (``proj.weight``, shape
    ``[embed_dim, in_channels, temporal_patch_size, patch_size, patch_size]``; bias-free in
    Qwen2-VL and Qwen2.5-VL, with ``proj.bias`` in Qwen3-VL). Its kernel equals
    its stride and each input is exactly one kernel's extent, so the convolution is one matrix
    product with the flattened kernel, and that is how it is computed: the same sums, as one
    plain matrix product rather than a 3-D convolution over volumes of a single kernel's size.
    """

    def __init__(
        self,
        embed_dim: int,
        in_channels: int,
        patch_size: int,
        temporal_patch_size: int,
        bias: bool = False,
    ) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(
            patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias
        )


class PatchMerger(nn.Module):
    """``ln_q`` on each patch, then ``spatial_merge_size**2`` consecutive patches (one merge
    block, as the tower orders them) concatenated and mapped by ``mlp`` (Linear, exact GELU,
    Linear) to the decoder's width.

    Shapes: ``[n_patches, context_dim]`` -> ``[n_patches / spatial_merge_size**2, out_dim]``.

    Args:
        out_dim: the text decoder's width.
        context_dim: the tower's width.
        spatial_merge_size: the side of a merge block, in patches.
        norm: ``"layer"`` (Qwen2-VL's LayerNorm) or ``"rms"`` (Qwen2.5-VL's RMSNorm).
    """

    def __init__(
        self, out_dim: int, context_dim: int, spatial_merge_size: int, norm: str = "layer"
    ) -> None:
        super().__init__()
        self.merged_dim = context_dim * spatial_merge_size**2
        self.ln_q: nn.Module = (
            nn.LayerNorm(context_dim, eps=1e-6) if norm == "layer" else RMSNorm(context_dim)
        )
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reshape with the row count spelled out: with no patches, -1 would be ambiguous.
        rows = x.shape[0] * x.shape[1] // self.merged_dim
        return self.mlp(self.ln_q(x).reshape(rows, self.merged_dim))


class SwiGLU(nn.Module):
    """Qwen2.5-VL's vision MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``, all biased."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size)
        self.up_proj = nn.Linear(hidden_size, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, hidden_size)
        self.act_fn = Activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen3VisionMLP(nn.Module):
    """Qwen3-VL's vision MLP: ``linear_fc2(act(linear_fc1(x)))``, both biased."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden_size, intermediate_size)
        self.linear_fc2 = nn.Linear(intermediate_size, hidden_size)
        self.act_fn = Activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """Qwen3-VL's merger: ``spatial_merge_size**2`` consecutive patches (one merge block)
    concatenated, a LayerNorm (``norm``), then ``linear_fc1``, exact GELU, ``linear_fc2`` to the
    decoder's width.

    The main merger normalises each patch before concatenating (``norm`` over ``context_dim``);
    the DeepStack mergers normalise the concatenation (``postshuffle_norm=True``: ``norm`` over
    ``context_dim * spatial_merge_size**2``), as transformers' ``use_postshuffle_norm``.

    Shapes: ``[n_patches, context_dim]`` -> ``[n_patches / spatial_merge_size**2, out_dim]``.
    """

    def __init__(
        self, out_dim: int, context_dim: int, spatial_merge_size: int, postshuffle_norm: bool
    ) -> None:
        super().__init__()
        self.merged_dim = context_dim * spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle_norm else context_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reshape with the row count spelled out: with no patches, -1 would be ambiguous.
        rows = x.shape[0] * x.shape[1] // self.merged_dim
        if self.postshuffle_norm:
            x = self.norm(x.reshape(rows, self.merged_dim))
        else:
            x = self.norm(x).reshape(rows, self.merged_dim)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


# ---------------------------------------------------------------------------------------------
# Positions and attention plans, computed on the host from the grid.


def merge_block_positions(grid: Grid, spatial_merge_size: int) -> torch.Tensor:
    """(row, column) of every patch, in the tower's patch order: ``[n_patches, 2]`` long.

    The image processor emits each frame's patches merge block by merge block (blocks
    row-major, the ``m`` x ``m`` patches of a block row-major), so that the merger's ``m**2``
    consecutive patches are one block; frames follow each other with the same positions.
    """
    m = spatial_merge_size
    parts = []
    for t, h, w in grid:
        rows = torch.arange(h).view(h // m, 1, m, 1).expand(h // m, w // m, m, m)
        cols = torch.arange(w).view(1, w // m, 1, m).expand(h // m, w // m, m, m)
        frame = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1)
        parts.append(frame.repeat(t, 1))
    if not parts:
        return torch.zeros(0, 2, dtype=torch.long)
    return torch.cat(parts)


def bilinear_taps(
    grid: Grid, spatial_merge_size: int, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-VL's learned ``side`` x ``side`` position table resampled to each frame's (h, w)
    grid: for every patch, in the tower's patch order, the 4 table rows that bilinear
    interpolation with ``align_corners=True`` reads and their weights (``[n_patches, 4]`` long
    and float32), so that a patch's position embedding is ``sum_k weights[k] * table[taps[k]]``.

    Along an axis of ``n`` patches, patch ``i`` samples the table at ``i * (side - 1) /
    max(n - 1, 1)`` (the first and last patches at the table's first and last rows), reading
    the rows below and above that point with weights ``1 - f`` and ``1 - (1 - f)``, ``f`` its
    fractional part (the hat kernel, in float32, as transformers evaluates it); the row above is
    clamped to the table. The 4 taps are (low row, low col), (low, high), (high, low), (high,
    high), weights the products of the axes'. Frames of one video share their positions.
    """
    positions = merge_block_positions(grid, spatial_merge_size)  # [n, 2]: row, column
    sizes = [torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grid]
    extents = torch.cat(sizes) if sizes else torch.ones(0, 2, dtype=torch.long)
    points = positions.float() * (side - 1) / (extents - 1).clamp(min=1)  # [n, 2] float32
    low = points.floor()
    below = 1 - (points - low)  # weight of the lower row (column)
    above = 1 - below
    low_tap = low.long().clamp(0, side - 1)
    high_tap = (low_tap + 1).clamp(max=side - 1)
    rows = torch.stack([low_tap[:, 0], high_tap[:, 0]], dim=1)  # [n, 2]
    cols = torch.stack([low_tap[:, 1], high_tap[:, 1]], dim=1)
    row_weights = torch.stack([below[:, 0], above[:, 0]], dim=1)
    col_weights = torch.stack([below[:, 1], above[:, 1]], dim=1)
    taps = (rows[:, :, None] * side + cols[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return taps, weights


def rotary_angles(
    positions: torch.Tensor, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[n_patches, head_dim]`` (float32) of 2-D rotary embeddings.

    The first half of each rotated half of a head turns with the patch's row, the second with
    its column, at the frequencies ``theta ** (-j / (head_dim / 2))``, j = 0, 2, ... (the same
    frequencies for both axes).
    """
    half = head_dim // 2
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
    )
    angles = positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq  # [n, 2, f]
    angles = angles.flatten(1)  # [n, half]: row angles, then column angles
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[n, heads, head_dim]`` rotated by angles ``[n, head_dim]``, in float32 (as the
    checkpoints were trained), returned in x's dtype."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class AttentionPlan(NamedTuple):
    """Who attends to whom: disjoint segments covering the patches; each patch attends to the
    patches of its own segment only.

    Attention runs on ``order`` (patch indices with segments contiguous and grouped by length;
    ``None`` where the patches already are so). ``groups`` lists, in that order, runs of
    ``count`` segments of ``length`` patches each; ``restore`` is the inverse of ``order``.
    """

    order: torch.Tensor | None
    restore: torch.Tensor | None
    groups: tuple[tuple[int, int], ...]

    def to(self, device: torch.device) -> "AttentionPlan":
        if self.order is None or self.restore is None:
            return self
        return AttentionPlan(self.order.to(device), self.restore.to(device), self.groups)


def frame_plan(grid: Grid) -> AttentionPlan:
    """One segment per frame (``h * w`` patches; an image is one frame), as transformers'
    ``cu_seqlens``. Frames are contiguous already: no reordering, one group per run of frames
    of equal size."""
    groups: list[tuple[int, int]] = []
    for t, h, w in grid:
        if groups and groups[-1][0] == h * w:
            groups[-1] = (h * w, groups[-1][1] + t)
        else:
            groups.append((h * w, t))
    return AttentionPlan(None, None, tuple(groups))


def window_plan(grid: Grid, spatial_merge_size: int, window_blocks: int) -> AttentionPlan:
    """Qwen2.5-VL's windows: each frame cut into squares of ``window_blocks`` x
    ``window_blocks`` merge blocks (smaller at the bottom and right edges), one segment each.

    Within a segment patches keep transformers' order (the window's blocks row-major, each
    block's patches together); segments are then sorted (stably) by length, so that the few
    distinct window sizes make few groups.
    """
    m2 = spatial_merge_size**2
    s = window_blocks
    windows = []  # per frame: [n_windows, s * s] block indices, -1 where the window is cut
    offset = 0
    for t, h, w in grid:
        bh, bw = h // spatial_merge_size, w // spatial_merge_size
        blocks = torch.arange(t * bh * bw).view(t, bh, bw) + offset
        offset += t * bh * bw
        nh, nw = -(-bh // s), -(-bw // s)
        blocks = F.pad(blocks, (0, nw * s - bw, 0, nh * s - bh), value=-1)
        blocks = blocks.view(t, nh, s, nw, s).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, s * s)
        windows.append(blocks)
    if not windows:
        return AttentionPlan(None, None, ())
    blocks = torch.cat(windows)
    lengths = (blocks >= 0).sum(1) * m2
    lengths, by_length = torch.sort(lengths, stable=True)
    blocks = blocks[by_length]
    valid = blocks >= 0
    patches = blocks[:, :, None] * m2 + torch.arange(m2)  # [n_windows, s * s, m2]
    order = patches[valid].reshape(-1)
    values, counts = torch.unique_consecutive(lengths, return_counts=True)
    groups = tuple(zip(values.tolist(), counts.tolist(), strict=True))
    if torch.equal(order, torch.arange(order.numel())):
        return AttentionPlan(None, None, groups)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel())
    return AttentionPlan(order, restore, groups)


# ---------------------------------------------------------------------------------------------
# Blocks.


class QwenVisionAttention(nn.Module):
    """Multi-head self-attention with a fused, biased ``qkv`` and a biased ``proj``, 2-D rotary
    positions on queries and keys, and attention within the segments of an :class:`AttentionPlan`.

    Each group of equal-length segments is one ``scaled_dot_product_attention`` call on
    ``[count, heads, length, head_dim]``, with no mask. Exact, like a block-diagonal boolean
    mask over all patches, but without its quadratic cost in the total patch count (a window
    block would spend nearly all of it on masked pairs) and without a mask, so every SDPA
    backend (flash included) applies; and a handful of calls per block instead of one per
    image or window as transformers' per-segment loop makes.
    """

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """x ``[n_patches, dim]``, cos and sin ``[n_patches, head_dim]`` (in plan order) ->
        ``[n_patches, dim]``."""
        n, dim = x.shape
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)
        if plan.order is not None:
            qkv = qkv[plan.order]
        q = _rotate(qkv[:, 0], cos, sin)
        k = _rotate(qkv[:, 1], cos, sin)
        v = qkv[:, 2]
        outs = []
        start = 0
        for length, count in plan.groups:
            stop = start + length * count
            q_, k_, v_ = (
                part[start:stop].view(count, length, self.num_heads, -1).transpose(1, 2)
                for part in (q, k, v)
            )
            out = F.scaled_dot_product_attention(q_, k_, v_)  # [count, heads, length, head_dim]
            outs.append(out.transpose(1, 2).reshape(length * count, dim))
            start = stop
        # No patches, no group: an empty slice of the projection keeps its weights in the graph.
        out = torch.cat(outs) if outs else v.reshape(0, dim)
        if plan.restore is not None:
            out = out[plan.restore]
        return self.proj(out)


class QwenVisionBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(
        self, norm1: nn.Module, norm2: nn.Module, attn: QwenVisionAttention, mlp: nn.Module
    ) -> None:
        super().__init__()
        # Registered in the checkpoints' order.
        self.norm1 = norm1
        self.norm2 = norm2
        self.attn = attn
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


# ---------------------------------------------------------------------------------------------
# Towers.


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
        self.in_channels = _positive("in_channels", in_channels)
        self.patch_size = _positive("patch_size", patch_size)
        self.spatial_merge_size = _positive("spatial_merge_size", spatial_merge_size)
        self.temporal_patch_size = _positive("temporal_patch_size", temporal_patch_size)
        self.num_heads = num_heads
        self.out_dim = _positive("out_dim", out_dim)
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
        _positive("embed_dim", embed_dim)
        _positive("hidden_size", hidden_size)
        _heads("embed_dim", embed_dim, num_heads)
        _non_negative("depth", depth)
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
        _positive("hidden_size", hidden_size)
        _positive("intermediate_size", intermediate_size)
        _positive("out_hidden_size", out_hidden_size)
        _heads("hidden_size", hidden_size, num_heads)
        _non_negative("depth", depth)
        _positive("window_size", window_size)
        _positive("patch_size", patch_size)
        _positive("spatial_merge_size", spatial_merge_size)
        window_blocks = window_size // spatial_merge_size // patch_size
        if window_blocks < 1:
            raise ValueError(
                f"window_size: expected at least patch_size * spatial_merge_size = "
                f"{patch_size * spatial_merge_size} pixels, got {window_size}"
            )
        full = tuple(fullatt_block_indexes)
        for index in full:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < depth:
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
        _positive("hidden_size", hidden_size)
        _positive("intermediate_size", intermediate_size)
        _positive("out_hidden_size", out_hidden_size)
        _heads("hidden_size", hidden_size, num_heads)
        _non_negative("depth", depth)
        _positive("num_position_embeddings", num_position_embeddings)
        side = math.isqrt(num_position_embeddings)
        if side * side != num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings: expected a square (the side of the position table "
                f"squared), got {num_position_embeddings}"
            )
        deepstack = tuple(deepstack_visual_indexes)
        if any(
            isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < depth
            for index in deepstack
        ) or list(deepstack) != sorted(set(deepstack)):
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
