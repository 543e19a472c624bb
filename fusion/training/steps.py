"""Token-budget steps: which samples each optimizer step trains on, and how a step splits
over processes and micro-batches: a pure function of the sample lengths, the seed and the
settings, so every process computes the same plan and a resumed run (on any number of
processes) continues it exactly."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Step:
    """One optimizer step: the samples (indices into the training set) and its epoch."""

    samples: tuple[int, ...]
    epoch: int


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The samples of ``epoch`` in a random order fixed by ``seed`` and ``epoch``."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def plan_steps(
    lengths: Sequence[int], *, batch_tokens: int, seed: int, epochs: int, steps: int
) -> list[Step]:
    """The run's steps: each epoch visits every sample once in :func:`epoch_order`, cut into
    steps of whole samples holding at most ``batch_tokens`` tokens each (a step never spans
    two epochs). ``steps`` > 0: that many steps (epochs repeat as needed); else ``epochs``
    epochs.

    Raises:
        ValueError: no sample, or a sample longer than ``batch_tokens``.
    """
    if not lengths:
        raise ValueError("lengths: expected at least one sample")
    if max(lengths) > batch_tokens:
        raise ValueError(f"batch_tokens: a sample of {max(lengths)} tokens does not fit")
    plan: list[Step] = []
    epoch = 0
    while (len(plan) < steps) if steps > 0 else (epoch < epochs):
        current: list[int] = []
        tokens = 0
        for index in epoch_order(len(lengths), seed, epoch):
            if current and tokens + lengths[index] > batch_tokens:
                plan.append(Step(tuple(current), epoch))
                current, tokens = [], 0
            current.append(index)
            tokens += lengths[index]
        plan.append(Step(tuple(current), epoch))
        epoch += 1
    return plan[:steps] if steps > 0 else plan


def split_step(samples: Sequence[int], lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Deal a step's samples into ``parts`` groups of about equal tokens: longest first, each
    to the group with the fewest tokens so far (ties: the lower group). Each group keeps the
    step's order. Group ``k`` is micro-batch ``k // world`` of process ``k % world``."""
    loads = [0] * parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(samples, key=lambda i: (-lengths[i], i)):
        target = min(range(parts), key=lambda g: (loads[g], g))
        groups[target].append(index)
        loads[target] += lengths[index]
    order = {index: position for position, index in enumerate(samples)}
    return [sorted(group, key=order.__getitem__) for group in groups]
