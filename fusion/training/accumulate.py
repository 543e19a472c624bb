"""Losses over micro-batches made ahead (:class:`fusion.data.MicroBatches`): a step's gradients
accumulated by target tokens (:func:`accumulate_step`), and the mean loss over a data set
(:func:`mean_loss`). The loss is the recipe's, a function of a batch to its summed loss over
the batch's targets; the target counts are the host's, so neither needs a device sync but
for :func:`mean_loss`'s result.

    num_targets = sum(samples[i].num_targets for i in plan[step].samples)  # every process's
    loss_sum, tokens, slots = accumulate_step(stream, step, grad_accum, summed_loss,
                                              num_targets=num_targets, runtime=runtime)
    loss = optimizer_step(runtime, params, optimizer, scheduler, grad_clip=1.0,
                          loss_sum=loss_sum, num_targets=num_targets)
"""

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fusion.data import Batch, MicroBatch, MicroBatches, StepBatches
from fusion.training.distributed import Runtime


def accumulate_step(
    stream: Iterator[MicroBatch],
    step: int,
    micro_batches: int,
    loss_sum: Callable[[Batch], torch.Tensor],
    *,
    num_targets: int,
    runtime: Runtime,
) -> tuple[torch.Tensor, int, int]:
    """Forward and backward the next ``micro_batches`` micro-batches of ``stream``, step
    ``step``'s (one this process skips, its ``batch`` None, runs nothing).

    Each micro-batch's ``loss_sum(batch)`` (0-d) is divided by ``num_targets``, the step's
    targets over every process, before its backward, so the gradients accumulate by tokens
    and do not depend on how the step is split; processes average gradients, hence the factor
    ``runtime.world_size``.

    Returns:
        This process's summed loss (0-d on ``runtime.device``, detached, not read back), the
        real tokens of its micro-batches and their batch slots (the host's counts).

    Raises:
        ValueError: ``num_targets`` not positive (a step with no target has no mean loss).
        LoaderError: a micro-batch could not be made (:class:`fusion.data.MicroBatches`).
    """
    if num_targets < 1:
        raise ValueError(f"num_targets: expected a positive count, got {num_targets!r}")
    total = torch.zeros((), device=runtime.device)
    tokens = slots = 0
    for _ in range(micro_batches):
        item = next(stream)  # made ahead by the loader's workers
        assert item.step == step, f"the loader is at step {item.step}, the loop at {step}"
        if item.batch is None:
            continue
        summed = loss_sum(item.batch)
        (summed * (runtime.world_size / num_targets)).backward()
        total += summed.detach()
        tokens, slots = tokens + item.tokens, slots + item.batch.tokens.numel()
    return total, tokens, slots


@torch.no_grad()
def mean_loss(
    model: nn.Module,
    batches: StepBatches,
    loss_sum: Callable[[Batch], torch.Tensor],
    runtime: Runtime,
) -> float:
    """The mean loss per target over ``batches`` (this process's share of a data set, every
    process calling with its own): ``loss_sum(batch)`` summed over the micro-batches, made in
    this process as they are needed, over their targets, both summed over processes. ``model``
    is in eval mode meanwhile, and in train mode after.

    Raises:
        LoaderError: a micro-batch could not be made (:class:`fusion.data.MicroBatches`).
    """
    model.eval()
    sums = torch.zeros(2, device=runtime.device, dtype=torch.float64)  # loss, targets
    try:
        with MicroBatches(batches, device=runtime.device) as stream:
            for item in stream:
                if item.batch is not None:
                    sums[0] += loss_sum(item.batch).double()
                    sums[1] += item.batch.num_targets
    finally:
        model.train()
    if runtime.distributed:
        dist.all_reduce(sums)
    return float(sums[0] / sums[1])
