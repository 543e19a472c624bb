"""Losses over micro-batches (fusion.training.accumulate): a step's gradients accumulated by
target tokens are those of its mean loss however it is split, skipped micro-batches run
nothing, and the mean loss over a data set's micro-batches is taken in eval mode."""

from types import SimpleNamespace

import pytest
import torch

from fusion.data import IGNORE_INDEX, Collate, MicroBatch, Sample, StepBatches
from fusion.training import Runtime, accumulate_step, mean_loss

CPU = torch.device("cpu")


def runtime(world_size: int = 1) -> Runtime:
    return Runtime(rank=0, world_size=world_size, local_rank=0, device=CPU, distributed=False)


def rows(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, 3, generator=torch.Generator().manual_seed(seed))


def micro(step: int, inputs: torch.Tensor | None, tokens: int = 0) -> MicroBatch:
    """A micro-batch whose batch stands in for fusion.data's: ``tokens`` its inputs [n, 3]."""
    batch = None if inputs is None else SimpleNamespace(tokens=inputs)
    return MicroBatch(step, 0, batch, tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("split", [(6,), (2, 4), (1, 2, 3)])
def test_the_gradients_are_the_mean_loss_s_however_the_step_is_split(split):
    inputs = rows(6, 0)
    reference = torch.nn.Linear(3, 1)
    (reference(inputs).square().sum() / inputs.size(0)).backward()

    model = torch.nn.Linear(3, 1)
    model.load_state_dict(reference.state_dict())
    parts = torch.split(inputs, list(split))
    stream = iter([micro(5, part, tokens=10 * len(part)) for part in parts])
    total, tokens, slots = accumulate_step(
        stream, 5, len(parts), lambda batch: model(batch.tokens).square().sum(),
        num_targets=6, runtime=runtime(),
    )  # fmt: skip
    assert model.weight.grad is not None and reference.weight.grad is not None
    torch.testing.assert_close(model.weight.grad, reference.weight.grad)
    torch.testing.assert_close(total, reference(inputs).square().sum().detach())
    assert not total.requires_grad
    assert (tokens, slots) == (60, 18)  # the real tokens counted, the slots the batches' numel


def test_skipped_micro_batches_run_nothing_and_processes_scale_the_gradients():
    model = torch.nn.Linear(3, 1)
    calls = []

    def loss_sum(batch):
        calls.append(batch)
        return model(batch.tokens).sum()

    stream = iter([micro(0, None), micro(0, rows(2, 1), tokens=2), micro(1, None)])
    total, tokens, _ = accumulate_step(stream, 0, 2, loss_sum, num_targets=4, runtime=runtime(2))
    assert len(calls) == 1 and tokens == 2
    torch.testing.assert_close(total, model(rows(2, 1)).sum().detach())
    # Averaged over 2 processes later, each process's gradient is scaled by 2 / num_targets.
    expected = rows(2, 1).sum(0, keepdim=True) * 2 / 4
    assert model.weight.grad is not None
    torch.testing.assert_close(model.weight.grad, expected)
    assert next(stream).step == 1  # the next step's micro-batch is left in the stream
    none_run, _, _ = accumulate_step(
        iter([micro(3, None)]), 3, 1, loss_sum, num_targets=1, runtime=runtime()
    )
    assert float(none_run) == 0.0 and len(calls) == 1


def test_a_step_without_targets_is_refused():
    with pytest.raises(ValueError, match="num_targets: expected a positive count, got 0"):
        accumulate_step(iter([]), 0, 1, lambda batch: torch.zeros(()), num_targets=0,
                        runtime=runtime())  # fmt: skip


def sample(length: int, tag: int) -> Sample:
    tokens = torch.full((length,), tag, dtype=torch.int64)
    labels = tokens.clone()
    labels[-1] = IGNORE_INDEX  # length - 1 targets
    return Sample(tokens, labels, torch.empty(0), f"data.jsonl:{tag}")


@pytest.mark.parametrize("packing", [True, False])
def test_the_mean_loss_is_taken_over_every_target_in_eval_mode(packing):
    samples = [sample(2 + i % 3, tag=i + 1) for i in range(7)]
    batches = StepBatches(samples, [(0, 1, 2), (3, 4), (5, 6)], Collate(0, 8, packing))
    model = torch.nn.Linear(1, 1)
    modes = []

    def loss_sum(batch):  # each target's loss is its token's tag
        modes.append(model.training)
        return batch.tokens[batch.labels != IGNORE_INDEX].double().sum()

    value = mean_loss(model, batches, loss_sum, runtime())
    targets = [(len(s) - 1, int(s.tokens[0])) for s in samples]
    assert value == pytest.approx(sum(n * tag for n, tag in targets) / sum(n for n, _ in targets))
    assert modes == [False] * 3 and model.training
