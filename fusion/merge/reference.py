"""The common pattern: embed every token, then ``masked_scatter`` each encoder's rows.

The correctness oracle and the baseline of the benchmarks. It writes placeholder rows twice,
and its padded layout uses boolean indexing, which synchronises with the host on accelerators.
"""

from collections.abc import Callable

import torch

from fusion.merge.placement import Placement, match_text


def merge_reference(
    text_ids: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    placements: list[Placement],
) -> torch.Tensor:
    embeds = embed(text_ids)
    for p in match_text(placements, embeds):
        rows = p.rows
        if p.width is not None:
            batch = p.is_placeholder.size(0)
            per_sample = p.is_placeholder.sum(1, keepdim=True)
            valid = torch.arange(p.width, device=rows.device) < per_sample
            rows = rows.view(batch, p.width, rows.size(-1))[valid]
        mask = p.is_placeholder[..., None].expand_as(embeds)
        embeds = embeds.masked_scatter(mask, rows)
    return embeds
