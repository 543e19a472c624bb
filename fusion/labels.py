"""Targets for next-token training of a decoder or an early-fusion model."""

from collections.abc import Iterable

import torch

from fusion._validation import check_token_ids, describe


def shift_targets(targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The one label shift: ``labels[..., t]`` is ``targets[..., t + 1]``, what position ``t``
    predicts, and the last position is ``ignore_index`` (nothing follows it). ``targets``:
    each position's own id where it is a target, else ``ignore_index``."""
    labels = targets.roll(-1, dims=-1)
    labels[..., -1] = ignore_index
    return labels


def next_token_labels(
    tokens: torch.Tensor,
    *,
    ignore_ids: Iterable[int] = (),
    loss_start: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Labels for ``F.cross_entropy(logits.flatten(0, 1), labels.flatten())``.

    ``labels[i, t]`` is ``tokens[i, t + 1]``, the token position ``t`` predicts, or
    ``ignore_index`` where no loss belongs: the last position (nothing follows), targets that
    are one of ``ignore_ids`` (placeholder ids, which may lie outside the vocabulary, and
    padding), and targets before ``loss_start[i]`` (the prompt).

    Args:
        tokens: ids [b, s], placeholders included.
        ignore_ids: ids never to predict, e.g. ``model.encoder_tokens.values()`` and a pad id.
        loss_start: [b] index of each sample's first token to predict (tokens before it are
            context only); None: every token after the first.
        ignore_index: the label cross-entropy skips (PyTorch's default, -100).

    Returns:
        int64 labels [b, s].

    Raises:
        ValueError: ``tokens`` not ids [b, s]; ``loss_start`` not [b] integers on tokens'
            device; ``ignore_ids`` or ``ignore_index`` not integers.
    """
    check_token_ids(tokens)
    ignore_ids = list(ignore_ids)
    for value in [*ignore_ids, ignore_index]:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"ignore_ids, ignore_index: expected Python ints, got {value!r} "
                f"({type(value).__name__})"
            )
    batch, seq_len = tokens.shape
    targets = shift_targets(tokens.long(), ignore_index)
    ignored = torch.zeros_like(targets, dtype=torch.bool)
    ignored[:, -1:] = True
    if ignore_ids:
        ignored |= torch.isin(targets, torch.tensor(ignore_ids, device=tokens.device))
    if loss_start is not None:
        if (
            not isinstance(loss_start, torch.Tensor)
            or loss_start.shape != (batch,)
            or loss_start.dtype.is_floating_point
            or loss_start.dtype == torch.bool
            or loss_start.device != tokens.device
        ):
            got = describe(loss_start) if isinstance(loss_start, torch.Tensor) else loss_start
            raise ValueError(
                f"loss_start: expected integer indices [{batch}] on {tokens.device}, got {got}"
            )
        predicted = torch.arange(1, seq_len + 1, device=tokens.device)  # position t predicts t+1
        ignored |= predicted[None, :] < loss_start[:, None]
    return targets.masked_fill(ignored, ignore_index)


def masked_token_loss(
    logits: torch.Tensor | list[torch.Tensor], labels: torch.Tensor, *, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy over target positions, and how many there are.

    Divide the sums of all micro-batches of an optimizer step by the total count (known before
    the step, e.g. ``sum(batch.num_targets)``), not each by its own: then every target token
    weighs the same whatever batch it was packed or padded into, and the gradients are those
    of one big batch.

    Args:
        logits: [b, s, vocab] (upcast to float32), or the list of chunks along ``s`` a decoder
            with ``set_num_output_chunks`` returns.
        labels: int64 [b, s] targets, ``ignore_index`` where no loss belongs.
        ignore_index: the label skipped.

    Returns:
        (float32 scalar sum, int64 scalar count), both on ``labels``' device.

    Raises:
        ValueError: ``labels`` not integer [b, s] matching the logits' first two dimensions.
    """
    chunks = list(logits) if isinstance(logits, list | tuple) else [logits]
    if not chunks or any(chunk.dim() != 3 for chunk in chunks):
        raise ValueError("logits: expected [b, s, vocab] or a list of such chunks along s")
    batch = chunks[0].size(0)
    seq_len = sum(chunk.size(1) for chunk in chunks)
    if (
        labels.dim() != 2
        or labels.dtype.is_floating_point
        or labels.dtype == torch.bool
        or tuple(labels.shape) != (batch, seq_len)
    ):
        raise ValueError(
            f"labels: expected integer targets [{batch}, {seq_len}] (the logits' [b, s]), got "
            f"{describe(labels)}"
        )
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    start = 0
    for chunk in chunks:
        part = labels[:, start : start + chunk.size(1)]
        start += chunk.size(1)
        total = total + torch.nn.functional.cross_entropy(
            chunk.float().flatten(0, 1),
            part.long().flatten(),
            ignore_index=ignore_index,
            reduction="sum",
        )
    return total, (labels != ignore_index).sum()
