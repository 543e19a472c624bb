"""Which samples each optimizer step trains on: a pure function of the sample lengths
(token-budget steps, :func:`plan_steps`) or of the position alone (fixed-size batches,
:class:`EpochSampler`), the seed and the settings, so every process computes the same plan and
a resumed run (on any number of processes) continues it exactly. How a step splits over
processes and micro-batches, as purely, is the data loader's
(:func:`fusion.data.loader.split_step`)."""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# The data loader deals each step over processes and micro-batches, so split_step lives there
# (fusion.data stands below fusion.training); still importable from here, its old home.
from fusion.data.loader import split_step as split_step
from fusion.training.errors import TrainingError
from fusion.training.state import TrainState


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


def plan_position(plan: Sequence[Step], step: int) -> tuple[int, int]:
    """(samples seen, epoch) after the first ``step`` steps of ``plan``: the data position a
    checkpoint at ``step`` records (``TrainState.samples_seen`` and ``epoch``)."""
    seen = sum(len(s.samples) for s in plan[:step])
    epoch = plan[step].epoch if step < len(plan) else plan[-1].epoch + 1
    return seen, epoch


def check_plan_position(
    path: Path, state: TrainState, plan: Sequence[Step], *, flag: str = "--data"
) -> None:
    """Refuse checkpoint ``path`` (its train state ``state``) when ``plan``, the resumed run's
    plan of the data ``flag`` gave, does not reach its step at its data position
    (:func:`plan_position`): the data or the settings that cut it into steps changed.

    Raises:
        TrainingError: naming the checkpoint, its position and the plan's.
    """
    expected = plan_position(plan, state.step)
    if state.step > len(plan) or (state.samples_seen, state.epoch) != expected:
        raise TrainingError(
            f"--resume: {path} is at step {state.step} (samples {state.samples_seen}, "
            f"epoch {state.epoch}), which the run's data plan of {len(plan)} steps does not "
            f"have (expected samples {expected[0]}, epoch {expected[1]}): was {flag} changed?"
        )


def plan_in_order(lengths: Sequence[int], *, batch_tokens: int) -> list[Step]:
    """One pass over the samples in their order (e.g. evaluation's), cut into steps of whole
    samples holding at most ``batch_tokens`` tokens each; a longer sample is a step alone."""
    plan: list[Step] = []
    current: list[int] = []
    tokens = 0
    for index, length in enumerate(lengths):
        if current and tokens + length > batch_tokens:
            plan.append(Step(tuple(current), 0))
            current, tokens = [], 0
        current.append(index)
        tokens += length
    return [*plan, Step(tuple(current), 0)] if current else plan


class EpochSampler:
    """Fixed-size batches' sample order: each epoch in :func:`epoch_order`.

    The order is a pure function of ``(seed, num_samples)``, so the data position is just the
    number of samples consumed; a resumed or re-sharded run reads the same samples.

    Raises:
        ValueError: ``num_samples`` is not positive.
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples: expected a positive count, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self._cache: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._cache:  # only the current epoch is kept
            order = epoch_order(self.num_samples, self.seed, epoch)
            self._cache = {epoch: torch.tensor(order, dtype=torch.long)}
        return self._cache[epoch]

    def indices(self, start: int, count: int) -> torch.Tensor:
        """The sample indices at global positions ``start .. start + count - 1`` [count].

        Raises:
            ValueError: ``start`` or ``count`` is negative.
        """
        if start < 0 or count < 0:
            raise ValueError(f"start, count: expected non-negative values, got {start}, {count}")
        out = []
        position = start
        while position < start + count:
            epoch, offset = divmod(position, self.num_samples)
            take = min(self.num_samples - offset, start + count - position)
            out.append(self._permutation(epoch)[offset : offset + take])
            position += take
        return torch.cat(out) if out else torch.empty(0, dtype=torch.long)
