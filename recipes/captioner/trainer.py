"""The training loop, in steps: :func:`setup` builds what a run trains with, :func:`resume_from`
restores a checkpoint into it, :func:`train_step` is one optimizer step, :func:`train` runs the
loop and checkpoints :class:`fusion.training.TrainState` (:mod:`fusion.training` does the
process setup, checkpoints and progress bar)."""

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fusion.training import (
    Runtime,
    TrainState,
    checkpoint_root,
    log,
    match_saved,
    progress_bar,
    restore_checkpoint,
    save_checkpoint,
    step_dir,
    wrap_model,
)
from recipes.captioner.batching import IGNORE_INDEX, CaptionDataset, EpochSampler
from recipes.captioner.config import TrainConfig
from recipes.captioner.model import build_model, build_tokenizer, image_input, tokens_per_image
from recipes.captioner.shapes import ShapesSplit, make_splits
from recipes.captioner.state import load_train_state, train_state


@dataclass
class TrainResult:
    """What a finished run hands to the report: per-step losses (from step 1, resumed runs
    included), the last checkpoint, the held-out split, and timings of this process's steps."""

    losses: list[float]
    checkpoint: Path
    heldout: ShapesSplit
    start_step: int
    train_seconds: float


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[torch.nn.Parameter], config: TrainConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and its schedule: linear warm-up, then cosine decay to 0 at ``config.steps``."""
    optimizer = torch.optim.AdamW(
        params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )

    def schedule(step: int) -> float:
        return lr_factor(step, config.warmup_steps, config.steps)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def check_resume_state(path: Path, state: TrainState) -> None:
    """Check the scheduler state and optimizer hyper-parameters of checkpoint ``path``'s train
    state against those :func:`setup` builds, so that a damaged one is found before resuming.

    Raises:
        TrainingError: naming the file and the key that does not fit.
    """
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer, scheduler = build_optimizer([param], state.config)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    match_saved(path, "optimizer.param_groups", state.param_groups, groups)
    match_saved(path, "scheduler", state.scheduler, scheduler.state_dict())


@dataclass
class Setup:
    """What a run trains with, the same on every process: the encoded training split and its
    order, the held-out split, the (wrapped) model, its optimizer and schedule."""

    config: TrainConfig
    runtime: Runtime
    dataset: CaptionDataset
    sampler: EpochSampler
    heldout: ShapesSplit
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    num_params: int


def setup(config: TrainConfig, runtime: Runtime) -> Setup:
    """Render the data, build the model (its initial weights depend on ``config.seed`` alone),
    wrap it for ``runtime`` and build the optimizer."""
    tokenizer = build_tokenizer()
    train_split, heldout = make_splits(
        config.seed, config.num_train, config.num_heldout, config.image_size
    )
    dataset = CaptionDataset(train_split, tokenizer, tokens_per_image(config))
    torch.manual_seed(config.seed)
    model = build_model(config)
    num_params = sum(p.numel() for p in model.parameters())
    wrapped = wrap_model(model, runtime, config.parallel, per_module=False)
    optimizer, scheduler = build_optimizer(wrapped.parameters(), config)
    sampler = EpochSampler(len(dataset), config.seed)
    return Setup(
        config, runtime, dataset, sampler, heldout, wrapped, optimizer, scheduler, num_params
    )


def resume_from(run: Setup, checkpoint: Path) -> TrainState:
    """Load checkpoint ``checkpoint`` into ``run`` (weights, optimizer, schedule and this
    process's RNG states), collectively; returns its train state.

    Raises:
        TrainingError: a file of the checkpoint is damaged or does not fit ``run``; checked
            before anything is loaded.
    """
    state = load_train_state(checkpoint)
    runtime = run.runtime
    restore_checkpoint(
        checkpoint,
        state,
        run.model,
        run.optimizer,
        run.scheduler,
        rank=runtime.rank,
        device=runtime.device,
    )
    return state


def train_step(run: Setup, step: int) -> torch.Tensor:
    """One optimizer step on global batch ``step``; returns its mean loss per caption target
    (a 0-d tensor on the device, summed over processes; not read back, so no host sync).

    The global batch is samples ``step * batch_size`` to ``(step + 1) * batch_size - 1`` of the
    sampler's order; process ``r`` of ``n`` takes the ``r``-th of ``n`` equal slices. The loss
    is the sum of the cross-entropies of every caption target in the *global* batch over their
    count (known on the host, no communication), so it does not depend on how the batch is
    split.
    """
    config, runtime = run.config, run.runtime
    world, rank = runtime.world_size, runtime.rank
    local_batch = config.batch_size // world
    indices = run.sampler.indices(step * config.batch_size, config.batch_size)
    num_targets = run.dataset.count_targets(indices)
    mine = indices[rank * local_batch : (rank + 1) * local_batch]
    batch = run.dataset.batch(mine).to(runtime.device)
    logits = run.model(batch.tokens, encoder_input=image_input(batch.images))  # [b, s, vocab]
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    # Gradients are averaged over processes, hence the factor `world`.
    (loss_sum * (world / num_targets)).backward()
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)

    step_loss = loss_sum.detach() / num_targets
    if runtime.distributed:
        dist.all_reduce(step_loss)
    return step_loss


def train(
    config: TrainConfig, runtime: Runtime, output_dir: Path, resume: Path | None
) -> TrainResult:
    """Train (or continue training from checkpoint ``resume``) to ``config.steps`` and
    checkpoint every ``config.checkpoint_every`` steps and at the end; every process calls
    this.

    ``config.batch_size`` must be a multiple of the number of processes (checked by the CLI).

    Raises:
        TrainingError: checkpoint ``resume`` is damaged or does not fit ``config``.
    """
    run = setup(config, runtime)
    start_step, losses = 0, []
    if resume is not None:
        state = resume_from(run, resume)
        start_step, losses = state.step, list(state.losses)
        log(
            runtime,
            f"resumed from {resume} at step {start_step} of {config.steps} (saved by "
            f"{state.world_size} process(es), now {runtime.world_size})",
        )
        if start_step == config.steps:
            log(runtime, f"the run is complete at step {start_step}; --steps N trains further")
    log(
        runtime,
        f"model: {run.num_params:,} parameters; {len(run.dataset)} training and "
        f"{len(run.heldout)} held-out images; {runtime.world_size} process(es) on "
        f"{runtime.device}" + (f" ({config.parallel})" if runtime.distributed else ""),
    )

    root = checkpoint_root(output_dir)
    # The last checkpoint: the one resumed from, until the loop saves (always its last step).
    checkpoint = resume if resume is not None else step_dir(root, config.steps)
    pending: list[torch.Tensor] = []  # losses not read back yet: one host sync per log_every
    run.model.train()
    bar = progress_bar(runtime, total=config.steps, initial=start_step, enabled=config.progress)
    start = time.perf_counter()
    for step in range(start_step, config.steps):
        pending.append(train_step(run, step))
        done = step + 1
        save = done % config.checkpoint_every == 0 or done == config.steps
        if save or done % config.log_every == 0:
            losses += torch.stack(pending).tolist()
            pending.clear()
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        bar.update(1)
        if save:
            state = train_state(
                step=done,
                losses=losses,
                config=config,
                world_size=runtime.world_size,
                parallel=config.parallel if runtime.distributed else "none",
                scheduler=run.scheduler.state_dict(),
            )
            checkpoint = save_checkpoint(
                root,
                run.model,
                run.optimizer,
                state,
                device=runtime.device,
                keep=config.keep_checkpoints,
            )
            log(runtime, f"saved checkpoint {checkpoint} (step {done}, loss {losses[-1]:.4f})")
    bar.close()
    return TrainResult(losses, checkpoint, run.heldout, start_step, time.perf_counter() - start)
