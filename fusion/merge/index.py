"""Sync-free index merge: one embedding lookup, then one ``index_copy_`` per encoder."""

import torch
import torch.nn.functional as F

from fusion.merge.placement import Placement


def merge_index(
    text_ids: torch.Tensor, weight: torch.Tensor, placements: list[Placement]
) -> torch.Tensor:
    batch, seq_len = text_ids.shape
    n = batch * seq_len
    # One extra output row absorbs padding rows (see Placement.destinations) and is dropped.
    ids = torch.cat([text_ids.reshape(-1), text_ids.new_zeros(1)])
    out = F.embedding(ids, weight)
    for p in placements:
        out.index_copy_(0, p.destinations(), p.rows)
    return out[:n].view(batch, seq_len, weight.size(1))
