"""Left-padded prompt batches: building them, and their positions and attention masks (below
both preprocessing, which builds batches, and generation, which runs them).

A batch of prompts of different lengths is right-aligned: sample ``i`` has ``pad_counts[i]``
pad slots on the left. Each sample's rotary positions start at 0 at its first real token, and
no query ever attends to a pad slot, so every sample sees exactly what it would see alone.
The KV cache is filled left to right by slot, so slot ``j`` holds the same column for all
samples, real or pad.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fusion._arguments import INTEGER_DTYPES, as_device, as_int, show


def left_pad(
    prompts: Sequence[Sequence[int] | torch.Tensor],
    pad_id: int,
    *,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Right-align ``prompts`` in a [b, max_len] int64 tensor, padding on the left with ``pad_id``.

    Args:
        prompts: the prompts, each a sequence of integer ids (Python or NumPy integers) or a
            1-D integer tensor; a 2-D tensor is read as one prompt per row.
        pad_id: the padding id, an integer >= 0.
        device: where the batch goes (default: the CPU).

    Raises:
        ValueError: no prompts; a prompt that is empty, not 1-D, or holds anything but
            integers >= 0 that fit in int64 (a float or a bool is never rounded into an id);
            a prompt whose first token is ``pad_id`` (it would be taken for padding); a bad
            ``pad_id``; a ``device`` that does not exist here.
    """
    pad_id = as_int(pad_id, "pad_id")
    if pad_id < 0:
        raise ValueError(f"pad_id: expected an id >= 0, got {pad_id}")
    if device is not None:
        device = as_device(device, "device")
    if isinstance(prompts, str | bytes | Mapping) or not hasattr(prompts, "__len__"):
        raise ValueError(f"prompts: expected a sequence of prompts, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts: expected at least one prompt, got none")
    rows = [_prompt_row(prompt, f"prompts[{i}]") for i, prompt in enumerate(prompts)]
    for i, row in enumerate(rows):
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


def _prompt_row(prompt: Any, name: str) -> torch.Tensor:
    """One prompt as a non-empty 1-D int64 CPU tensor of ids >= 0."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype not in INTEGER_DTYPES or prompt.device.type == "meta":
            raise ValueError(
                f"{name}: expected a 1-D tensor of integer ids, got shape {list(prompt.shape)}, "
                f"dtype {prompt.dtype} on {prompt.device}"
            )
        row = prompt.detach().to("cpu", torch.long)  # uint64 above int64 wraps negative: refused
    else:
        if isinstance(prompt, str | bytes | Mapping) or not hasattr(prompt, "__iter__"):
            raise ValueError(f"{name}: expected a sequence of integer ids, got {show(prompt)}")
        ids = [as_int(token, name) for token in prompt]
        try:
            row = torch.tensor(ids, dtype=torch.long)
        except (OverflowError, RuntimeError, ValueError) as error:
            raise ValueError(f"{name}: expected ids that fit in int64, got {show(ids)}") from error
    if row.numel() == 0:
        raise ValueError(f"{name}: expected at least one token, got an empty prompt")
    if int(row.min()) < 0:
        raise ValueError(f"{name}: expected ids >= 0, got {int(row.min())}")
    return row


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


def step_mask(pad_counts: torch.Tensor, slot: int | torch.Tensor, cache_len: int) -> torch.Tensor:
    """Boolean [b, 1, cache_len] for the token written at cache ``slot`` (an int, or a 0-dim
    tensor on the device, such as a cache's fill level): real slots <= slot."""
    keys = torch.arange(cache_len, device=pad_counts.device)
    return ((keys <= slot) & (keys >= pad_counts[:, None]))[:, None, :]


def pad_left_to(
    tokens: torch.Tensor, pad_counts: torch.Tensor, length: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` [b, s] with ``length - s`` more pad slots on the left, and their pad counts:
    every sample's computation is unchanged (pad slots are never attended to)."""
    extra = length - tokens.size(1)
    if extra <= 0:
        return tokens, pad_counts
    pads = tokens.new_full((tokens.size(0), extra), pad_id)
    return torch.cat([pads, tokens], dim=1), pad_counts + extra


def prompt_positions(pad_counts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rotary positions [b, seq_len]: 0 at each sample's first real token (pad slots get 0)."""
    slots = torch.arange(seq_len, device=pad_counts.device)
    return (slots[None, :] - pad_counts[:, None]).clamp_min(0)
