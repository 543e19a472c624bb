"""Sync-free index merge: one call of the embedding, then one ``index_copy_`` per encoder."""

from collections.abc import Callable

import torch

from fusion.merge.placement import Placement, match_text


def merge_index(
    text_ids: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    placements: list[Placement],
) -> torch.Tensor:
    """Embed ``text_ids`` [b, s] once and overwrite the placeholder rows in place."""
    batch, seq_len = text_ids.shape
    # Padding rows need somewhere to go: an extra column per sample, written by the embedding
    # and dropped (see Placement.destinations). Packed rows fill placeholders exactly, so the
    # embedding sees the same ids as the decoder's own call.
    spill = any(p.width is not None and p.rows.size(0) for p in placements)
    if spill:
        text_ids = torch.cat([text_ids, text_ids.new_zeros(batch, 1)], dim=1)
    text = embed(text_ids)
    if not torch.compiler.is_compiling() and text._is_view():
        # E.g. DTensor.to_local under tensor parallelism, or an FSDP2 unit's output: autograd
        # forbids (or would lose hooks on) writing into a view, and it would write its base.
        # (Under torch.compile, functionalization already writes into a fresh tensor.)
        text = text.clone()
    placements = match_text(placements, text)
    out = text.contiguous().view(-1, text.size(-1))
    last = out.size(0) - 1
    for p in placements:
        # Clamped: unchecked counts (on accelerators) fail by a device-side assertion.
        out.index_copy_(0, p.destinations(spill_column=spill).clamp_(max=last), p.rows)
    out = out.view(batch, text_ids.size(1), out.size(-1))  # text_ids has the spill column
    return out[:, :seq_len] if spill else out
