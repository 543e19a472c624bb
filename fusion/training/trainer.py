"""The training loop: data order, loss on caption tokens, checkpoints, resume and progress."""

import dataclasses
import math
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fusion.data import IGNORE_INDEX, CaptionDataset, EpochSampler, ShapesSplit, make_splits
from fusion.training.checkpoint import (
    checkpoint_root,
    load_train_state,
    load_training_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from fusion.training.config import TrainConfig
from fusion.training.distributed import Runtime, wrap_model
from fusion.training.errors import TrainingError
from fusion.training.model import build_model, build_tokenizer, image_input, tokens_per_image
from fusion.training.train_state import match_saved

try:
    from tqdm import tqdm
except ImportError:  # part of the optional `train` extra: without it, no progress bar
    tqdm = None

INSTALL_TRAIN_EXTRA = "pip install -e '.[train]'"


@dataclass
class TrainResult:
    """What a finished run hands to the report: per-step losses (from step 1, resumed runs
    included), the last checkpoint, the held-out split, and timings of this process's steps."""

    losses: list[float]
    checkpoint: Path
    heldout: ShapesSplit
    start_step: int
    train_seconds: float


def log(runtime: Runtime, message: str) -> None:
    """Print on the main process only, without breaking the progress bar."""
    if runtime.is_main:
        if tqdm is None:
            print(message)
        else:
            tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()


def progress_unavailable() -> str | None:
    """Why there can be no progress bar, or None."""
    if tqdm is None:
        return f"no progress bar: tqdm is not installed; install it with: {INSTALL_TRAIN_EXTRA}"
    return None


class _NoBar:
    """The progress bar's interface, doing nothing (bar off, or tqdm not installed)."""

    def set_postfix(self, **kwargs: object) -> None:
        pass

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


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


def check_resume_state(path: Path, state: dict) -> None:
    """Check the scheduler state and optimizer hyper-parameters of checkpoint ``path``'s train
    state (:func:`load_train_state`) against those :func:`train` builds, so that a damaged one
    is found before resuming.

    Raises:
        TrainingError: naming the file and the key that does not fit.
    """
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer, scheduler = build_optimizer([param], TrainConfig(**state["config"]))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    match_saved(path, "optimizer.param_groups", state["optimizer"]["param_groups"], groups)
    match_saved(path, "scheduler", state["scheduler"], scheduler.state_dict())


def train(
    config: TrainConfig, runtime: Runtime, output_dir: Path, resume: Path | None
) -> TrainResult:
    """Train (or continue training) and checkpoint; every process calls this.

    The data order is a function of the seed and the step alone: at step ``t`` the global batch
    is samples ``t * batch_size`` to ``(t + 1) * batch_size - 1`` of the epoch permutations, and
    process ``r`` of ``n`` takes the ``r``-th of ``n`` equal slices. The loss is the sum of the
    cross-entropies of every caption target in the *global* batch over their count (known on the
    host, no communication), so it does not depend on how the batch is split.

    ``config.batch_size`` must be a multiple of the number of processes (checked by the CLI).

    Raises:
        TrainingError: a checkpoint whose data position disagrees with its step.
    """
    world, rank, device = runtime.world_size, runtime.rank, runtime.device
    local_batch = config.batch_size // world
    tokenizer = build_tokenizer()
    train_split, heldout = make_splits(
        config.seed, config.num_train, config.num_heldout, config.image_size
    )
    dataset = CaptionDataset(train_split, tokenizer, tokens_per_image(config))
    sampler = EpochSampler(len(dataset), config.seed)

    torch.manual_seed(config.seed)  # the model's initial weights depend on the seed alone
    model = build_model(config)
    num_params = sum(p.numel() for p in model.parameters())
    model = wrap_model(model, runtime, config.parallel)
    optimizer, scheduler = build_optimizer(model.parameters(), config)

    start_step, losses = 0, []
    if resume is not None:
        state = load_train_state(resume)
        if state["samples_seen"] != state["step"] * config.batch_size:
            raise TrainingError(
                f"checkpoint {resume}: data position {state['samples_seen']} samples does not "
                f"match step {state['step']} x batch size {config.batch_size}"
            )
        # Checked against the live scheduler's own state before anything is loaded.
        scheduler_state = match_saved(
            resume, "scheduler", state["scheduler"], scheduler.state_dict()
        )
        load_training_checkpoint(resume, model, optimizer, state)
        scheduler.load_state_dict(scheduler_state)
        restore_rng_state(state["rng"], rank, device)
        start_step, losses = state["step"], list(state["losses"])
        log(
            runtime,
            f"resumed from {resume} at step {start_step} (saved by "
            f"{state['world_size']} process(es), now {world})",
        )
    log(
        runtime,
        f"model: {num_params:,} parameters; {len(dataset)} training and {len(heldout)} held-out "
        f"images; {world} process(es) on {device}"
        + (f" ({config.parallel})" if runtime.distributed else ""),
    )

    root = checkpoint_root(output_dir)
    checkpoint = resume
    pending: list[torch.Tensor] = []  # losses not read back yet: one host sync per log_every
    model.train()
    show = runtime.is_main and config.progress and tqdm is not None
    bar = (
        tqdm(
            total=config.steps,
            initial=start_step,
            desc="training",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )
        if show
        else _NoBar()
    )
    start = time.perf_counter()
    for step in range(start_step, config.steps):
        indices = sampler.indices(step * config.batch_size, config.batch_size)
        num_targets = dataset.count_targets(indices)
        batch = dataset.batch(indices[rank * local_batch : (rank + 1) * local_batch]).to(device)
        logits = model(batch.tokens, encoder_input=image_input(batch.images))
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        # Gradients are averaged over processes, hence the factor `world`.
        (loss_sum * (world / num_targets)).backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        step_loss = loss_sum.detach() / num_targets
        if runtime.distributed:
            dist.all_reduce(step_loss)
        pending.append(step_loss)
        done = step + 1
        save = done % config.checkpoint_every == 0 or done == config.steps
        if save or done % config.log_every == 0:
            losses += torch.stack(pending).tolist()
            pending.clear()
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        bar.update(1)
        if save:
            checkpoint = save_checkpoint(
                root,
                done,
                model,
                optimizer,
                {
                    "step": done,
                    "samples_seen": done * config.batch_size,
                    "epoch": done * config.batch_size // len(dataset),
                    "scheduler": scheduler.state_dict(),
                    "losses": losses,
                    "config": dataclasses.asdict(config),
                    "world_size": world,
                    "parallel": config.parallel if runtime.distributed else "none",
                },
                device=device,
                keep=config.keep_checkpoints,
            )
            log(runtime, f"saved checkpoint {checkpoint} (step {done}, loss {losses[-1]:.4f})")
    bar.close()
    return TrainResult(losses, checkpoint, heldout, start_step, time.perf_counter() - start)
