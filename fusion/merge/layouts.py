"""How encoder rows are laid out. The layout is always stated by type, never guessed from shape."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    """Encoder rows in order of appearance of the placeholders over the whole batch.

    ``rows``: ``[n_rows, d]``, or ``[n_media, tokens_per_media, d]`` (flattened in order).
    The number of rows must equal the number of placeholders exactly. A bare tensor returned by
    an encoder or passed as an encoder output means ``Packed``.
    """

    rows: torch.Tensor


@dataclass(frozen=True)
class Padded:
    """Encoder rows padded per sample.

    ``rows``: ``[b, max_tokens, d]``. Sample ``i``'s ``k``-th placeholder takes ``rows[i, k]``;
    rows past a sample's placeholder count are padding and ignored. Rows never move across
    samples.
    """

    rows: torch.Tensor


EncoderRows = torch.Tensor | Packed | Padded


def as_layout(rows: EncoderRows, name: str = "rows") -> Packed | Padded:
    """A bare tensor is :class:`Packed`; layouts pass through.

    Raises:
        TypeError: ``rows`` (called ``name`` in messages) is not a tensor or a layout of one.
    """
    layout = Packed(rows) if isinstance(rows, torch.Tensor) else rows
    if not isinstance(layout, Packed | Padded) or not isinstance(layout.rows, torch.Tensor):
        raise TypeError(
            f"{name}: expected a tensor, or a Packed or Padded of a tensor, got {rows!r:.80}"
        )
    return layout
