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
