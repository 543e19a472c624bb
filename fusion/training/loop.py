"""The pieces of a training loop that the recipes share: resuming and saving a checkpoint
with their log lines, and the end of an optimizer step."""

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fusion.training.checkpoint import restore_checkpoint, save_checkpoint
from fusion.training.distributed import Runtime
from fusion.training.report import log
from fusion.training.state import TrainState


def resume_checkpoint(
    path: Path,
    state: TrainState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    runtime: Runtime,
    *,
    total: int,
) -> None:
    """:func:`~fusion.training.restore_checkpoint` of ``path`` (train state ``state``) into
    the run, collectively, and say so on the main process: the step, of ``total``, and how
    many processes saved it and resume it.

    Raises:
        TrainingError: a file of the checkpoint is damaged or does not fit the run.
    """
    restore_checkpoint(
        path, state, model, optimizer, scheduler, rank=runtime.rank, device=runtime.device
    )
    log(
        runtime,
        f"resumed from {path} at step {state.step} of {total} (saved by "
        f"{state.world_size} process(es), now {runtime.world_size})",
    )


def save_step(
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    runtime: Runtime,
    *,
    keep: int,
    trainable_only: bool = False,
) -> Path:
    """:func:`~fusion.training.save_checkpoint` of the run at ``state`` under ``root``,
    collectively, and say so on the main process with the step's loss; returns the
    checkpoint's directory.

    Raises:
        OSError: it cannot be written (every earlier checkpoint is intact).
    """
    device = runtime.device
    path = save_checkpoint(
        root, model, optimizer, state, device=device, keep=keep, trainable_only=trainable_only
    )
    log(runtime, f"saved checkpoint {path} (step {state.step}, loss {state.losses[-1]:.4f})")
    return path


def optimizer_step(
    runtime: Runtime,
    parameters: Iterable[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    grad_clip: float,
    loss_sum: torch.Tensor,
    num_targets: int,
) -> torch.Tensor:
    """The end of an optimizer step whose gradients are in: clip their global norm to
    ``grad_clip`` (0: no clipping), step the optimizer and the schedule, drop the gradients.
    Returns the step's mean loss per target, ``loss_sum`` (this process's, 0-d) over the
    ``num_targets`` of every process, summed over processes: on the device, not read back, so
    no host sync."""
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    step_loss = loss_sum.detach() / num_targets
    if runtime.distributed:
        dist.all_reduce(step_loss)
    return step_loss
