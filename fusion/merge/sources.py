"""What the single-pass merges share: where each output row is read from, and their backward.

A single-pass merge (``fused``, ``compiled``) writes output row ``i`` once, from the table
(``table[text_ids[i]]``) or from one encoder row. :func:`row_sources` says which, in O(tokens)
with no host synchronisation and no data-dependent shape; :func:`merge_backward` computes the
gradients with the same ATen ops as ``reference``'s backward, so they are bitwise equal to it.
"""

import torch

from fusion.merge.placement import Placement


def row_sources(
    text_ids: torch.Tensor, placements: list[Placement]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The source of each output row, and each encoder's destinations.

    Args:
        text_ids: [b, s] (only its shape and device are read).
        placements: matched to the text (:func:`fusion.merge.placement.match_text`).

    Returns:
        ``source`` [b * s] int64: for an output row filled by an encoder, the index of its row
        in the encoders' rows concatenated in order (encoder ``e``'s rows start at the sum of
        the row counts before it); -1 for a text row. ``destinations``: per encoder [n_rows],
        :meth:`Placement.destinations` (``b * s`` for padding rows, which no output row reads).
    """
    n = text_ids.numel()
    # Slot n is the spill row of Placement.destinations: padding rows land there, unread.
    source = torch.full((n + 1,), -1, dtype=torch.int64, device=text_ids.device)
    destinations, start = [], 0
    for p in placements:
        dest = p.destinations()
        count = p.rows.size(0)
        source.index_copy_(0, dest, torch.arange(start, start + count, device=dest.device))
        destinations.append(dest)
        start += count
    return source[:n], destinations


def merge_backward(
    grad: torch.Tensor,
    text_ids: torch.Tensor,
    source: torch.Tensor,
    destinations: list[torch.Tensor],
    vocab: int,
    *,
    table_grad: bool,
    rows_grad: bool,
) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """Gradients of a single-pass merge: w.r.t. the table [vocab, d] and each encoder's rows.

    Args:
        grad: [n, d], the output's gradient.
        text_ids: [n] (0 at placeholders), source: [n] and destinations: as
            :func:`row_sources` returned them.
        vocab: the table's rows.
        table_grad, rows_grad: which gradients to compute (None for the others).

    Returns:
        ``(table gradient [vocab, d] or None, per encoder [n_rows, d] or None)``: what the
        reference's ``F.embedding`` and ``masked_scatter`` pass back, bit for bit; padding
        rows get zeros.
    """
    n = text_ids.numel()
    grad_table = None
    if table_grad:
        # What the reference's masked_scatter passes to its embedding: placeholders zeroed.
        text_grad = grad.masked_fill((source >= 0)[:, None], 0)
        grad_table = torch.ops.aten.embedding_dense_backward(text_grad, text_ids, vocab, -1, False)
    grad_rows = None
    if rows_grad:
        grad_rows = []
        for dest in destinations:
            if n == 0:
                grad_rows.append(grad.new_zeros(dest.numel(), grad.size(1)))
                continue
            dropped = (dest == n)[:, None]  # padding rows: not in the output, zero gradient
            grad_rows.append(grad.index_select(0, dest.clamp(max=n - 1)).masked_fill_(dropped, 0))
    return grad_table, grad_rows
