"""M-RoPE positions: where each token sits in (temporal, height, width), from placeholders.

Qwen2-VL's rotary positions are three rows ``[3, b, s]``. Text tokens have three equal rows
that count on by one; the placeholders of an image or video of ``t x h x w`` merged patches
(its grid divided by the spatial merge size) take ``start + (temporal(ti), hi, wi)`` in
raster order, ``start`` being where the media begins; text after it goes on from ``start +
max(h, w)``, one past the largest spatial position. The temporal row is the frame index
``ti`` for images and Qwen2-VL's videos, and ``long(ti * interval)`` for Qwen2.5-VL's videos
(``interval = tokens_per_second * second_per_grid_ts``, in the interval's dtype, truncated as
transformers 5.24 truncates it), so a video's temporal row may pass the text after it.

transformers computes this per sample in a Python loop over token groups (``get_rope_index``);
here it is a few tensor operations over the whole batch, with no host synchronisation, in any
layout: a sample starts wherever the 1-D position is 0 (as in fusion's packed rows and
left-padded batches), so every sample's positions are its own. Each placeholder kind (images,
videos) is placed on its own, its media in the order of its grids; the kinds may interleave.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch

from fusion._validation import INDEX_DTYPES, check_values, describe, host_reads_are_free


class MediaGrids(NamedTuple):
    """One placeholder kind of :func:`mrope_positions` and its media.

    Attributes:
        placeholder_id: the id its placeholders carry.
        grid_thw: [n, 3] patches per media (t, h, w), as the processor gives them, in order
            of appearance across the batch (row-major); None or empty without media.
        time_interval: [n] temporal positions per temporal grid step (floating or integer;
            transformers' ``tokens_per_second * second_per_grid_ts``), the temporal row being
            ``long(ti * time_interval)`` computed in its dtype; None: the frame index ``ti``.
        name: what errors call the grids (e.g. ``"video_grid_thw"``).
    """

    placeholder_id: int
    grid_thw: torch.Tensor | None
    time_interval: torch.Tensor | None = None
    name: str = "image_grid_thw"


class _Placed(NamedTuple):
    """Per token [b * s], what its media says (left at the defaults on other tokens)."""

    is_media: torch.Tensor  # bool
    offset: torch.Tensor  # place within its media
    height: torch.Tensor  # its media's merged grid (1 elsewhere)
    width: torch.Tensor
    rows: torch.Tensor  # its media's placeholders (1 elsewhere)
    temporal: torch.Tensor  # its temporal row, from its media's start


def mrope_positions(
    tokens: torch.Tensor,
    input_pos: torch.Tensor | None,
    placeholder_id: int,
    image_grid_thw: torch.Tensor | None,
    spatial_merge_size: int,
    carry: torch.Tensor | None = None,
    *,
    media: Sequence[MediaGrids] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 3-D positions of ``tokens`` and each row's offset at its end.

    Args:
        tokens: ids [b, s]; ``placeholder_id`` marks image rows, each image's placeholders
            contiguous and in the order of ``image_grid_thw`` (across the batch, row-major:
            the order the merge writes encoder rows in); likewise each kind of ``media``.
        input_pos: 1-D positions [b, s], [1, s] or [s]; a sample starts wherever one is 0.
            None: each row is one sample from 0.
        placeholder_id: the image placeholder id.
        image_grid_thw: [n_images, 3] patches per image (t, h, w), as the image processor
            gives them; None or empty without images.
        spatial_merge_size: patches merged per side into one row (``h`` and ``w`` divide).
        carry: [b] offsets carried over from earlier calls (a KV cache's prompt), added to the
            tokens of each row before its first 0 position.
        media: further placeholder kinds (e.g. videos, :class:`MediaGrids`), their ids
            distinct from the images'.

    Returns:
        ``(positions [3, b, s], offsets [b])``: ``offsets`` is what 1-D positions after each
        row need added to continue its last sample, as transformers' ``generate`` continues
        it (from its last text position). That is ``get_rope_index``'s ``rope_deltas``
        unless a video's temporal row passes the text after it: ``rope_deltas`` is then one
        past the sample's largest position, which transformers 5.24 uses only when decoding
        without ``generate``'s position ids.

    Raises:
        TypeError, ValueError: ``input_pos``, a grid or a ``time_interval`` of another type,
            shape or dtype than above (a ``time_interval`` not one value per grid row);
            placeholders that are not one unbroken run of ``t * h * w /
            spatial_merge_size**2`` per media, in a row (checked eagerly on the CPU, as a
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
    kinds = [  # (kind, its grids as long [n, 3]), kinds without media left out
        (kind, grids)
        for kind in (MediaGrids(placeholder_id, image_grid_thw), *media)
        if (grids := _checked_kind(kind)) is not None
    ]
    pos = input_pos.to(torch.long).expand(batch, seq_len)
    # Tokens of a row before its first 0 continue a sample started in an earlier call.
    column = torch.arange(seq_len, device=device).expand(batch, seq_len)
    start = torch.where(pos == 0, column, -1).cummax(dim=1).values  # [b, s]
    continued = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    if carry is not None:
        continued = torch.where(start < 0, carry[:, None], continued)
    if not kinds:
        return (pos + continued).expand(3, batch, seq_len), continued[:, -1]

    placed = _place(tokens, kinds, spatial_merge_size)
    is_media, offset, height, width, rows, temporal = (x.view(batch, seq_len) for x in placed)
    # At a media's last placeholder, the text row jumps by max(h, w) instead of h * w.
    last = is_media & (offset == rows - 1)
    jump = torch.where(last, torch.maximum(height, width) - rows, 0)
    before = jump.cumsum(1) - jump  # jumps strictly before each token, from the row's start
    shift = before - before.gather(1, start.clamp(min=0)) * (start >= 0) + continued
    text = pos + shift  # [b, s]
    media_start = text - offset  # the 1-D position of its first row
    within = torch.stack([temporal, offset // width % height, offset % width])
    positions = torch.where(is_media, media_start + within, text.expand(3, batch, seq_len))
    # Decoding goes on from the next text position, as transformers' generate goes on from
    # the last prompt token's positions (not from get_rope_index's rope_deltas, one past the
    # sample's largest position: the two part where a video's temporal row passes the text).
    return positions, shift[:, -1] + jump[:, -1]


def _place(
    tokens: torch.Tensor,
    kinds: list[tuple[MediaGrids, torch.Tensor]],
    spatial_merge_size: int,
) -> _Placed:
    """Each placeholder's media, place within it and temporal row, over all ``kinds`` (each
    with its checked grids)."""
    batch, seq_len = tokens.shape
    device = tokens.device
    flat = tokens.flatten()
    zeros, ones = torch.zeros_like(flat), torch.ones_like(flat)
    is_media = torch.zeros_like(flat, dtype=torch.bool)
    offset, height, width, rows, temporal = zeros, ones, ones, ones, zeros
    merge = torch.tensor([1, spatial_merge_size, spatial_merge_size], device=device)
    for kind, grids in kinds:
        llm_grids = grids.to(device, non_blocking=True) // merge
        counts = llm_grids.prod(-1)  # [n]: placeholders per media
        ends = counts.cumsum(0)
        here = flat == kind.placeholder_id
        rank = (here.cumsum(0) - 1).clamp(min=0)  # placeholder number, batch-wide
        index = torch.searchsorted(ends, rank, right=True).clamp(max=len(counts) - 1)
        place = rank - (ends - counts)[index]  # place within its media
        # Each media's placeholders in one run: a placeholder follows another of its kind
        # exactly when it is not its media's first (grids that split them are refused).
        in_row = here.view(batch, seq_len)
        follows = torch.zeros_like(in_row)
        follows[:, 1:] = in_row[:, :-1]
        check_values(
            (~here | (follows.flatten() == (place > 0))).all(),
            f"tokens: the {kind.name.removesuffix('_grid_thw')} placeholders do not match "
            f"{kind.name}: each needs one unbroken run of t * h * w / {spatial_merge_size}**2 "
            "placeholders within a row",
            eager=host_reads_are_free(device),
        )
        _, media_h, media_w = llm_grids[index].unbind(-1)
        frame = place // (media_h * media_w)
        if kind.time_interval is not None:
            # transformers' (arange(t) * interval).long(): the product in the interval's
            # dtype, truncated towards zero.
            interval = kind.time_interval.to(device, non_blocking=True)[index]
            frame = (frame * interval).long()
        is_media = is_media | here
        offset = torch.where(here, place, offset)
        height = torch.where(here, media_h, height)
        width = torch.where(here, media_w, width)
        rows = torch.where(here, counts[index], rows)
        temporal = torch.where(here, frame, temporal)
    return _Placed(is_media, offset, height, width, rows, temporal)


def _checked_kind(kind: MediaGrids) -> torch.Tensor | None:
    """A kind's grids as long [n, 3] (None without media), its ``time_interval`` checked
    against them: metadata only, no values read."""
    grids = kind.grid_thw
    if grids is None:
        return None
    if not isinstance(grids, torch.Tensor):
        raise TypeError(f"{kind.name}: expected a tensor, got {type(grids).__name__}")
    if grids.dim() != 2 or grids.size(1) != 3 or grids.dtype not in INDEX_DTYPES:
        raise ValueError(f"{kind.name}: expected integer grids [n, 3], got {describe(grids)}")
    interval = kind.time_interval
    if interval is not None and (
        not isinstance(interval, torch.Tensor)
        or interval.shape != (grids.size(0),)
        or interval.dtype.is_complex
        or interval.dtype == torch.bool
    ):
        got = describe(interval) if isinstance(interval, torch.Tensor) else type(interval).__name__
        raise ValueError(
            f"{kind.name}: expected a time interval per grid row, [{grids.size(0)}] real "
            f"numbers, got {got}"
        )
    return grids.to(torch.long) if grids.numel() else None
