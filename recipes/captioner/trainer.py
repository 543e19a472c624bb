"""``python -m recipes.captioner``: train the captioner on generated shapes (or resume a run),
then caption the held-out images with the last checkpoint and check that its decoder loads
into a plain one; the rest is :mod:`fusion.training`'s."""

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from fusion import masked_token_loss, training
from fusion.training import Runtime, TrainingError
from recipes.captioner import model as models
from recipes.captioner.batching import CaptionDataset, encode_captions
from recipes.captioner.config import FIXED_GROUPS, TrainConfig, parse_args
from recipes.captioner.shapes import ShapesSplit, make_splits
from recipes.captioner.state import inspect_checkpoint, load_model, load_train_state, train_state

PROG = "python -m recipes.captioner"


@dataclass
class Setup:
    """What a run trains with, the same on every process."""

    config: TrainConfig
    runtime: Runtime
    dataset: CaptionDataset
    sampler: training.EpochSampler
    heldout: ShapesSplit
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    num_params: int


def setup(config: TrainConfig, runtime: Runtime) -> Setup:
    """Render the data, build the model (its initial weights from ``config.seed`` alone), wrap
    it for ``runtime`` and build the optimizer."""
    train_split, heldout = make_splits(
        config.seed, config.num_train, config.num_heldout, config.image_size
    )
    dataset = CaptionDataset(train_split, models.build_tokenizer(), models.tokens_per_image(config))
    torch.manual_seed(config.seed)
    model = models.build_model(config)
    num_params = sum(p.numel() for p in model.parameters())
    wrapped = training.wrap_model(model, runtime, config.parallel, per_module=False)
    optimizer, scheduler = models.build_optimizer(list(wrapped.parameters()), config)
    sampler = training.EpochSampler(len(dataset), config.seed)
    return Setup(
        config, runtime, dataset, sampler, heldout, wrapped, optimizer, scheduler, num_params
    )


def train_step(run: Setup, step: int) -> torch.Tensor:
    """One optimizer step on global batch ``step``, of which process ``r`` of ``n`` takes the
    ``r``-th of ``n`` slices; returns its mean loss per caption target (0-d on the device, not
    read back). The targets are counted over the global batch, on the host, so the loss does
    not depend on how the batch is split."""
    config, runtime = run.config, run.runtime
    world, local_batch = runtime.world_size, config.batch_size // runtime.world_size
    indices = run.sampler.indices(step * config.batch_size, config.batch_size)
    num_targets = run.dataset.count_targets(indices)
    mine = indices[runtime.rank * local_batch : (runtime.rank + 1) * local_batch]
    batch = run.dataset.batch(mine).to(runtime.device)
    logits = run.model(batch.tokens, encoder_input=models.image_input(batch.images))
    loss_sum, _ = masked_token_loss(logits, batch.labels)
    # Gradients are averaged over processes, hence the factor `world`.
    (loss_sum * (world / num_targets)).backward()
    return training.optimizer_step(
        runtime, run.model.parameters(), run.optimizer, run.scheduler,
        grad_clip=config.grad_clip, loss_sum=loss_sum, num_targets=num_targets,
    )  # fmt: skip


@dataclass
class TrainResult:
    """What a finished run hands to the report (``losses`` from step 1, resumed runs too)."""

    losses: list[float]
    checkpoint: Path
    heldout: ShapesSplit
    start_step: int
    train_seconds: float


def train(runtime: Runtime, start: training.Start[TrainConfig]) -> TrainResult:
    """Train (or continue from checkpoint ``start.resume``) to ``--steps``, checkpointing
    every ``--checkpoint-every`` steps and at the end; every process calls this."""
    config, output_dir, resume = start.config, start.output_dir, start.resume
    run = setup(config, runtime)
    start_step, losses = 0, []
    if resume is not None:  # weights, optimizer, schedule and this process's RNG states
        state = load_train_state(resume)
        training.resume_checkpoint(
            resume, state, run.model, run.optimizer, run.scheduler, runtime, total=config.steps
        )
        start_step, losses = state.step, list(state.losses)
        if start_step == config.steps:
            complete = f"the run is complete at step {start_step}; --steps N trains further"
            training.log(runtime, complete)
    parallel = f" ({config.parallel})" if runtime.distributed else ""
    training.log(
        runtime,
        f"model: {run.num_params:,} parameters; {len(run.dataset)} training and "
        f"{len(run.heldout)} held-out images; {runtime.world_size} process(es) on "
        f"{runtime.device}{parallel}",
    )
    root = training.checkpoint_root(output_dir)
    # The last checkpoint: the one resumed from, until the loop saves (always its last step).
    checkpoint = resume if resume is not None else training.step_dir(root, config.steps)
    pending: list[torch.Tensor] = []  # losses not read back yet: one host sync per log_every
    run.model.train()
    bar = training.progress_bar(
        runtime, total=config.steps, initial=start_step, enabled=config.progress
    )
    started = time.perf_counter()
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
                step=done, losses=losses, config=config, world_size=runtime.world_size,
                parallel=config.parallel if runtime.distributed else "none",
                scheduler=run.scheduler.state_dict(),
            )  # fmt: skip
            checkpoint = training.save_step(
                root, run.model, run.optimizer, state, runtime, keep=config.keep_checkpoints
            )
    bar.close()
    return TrainResult(losses, checkpoint, run.heldout, start_step, time.perf_counter() - started)


def final_report(
    runtime: Runtime, start: training.Start[TrainConfig], result: TrainResult, started: float
) -> int:
    """In this process alone: caption the held-out images with the last checkpoint, load its
    ``decoder.*`` with ``strict=True`` into a plain decoder and compare their text-only logits,
    and write the report files; returns 1 if the logits differ."""
    config, output_dir = start.config, start.output_dir
    checkpoint, heldout = result.checkpoint, result.heldout
    model, saved_config = load_model(checkpoint)
    model = model.to(runtime.device)
    predictions = models.greedy_captions(model, heldout.images, config.eval_batch_size)
    pairs = list(zip(predictions, heldout.captions, strict=True))
    correct = sum(p == t for p, t in pairs)
    accuracy = correct / len(heldout)  # exact match, word for word
    shown = pairs[: config.num_samples]
    print(f"\nsample generations (held-out, greedy, from {checkpoint}):")
    for predicted, truth in shown:
        extra = "" if predicted == truth else f"   (expected: {truth})"
        print(f"  [{'ok   ' if predicted == truth else 'WRONG'}] {predicted}{extra}")
    print(
        f"held-out exact match: {accuracy:.2%} ({correct}/{len(heldout)} captions) "
        "with greedy generation"
    )
    # Text-only sequences (no image placeholder): "describe: <caption> <eos>".
    texts = encode_captions(models.build_tokenizer(), heldout.captions[:16], 0)[0]
    build = partial(models.build_decoder, saved_config)
    equal, max_diff = training.compare_plain_decoder(
        checkpoint, model, build, texts.to(runtime.device)
    )
    print(
        f"decoder check: the checkpoint's decoder.* loaded with strict=True into a plain "
        f"TransformerDecoder; text-only logits of the fused model and the plain decoder "
        f"{'are bitwise equal' if equal else 'DIFFER'} "
        f"(max abs diff {max_diff:.3g}, {list(texts.shape)} tokens)"
    )

    steps_run, seconds = len(result.losses) - result.start_step, result.train_seconds
    total = time.perf_counter() - started
    # The metrics first: they are the result; the plot is optional.
    metrics = output_dir / "metrics.json"
    training.write_json(
        {
            "heldout_exact_match": accuracy,
            "heldout_size": len(heldout),
            "decoder_check_equal": equal,
            "losses": result.losses,
            "checkpoint": str(checkpoint),
            "steps_run": steps_run,
            "train_seconds": seconds,
            "total_seconds": total,
            "samples": [{"predicted": p, "expected": t} for p, t in shown],
        },
        metrics,
    )
    plot = training.plot_if_available(
        PROG, result.losses, output_dir / "loss.png", ylabel="cross-entropy on caption tokens",
        title=f"shapes captioning: held-out exact match {accuracy:.1%}",
    )  # fmt: skip
    rate = steps_run / seconds if seconds > 0 else float("nan")
    print(
        f"trained {steps_run} steps in {seconds:.1f}s ({rate:.1f} steps/s); total {total:.1f}s; "
        f"loss curve: {plot or 'none'}; metrics: {metrics}"
    )
    return 0 if equal else 1


def check_batch_split(world_size: int, config: TrainConfig, resume: Path | None) -> TrainConfig:
    """``config`` if its batch size splits over the ``world_size`` processes."""
    if config.batch_size % world_size:
        source = "" if resume is None else f" (the batch size of {resume.name})"
        raise TrainingError(
            f"--batch-size: expected a multiple of the {world_size} processes, "
            f"got {config.batch_size}{source}"
        )
    return config


def main(argv: list[str] | None = None) -> int:
    """Run the job; returns the exit status (:func:`fusion.training.run_job`'s; 2 for a bad
    command line, argparse's ``SystemExit``). An ``argv`` that is no list of str is a
    ``TypeError``."""
    started = time.perf_counter()
    training.config.check_argv(argv)
    config, given = parse_args(argv)

    def plan(runtime: Runtime) -> training.Start[TrainConfig]:
        # With --resume: the newest intact checkpoint, and the configuration it stores.
        output_dir = Path(config.output_dir or training.default_output_dir("shapes"))
        return training.plan_start(
            config, given, output_dir, prog=PROG, inspect=inspect_checkpoint,
            fixed_groups=FIXED_GROUPS, prepare=partial(check_batch_split, runtime.world_size),
        )  # fmt: skip

    report = partial(final_report, started=started)
    return training.run_recipe(PROG, config, TrainConfig, plan, train, report)
