"""M-RoPE positions: where each token sits in (temporal, height, width), from placeholders.

Qwen2-VL's rotary positions are three rows ``[3, b, s]``. Text tokens have three equal rows
that count on by one; the placeholders of an image of ``t x h x w`` merged patches (its grid
divided by the spatial merge size) take ``start + (ti, hi, wi)`` in raster order, ``start``
being where the image begins; text after it goes on from ``start + max(h, w)``, one past the
image's largest position. transformers computes this per sample in a Python loop over token
groups (``get_rope_index``); here it is a few tensor operations over the whole batch, with no
host synchronisation, in any layout: a sample starts wherever the 1-D position is 0 (as in
fusion's packed rows and left-padded batches), so every sample's positions are its own.
"""

from collections.abc import Mapping
from typing import Any

import torch

from fusion._validation import INDEX_DTYPES, check_values, describe, host_reads_are_free


def mrope_positions(
    tokens: torch.Tensor,
    input_pos: torch.Tensor | None,
    placeholder_id: int,
    image_grid_thw: torch.Tensor | None,
    spatial_merge_size: int,
    carry: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 3-D positions of ``tokens`` and each row's offset at its end.

    Args:
        tokens: ids [b, s]; ``placeholder_id`` marks image rows, each image's placeholders
            contiguous and in the order of ``image_grid_thw`` (across the batch, row-major:
            the order the merge writes encoder rows in).
        input_pos: 1-D positions [b, s], [1, s] or [s]; a sample starts wherever one is 0.
            None: each row is one sample from 0.
        placeholder_id: the image placeholder id.
        image_grid_thw: [n_images, 3] patches per image (t, h, w), as the image processor
            gives them; None or empty without images.
        spatial_merge_size: patches merged per side into one row (``h`` and ``w`` divide).
        carry: [b] offsets carried over from earlier calls (a KV cache's prompt), added to the
            tokens of each row before its first 0 position.

    Returns:
        ``(positions [3, b, s], offsets [b])``: ``offsets`` is what 1-D positions after each
        row need added to continue its last sample (Hugging Face's ``rope_deltas``).

    Raises:
        TypeError, ValueError: ``input_pos`` or ``image_grid_thw`` of another type, shape or
            dtype than above; placeholders that are not one unbroken run of ``t * h * w /
            spatial_merge_size**2`` per image, in a row (checked eagerly on the CPU, as a
            device-side assertion elsewhere; the count as a whole is the merge's check).
    """
    batch, seq_len = tokens.shape
    device = tokens.device
    if input_pos is None:
        input_pos = torch.arange(seq_len, device=device)
    elif not isinstance(input_pos, torch.Tensor):
        raise TypeError(f"input_pos: expected a tensor, got {type(input_pos).__name__}")
    else:
        shapes = list(dict.fromkeys([(batch, seq_len), (1, seq_len), (seq_len,)]))
        if tuple(input_pos.shape) not in shapes or input_pos.dtype not in INDEX_DTYPES:
            accepted = ", ".join(str(list(shape)) for shape in shapes)
            raise ValueError(
                f"input_pos: expected integer positions {accepted} or [3, {batch}, {seq_len}], "
                f"got {describe(input_pos)}"
            )
    pos = input_pos.to(torch.long).expand(batch, seq_len)
    # Tokens of a row before its first 0 continue a sample started in an earlier call.
    column = torch.arange(seq_len, device=device).expand(batch, seq_len)
    start = torch.where(pos == 0, column, -1).cummax(dim=1).values  # [b, s]
    continued = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    if carry is not None:
        continued = torch.where(start < 0, carry[:, None], continued)
    if image_grid_thw is None or image_grid_thw.numel() == 0:
        return (pos + continued).expand(3, batch, seq_len), continued[:, -1]
    grids = _checked_grids(image_grid_thw).to(device, non_blocking=True)

    is_image = tokens == placeholder_id  # [b, s]
    llm_grids = grids // torch.tensor([1, spatial_merge_size, spatial_merge_size], device=device)
    rows = llm_grids.prod(-1)  # [n]: placeholders per image
    ends = rows.cumsum(0)
    rank = (is_image.flatten().cumsum(0) - 1).clamp(min=0)  # placeholder number, batch-wide
    image = torch.searchsorted(ends, rank, right=True).clamp(max=len(rows) - 1)  # [b * s]
    offset = rank - (ends - rows)[image]  # place within its image
    # Each image's placeholders in one run: a placeholder follows another exactly when it is
    # not its image's first (a grid that splits the placeholders otherwise is refused).
    follows = torch.zeros_like(is_image)
    follows[:, 1:] = is_image[:, :-1]
    check_values(
        (~is_image | (follows == (offset.view(batch, seq_len) > 0))).all(),
        "tokens: the image placeholders do not match image_grid_thw: each image needs one "
        f"unbroken run of t * h * w / {spatial_merge_size}**2 placeholders within a row",
        eager=host_reads_are_free(device),
    )
    _, height, width = llm_grids[image].unbind(-1)
    within = torch.stack(
        [offset // (height * width), offset // width % height, offset % width]
    ).view(3, batch, seq_len)
    # At an image's last placeholder, the text row jumps by max(h, w) instead of h * w.
    last = is_image.flatten() & (offset == rows[image] - 1)
    jump = torch.where(last, torch.maximum(height, width) - rows[image], 0).view(batch, seq_len)
    before = jump.cumsum(1) - jump  # jumps strictly before each token, from the row's start
    shift = before - before.gather(1, start.clamp(min=0)) * (start >= 0) + continued
    text = pos + shift  # [b, s]
    image_start = text - offset.view(batch, seq_len)  # the 1-D position of its first row
    positions = torch.where(is_image, image_start + within, text.expand(3, batch, seq_len))
    return positions, shift[:, -1] + jump[:, -1]


def _checked_grids(grids: object) -> torch.Tensor:
    if not isinstance(grids, torch.Tensor):
        raise TypeError(f"image_grid_thw: expected a tensor, got {type(grids).__name__}")
    if grids.dim() != 2 or grids.size(1) != 3 or grids.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"image_grid_thw: expected integer grids [n_images, 3], got {describe(grids)}"
        )
    return grids.to(torch.long)


def grids_from(encoder_input: Mapping[str, Any] | None, name: str) -> torch.Tensor | None:
    """The ``image_grid_thw`` of encoder ``name``'s input, None where it has none."""
    value = (encoder_input or {}).get(name)
    if isinstance(value, Mapping):
        return value.get("image_grid_thw")
    return None
