"""Left-padded prompt batches: building them, and their positions and attention masks.

A batch of prompts of different lengths is right-aligned: sample ``i`` has ``pad_counts[i]``
pad slots on the left. Each sample's rotary positions start at 0 at its first real token, and
no query ever attends to a pad slot, so every sample sees exactly what it would see alone.
The KV cache is filled left to right by slot, so slot ``j`` holds the same column for all
samples, real or pad.
"""

from collections.abc import Sequence

import torch


def left_pad(
    prompts: Sequence[Sequence[int] | torch.Tensor],
    pad_id: int,
    *,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Right-align ``prompts`` in a [b, max_len] int64 tensor, padding on the left with ``pad_id``.

    Raises:
        ValueError: no prompts, an empty prompt, or a prompt whose first token is ``pad_id``
            (it would be taken for padding).
    """
    if len(prompts) == 0:
        raise ValueError("prompts: expected at least one prompt, got none")
    rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    for i, row in enumerate(rows):
        if row.numel() == 0:
            raise ValueError(f"prompts[{i}]: expected at least one token, got an empty prompt")
        if int(row[0]) == pad_id:
            raise ValueError(
                f"prompts[{i}]: starts with pad_id={pad_id}, which would be read as padding; "
                "choose another pad_id"
            )
    width = max(row.numel() for row in rows)
    batch = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, width - row.numel() :] = row
    return batch.to(device)


def leading_pad_counts(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Number of ``pad_id`` tokens before each sample's first other token: [b, s] -> [b]."""
    return (tokens == pad_id).long().cumprod(dim=1).sum(dim=1)


def prefill_mask(pad_counts: torch.Tensor, seq_len: int, cache_len: int) -> torch.Tensor:
    """Boolean [b, seq_len, cache_len]: slot ``i`` attends to real slots ``j <= i``.

    A pad slot also attends to itself: with nothing to attend to, some attention kernels return
    NaN, which would reach the cache, where masking cannot undo it (0 * NaN = NaN). Pad slots'
    outputs are never read, so what they attend to does not matter otherwise.
    """
    queries = torch.arange(seq_len, device=pad_counts.device)[:, None]
    keys = torch.arange(cache_len, device=pad_counts.device)[None, :]
    real = keys >= pad_counts[:, None, None]
    return ((keys <= queries) & real) | (keys == queries)


def step_mask(pad_counts: torch.Tensor, slot: int, cache_len: int) -> torch.Tensor:
    """Boolean [b, 1, cache_len] for the token written at cache ``slot``: real slots <= slot."""
    keys = torch.arange(cache_len, device=pad_counts.device)
    return ((keys <= slot) & (keys >= pad_counts[:, None]))[:, None, :]


def prompt_positions(pad_counts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rotary positions [b, seq_len]: 0 at each sample's first real token (pad slots get 0)."""
    slots = torch.arange(seq_len, device=pad_counts.device)
    return (slots[None, :] - pad_counts[:, None]).clamp_min(0)
