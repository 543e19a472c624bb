"""Where each patch of a Qwen vision tower sits and which patches it attends to, computed on the
host from the grid of each image's (t, h, w) in patches.

The tower's patch order is the image processor's: each frame merge block by merge block (see
:func:`merge_block_positions`), frames and images one after another. The plans are built once
per forward and copied to the patches' device by the tower
(:mod:`fusion.encoders.qwen_vision_tower`).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

Grid = list[tuple[int, int, int]]  # each image's (t, h, w) in patches, as Python ints


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
