"""The decoder's boolean attention masks over a call's keys, made on the device without a
host sync: a mask limited to a sliding window, the bidirectional blocks of images
(Gemma 3's) added, a ring cache's columns taken, and a decoding step's mask cut to the filled
cache slots. Shapes: ``[b or 1, 1, s, kv_len]``, queries by ``s``, keys by ``kv_len``."""

import torch

from fusion.decoder.packed import PackedSegments, causal_band


def within_window(
    mask: torch.Tensor | None,
    window: int | None,
    slots: torch.Tensor | None,
    seq_len: int,
    device: torch.device,
) -> torch.Tensor | None:
    """``mask`` [b or 1, 1, s, kv_len] limited to keys less than ``window`` slots before each
    query (queries at ``slots`` with a cache, at ``0..s-1`` without); for None (causal, no
    cache), the causal band [1, 1, s, s], or None still when the sequence fits in the window
    (or there is no window)."""
    if window is None or (mask is None and seq_len <= window):
        return mask
    if mask is None:
        return causal_band(seq_len, window, device)[None, None]
    queries = torch.arange(seq_len, device=device) if slots is None else slots
    keys = torch.arange(mask.size(-1), device=device)
    return mask & (queries[:, None] - keys[None, :] < window)


def with_blocks(
    mask: torch.Tensor | PackedSegments | None,
    blocks: torch.Tensor,
    slots: torch.Tensor | None,
    seq_len: int,
) -> torch.Tensor | PackedSegments:
    """``mask`` (as the decoder's forward has made it) with the tokens of each block of
    ``blocks`` [b, s] also attending to the later tokens of their block: packed segments
    carrying the blocks; a boolean [b, 1, s, kv_len] otherwise (for None, the causal mask's).
    On the device, no sync."""
    if isinstance(mask, PackedSegments):
        return mask.with_blocks(blocks)
    if mask is None:  # causal over this call's positions, no cache
        return causal_band(seq_len, None, blocks.device, blocks)[:, None]
    keys = blocks  # without a cache, the keys are this call's positions
    if slots is not None:  # the blocks' keys at this call's slots, none at the others
        keys = blocks.new_zeros(blocks.size(0), mask.size(-1)).index_copy(1, slots, blocks)
    same = (blocks[:, :, None] == keys[:, None, :]) & (blocks[:, :, None] > 0)  # [b, s, kv]
    return mask | same[:, None]


def at_positions(mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``mask`` [.., kv_len] over cache positions, taken at ``positions`` [n] (a ring's
    columns: :meth:`SlidingWindowKVCache.key_slots`, -1 for a column holding none, which is
    masked): [.., n]. On the device, no sync (an integer gather)."""
    return mask.index_select(-1, positions.clamp_min(0)) & (positions >= 0)


def without_unfilled_slots(mask: torch.Tensor, filled: int) -> torch.Tensor:
    """``mask`` [.., kv_len] cut to the first ``filled`` cache slots when it allows none after
    them, so that attention reads only those (the layers attend to as many slots as the mask
    has); unchanged otherwise. Only where reading the fill level costs nothing: elsewhere every
    step attends to the whole cache, which keeps its shapes static."""
    if filled < mask.size(-1) and not bool(mask[..., filled:].any()):
        return mask[..., :filled]
    return mask
