"""How encoder rows are laid out. The layout is always stated by type, never guessed from shape."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    """Encoder rows in order of appearance of the placeholders over the whole batch:
    ``[n_rows, d]``, or ``[n_media, tokens_per_media, d]`` (flattened in order), exactly one
    per placeholder. A bare tensor returned by an encoder or passed as its output is packed."""

    rows: torch.Tensor


@dataclass(frozen=True)
class Padded:
    """Encoder rows padded per sample, ``[b, max_tokens, d]``: sample ``i``'s ``k``-th
    placeholder takes ``rows[i, k]``; rows past a sample's placeholder count are padding,
    ignored. Rows never move across samples."""

    rows: torch.Tensor


EncoderRows = torch.Tensor | Packed | Padded


def as_layout(rows: EncoderRows, name: str = "rows") -> Packed | Padded:
    """A bare tensor is :class:`Packed`; layouts pass through. TypeError (naming ``name``)
    for anything else."""
    layout = Packed(rows) if isinstance(rows, torch.Tensor) else rows
    if not isinstance(layout, Packed | Padded) or not isinstance(layout.rows, torch.Tensor):
        raise TypeError(
            f"{name}: expected a tensor, or a Packed or Padded of a tensor, got {rows!r:.80}"
        )
    return layout
