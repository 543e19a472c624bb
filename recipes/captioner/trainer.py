"""``python -m recipes.captioner``: train the captioner on generated shapes (or resume a run),
then caption the held-out images with the last checkpoint and check that its decoder loads
into a plain one; the rest is :mod:`fusion.training`'s."""

import time
from functools import partial
from pathlib import Path

import torch

from fusion import masked_token_loss, training
from fusion.training import Runtime
from recipes.captioner import model as models
from recipes.captioner.batching import CaptionDataset, encode_captions
from recipes.captioner.config import FIXED_GROUPS, TrainConfig, parse_args
from recipes.captioner.shapes import make_splits
from recipes.captioner.state import inspect_checkpoint, load_model, load_train_state, train_state

PROG = "python -m recipes.captioner"


class Run:
    """A run on this process: its data, model (initial weights from ``--seed`` alone) and
    optimizer, the same on every process; then how far :meth:`train` took it."""

    def __init__(self, config: TrainConfig, runtime: Runtime) -> None:
        self.config, self.runtime = config, runtime
        train_split, self.heldout = make_splits(
            config.seed, config.num_train, config.num_heldout, config.image_size
        )
        tokens_per_image = models.tokens_per_image(config)
        self.dataset = CaptionDataset(train_split, models.build_tokenizer(), tokens_per_image)
        torch.manual_seed(config.seed)
        model = models.build_model(config)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.model = training.wrap_model(model, runtime, config.parallel, per_module=False)
        self.optimizer, self.scheduler = models.build_optimizer(self.model.parameters(), config)
        self.sampler = training.EpochSampler(len(self.dataset), config.seed)
        self.losses: list[float] = []  # one per step from step 1, a resumed run's included
        self.start_step, self.train_seconds = 0, 0.0

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step on global batch ``step`` (process ``r`` of ``n`` takes its ``r``-th
        slice); returns the mean loss per caption target of the whole batch (0-d on the device,
        not read back), the same however the batch is split."""
        config, runtime = self.config, self.runtime
        world, local_batch = runtime.world_size, config.batch_size // runtime.world_size
        indices = self.sampler.indices(step * config.batch_size, config.batch_size)
        num_targets = self.dataset.count_targets(indices)
        mine = indices[runtime.rank * local_batch : (runtime.rank + 1) * local_batch]
        batch = self.dataset.batch(mine, runtime.device)
        logits = self.model(batch.tokens, encoder_input=models.image_input(batch.images))
        loss_sum, _ = masked_token_loss(logits, batch.labels)
        # Gradients are averaged over processes, hence the factor `world`.
        (loss_sum * (world / num_targets)).backward()
        return training.optimizer_step(
            runtime, self.model.parameters(), self.optimizer, self.scheduler,
            grad_clip=config.grad_clip, loss_sum=loss_sum, num_targets=num_targets,
        )  # fmt: skip

    def train(self, output_dir: Path, resume: Path | None) -> "Run":
        """Train (or continue from checkpoint ``resume``) to ``--steps``, checkpointing every
        ``--checkpoint-every`` steps and at the end; every process calls this."""
        config, runtime = self.config, self.runtime
        if resume is not None:  # weights, optimizer, schedule and this process's RNG states
            state = load_train_state(resume)
            training.resume_checkpoint(
                resume, state, self.model, self.optimizer, self.scheduler, runtime,
                total=config.steps,
            )  # fmt: skip
            self.start_step, self.losses = state.step, list(state.losses)
            if self.start_step == config.steps:
                complete = f"the run is complete at step {state.step}; --steps N trains further"
                training.log(runtime, complete)
        parallel = f" ({config.parallel})" if runtime.distributed else ""
        training.log(
            runtime,
            f"model: {self.num_params:,} parameters; {len(self.dataset)} training and "
            f"{len(self.heldout)} held-out images; {runtime.world_size} process(es) on "
            f"{runtime.device}{parallel}",
        )
        root = training.checkpoint_root(output_dir)
        # The last checkpoint: the one resumed from, until the loop saves (always its last step).
        self.checkpoint = resume if resume is not None else training.step_dir(root, config.steps)
        pending: list[torch.Tensor] = []  # losses not read back yet: one host sync per log_every
        self.model.train()
        bar = training.progress_bar(
            runtime, total=config.steps, initial=self.start_step, enabled=config.progress
        )
        started = time.perf_counter()
        for step in range(self.start_step, config.steps):
            pending.append(self.train_step(step))
            done = step + 1
            save = done % config.checkpoint_every == 0 or done == config.steps
            if save or done % config.log_every == 0:
                self.losses += torch.stack(pending).tolist()
                pending.clear()
                bar.set_postfix(loss=f"{self.losses[-1]:.4f}", refresh=False)
            bar.update(1)
            if save:
                state = train_state(
                    step=done, losses=self.losses, config=config, world_size=runtime.world_size,
                    parallel=config.parallel if runtime.distributed else "none",
                    scheduler=self.scheduler.state_dict(),
                )  # fmt: skip
                self.checkpoint = training.save_step(
                    root, self.model, self.optimizer, state, runtime, keep=config.keep_checkpoints
                )
        bar.close()
        self.train_seconds = time.perf_counter() - started
        return self


def final_report(
    runtime: Runtime, start: training.Start[TrainConfig], run: Run, started: float
) -> int:
    """In this process alone: caption the held-out images with the last checkpoint, check its
    decoder against a plain one and write the report files; 1 if the decoder's logits differ."""
    config, output_dir = start.config, start.output_dir
    checkpoint, heldout = run.checkpoint, run.heldout
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

    steps_run, seconds = len(run.losses) - run.start_step, run.train_seconds
    total = time.perf_counter() - started
    # The metrics first: they are the result; the plot is optional.
    metrics = output_dir / "metrics.json"
    training.write_json(
        {
            "heldout_exact_match": accuracy,
            "heldout_size": len(heldout),
            "decoder_check_equal": equal,
            "losses": run.losses,
            "checkpoint": str(checkpoint),
            "steps_run": steps_run,
            "train_seconds": seconds,
            "total_seconds": total,
            "samples": [{"predicted": p, "expected": t} for p, t in shown],
        },
        metrics,
    )
    plot = training.plot_if_available(
        PROG, run.losses, output_dir / "loss.png", ylabel="cross-entropy on caption tokens",
        title=f"shapes captioning: held-out exact match {accuracy:.1%}",
    )  # fmt: skip
    rate = steps_run / seconds if seconds > 0 else float("nan")
    print(
        f"trained {steps_run} steps in {seconds:.1f}s ({rate:.1f} steps/s); total {total:.1f}s; "
        f"loss curve: {plot or 'none'}; metrics: {metrics}"
    )
    return 0 if equal else 1


def main(argv: list[str] | None = None) -> int:
    """Run the job; returns its exit status (:func:`fusion.training.run_job`'s, 2 for bad flags)."""
    started = time.perf_counter()
    training.config.check_argv(argv)
    config, given = parse_args(argv)

    def plan(runtime: Runtime) -> training.Start[TrainConfig]:
        # With --resume: the newest intact checkpoint, and the configuration it stores.
        output_dir = Path(config.output_dir or training.default_output_dir("shapes"))
        prepare = partial(training.check_batch_split, runtime.world_size)
        return training.plan_start(
            config, given, output_dir, prog=PROG, inspect=inspect_checkpoint,
            fixed_groups=FIXED_GROUPS, prepare=prepare,
        )  # fmt: skip

    def train(runtime: Runtime, start: training.Start[TrainConfig]) -> Run:
        return Run(start.config, runtime).train(start.output_dir, start.resume)

    report = partial(final_report, started=started)
    return training.run_recipe(PROG, config, TrainConfig, plan, train, report)
