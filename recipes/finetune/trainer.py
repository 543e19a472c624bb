"""The fine-tuning loop, in steps: :func:`setup` reads the data and builds what a run trains
with, :func:`train_step` is one optimizer step over its micro-batches, :func:`evaluate` the
eval loss, :func:`train` the loop with its checkpoints."""

import time
from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from fusion import chunked_token_loss, data, fused_token_loss, training
from fusion._wrappers import decoder_of
from fusion.checkpoint import CheckpointError
from fusion.checkpoint.hf_model import HfDirectory
from fusion.data import Batch, EncodedData, LoaderError, MicroBatches, StepBatches
from fusion.decoder import TransformerDecoder
from fusion.lora import lora_linears
from fusion.training import Runtime, Start, TrainingError, TrainState, log
from fusion.training.config import flag_errors
from fusion.training.fingerprint import model_fingerprint
from fusion.training.modules import checkpoint_activations, compile_layers, trainable_parameters
from fusion.training.steps import Step, plan_in_order, plan_steps
from recipes.finetune.config import SPEC, FinetuneConfig
from recipes.finetune.model import build_model


@dataclass
class Setup:
    """What a run trains with, the same on every process: its micro-batches (this process's
    share of each step, :class:`fusion.data.StepBatches`) and, while :func:`train` runs,
    ``stream``, which makes them ahead in ``--num-workers`` processes."""

    config: FinetuneConfig
    runtime: Runtime
    train_data: EncodedData
    plan: list[Step]
    model: nn.Module
    decoder: TransformerDecoder  # the wrapped model's own (its unembedding)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: StepBatches
    eval_batches: StepBatches | None = None
    stream: MicroBatches | None = None


def setup(config: FinetuneConfig, runtime: Runtime, given: Collection[str] = ()) -> Setup:
    """Read and encode the data (all of it checked first), build the model and optimizer;
    ``given``: the flags on the command line. Raises ``TrainingError`` naming the flag: a
    model directory, data file or ``--train`` mode that cannot be used."""
    assert config.model is not None and config.data is not None
    with flag_errors("--model", CheckpointError, data.ChatTemplateError, OSError, ValueError):
        directory = HfDirectory(config.model)  # config.json parsed once, for all of setup
        encoder = data.ConversationEncoder.from_directory(
            directory, template_variables=config.template_variables
        )

    def read(path: str, flag: str) -> EncodedData:  # the whole file checked
        with flag_errors(flag, data.DataError, ImportError):
            encoded = data.read_encoded(
                encoder, path, max_seq_len=config.max_seq_len, truncate=config.truncate,
                skip_bad=config.skip_bad_samples,
            )  # fmt: skip
        if summary := data.skipped_summary(encoded):
            log(runtime, f"{flag}: {summary}")
        return encoded

    train_data = read(config.data, "--data")
    eval_data = None if config.eval_data is None else read(config.eval_data, "--eval-data")
    lengths = [len(sample) for sample in train_data.samples]
    plan = plan_steps(
        lengths, batch_tokens=config.batch_tokens, seed=config.seed, epochs=config.epochs,
        steps=config.steps,
    )  # fmt: skip
    model = build_model(config, targets_given="lora_targets" in given, directory=directory)
    decoder = cast(TransformerDecoder, decoder_of(model))
    with flag_errors("--model", ValueError):
        pad_id = data.pad_token_id(encoder, decoder.vocab_size, config.model)
    if config.init_adapter is not None:
        log(
            runtime,
            f"--init-adapter {config.init_adapter}: rank {config.lora_rank}, alpha "
            f"{config.lora_alpha:g}, dropout {config.lora_dropout:g}, on "
            f"{len(lora_linears(model))} layers",
        )
    if config.train == "projector" and not data.has_images(train_data.samples):
        raise TrainingError("--train: 'projector' trains on images, but --data holds none")
    # DDP wants a gradient for every trained parameter at every step: with trained encoder
    # parameters, every micro-batch shows an image (a filler with no target if need be).
    filler = None
    encoders = (p for name, p in model.named_parameters() if name.startswith("encoders."))
    if runtime.distributed and config.parallel == "ddp" and any(p.requires_grad for p in encoders):
        if (filler := data.image_filler(train_data.samples)) is None:
            raise TrainingError(
                f"--parallel: 'ddp' with --train {config.train} trains the connector, which "
                "needs images in --data; use --parallel fsdp, or --train lora"
            )
    decoder.skip_output_layer = True  # hidden states for the chunked loss (_forward_loss)
    if config.activation_checkpointing:
        checkpoint_activations(model)
    if config.compile:
        compile_layers(model)
    if config.release_freed_memory and runtime.device.type == "cpu":
        training.release_freed_memory(model)
    wrapped = training.wrap_model(model, runtime, config.parallel)
    optimizer, scheduler = training.adamw_warmup_cosine(
        trainable_parameters(wrapped), lr=config.lr, weight_decay=config.weight_decay,
        warmup=config.warmup_steps, total=len(plan),
    )  # fmt: skip
    # Packed rows as long as the model takes: the attention sees each sample's boundaries,
    # not a [s, s] mask, so one long row costs what its samples do, and rows of
    # --max-seq-len would only add the padding after each row's last sample.
    row_tokens = max(config.max_seq_len, decoder.max_seq_len)
    collate = data.Collate(pad_id, row_tokens, config.packing, encoder)

    def share(encoded: EncodedData, plan: list[Step], micro_batches: int = 1) -> StepBatches:
        """This process's micro-batches of ``plan``."""
        return StepBatches(
            encoded.samples, [step.samples for step in plan], collate,
            micro_batches=micro_batches, world_size=runtime.world_size, rank=runtime.rank,
            filler=filler,
        )  # fmt: skip

    eval_batches = None
    if eval_data is not None:  # file order, --batch-tokens per step
        lengths = [len(sample) for sample in eval_data.samples]
        eval_batches = share(eval_data, plan_in_order(lengths, batch_tokens=config.batch_tokens))
    batches = share(train_data, plan, config.grad_accum)
    return Setup(
        config, runtime, train_data, plan, wrapped, decoder, optimizer, scheduler, batches,
        eval_batches,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ steps


def fused_loss(config: FinetuneConfig, runtime: Runtime) -> bool:
    """Whether the run's loss is :func:`fusion.fused_token_loss` (``--fused-loss``, on CPU in
    one process: its per-chunk backward of the output would make one collective a chunk
    under DDP or an FSDP2 output unit) rather than :func:`fusion.chunked_token_loss`."""
    return config.fused_loss and runtime.device.type == "cpu" and not runtime.distributed


def _forward_loss(run: Setup, batch: Batch, grad_scale: float | None = None) -> torch.Tensor:
    """The summed cross-entropy of ``batch``'s targets (0-d, float32), projected to the
    vocabulary only where a target is, no device sync: :func:`fusion.fused_token_loss` when
    :func:`fused_loss` and a ``grad_scale`` (the factor the sum is multiplied by before its
    backward) is given, else :func:`fusion.chunked_token_loss`."""
    enabled = run.config.dtype == "bfloat16"
    with torch.autocast(run.runtime.device.type, dtype=torch.bfloat16, enabled=enabled):
        hidden = run.model(**batch.model_inputs())
        if grad_scale is not None and fused_loss(run.config, run.runtime):
            loss_sum, _ = fused_token_loss(
                hidden, batch.labels, run.decoder.unembed, grad_scale=grad_scale,
                num_targets=batch.num_targets,
            )  # fmt: skip
        else:
            loss_sum, _ = chunked_token_loss(
                hidden, batch.labels, run.decoder.unembed, num_targets=batch.num_targets
            )
    return loss_sum


def train_step(run: Setup, step: int) -> tuple[torch.Tensor, int, int]:
    """One optimizer step on ``run.plan[step]`` over its ``grad_accum`` micro-batches from
    ``run.stream``, the gradients accumulated by tokens (:func:`fusion.training.accumulate_step`);
    returns its mean loss per target token (0-d on the device, summed over processes, not read
    back) and the host's counts of its real tokens and batch slots."""
    config, runtime = run.config, run.runtime
    assert run.stream is not None
    samples = run.train_data.samples
    num_targets = sum(samples[i].num_targets for i in run.plan[step].samples)
    # accumulate_step's factor on each micro-batch's sum: the fused loss's gradient scale.
    grad_scale = runtime.world_size / num_targets
    loss_sum, tokens, slots = training.accumulate_step(
        run.stream, step, config.grad_accum, partial(_forward_loss, run, grad_scale=grad_scale),
        num_targets=num_targets, runtime=runtime,
    )  # fmt: skip
    loss = training.optimizer_step(
        runtime, trainable_parameters(run.model), run.optimizer, run.scheduler,
        grad_clip=config.grad_clip, loss_sum=loss_sum, num_targets=num_targets,
    )  # fmt: skip
    return loss, tokens, slots


def evaluate(run: Setup) -> float | None:
    """The mean loss per target token over the eval data (:func:`fusion.training.mean_loss`),
    or None without eval data; an eval image that can no longer be read is a TrainingError."""
    if run.eval_batches is None:
        return None
    try:
        return training.mean_loss(
            run.model, run.eval_batches, partial(_forward_loss, run), run.runtime
        )
    except LoaderError as error:
        if error.died:  # a worker of the training's loader
            raise
        raise TrainingError(f"--eval-data: {error}", local=True) from None


# ------------------------------------------------------------------------------------ the loop


@dataclass
class TrainResult:
    """What a finished run hands to the report (token counts over every process)."""

    losses: list[float]
    eval_losses: list[tuple[int, float]]
    checkpoint: Path
    start_step: int
    total_steps: int
    train_seconds: float
    tokens: int
    slots: int
    data: EncodedData


def train(
    runtime: Runtime, start: Start[FinetuneConfig], given: Collection[str] = ()
) -> TrainResult:
    """Train to the end of the plan (or continue from ``start.resume``), checkpoint every
    ``--checkpoint-every`` steps and at the end; every process calls this. ``given``: the
    flags on the command line (:func:`setup`). Raises ``TrainingError``: bad data or model
    (before any step), a checkpoint that does not fit, an image that can no longer be read or
    a dead data loader worker (the checkpoints saved before are intact)."""
    config, output_dir, resume = start.config, start.output_dir, start.resume
    run = setup(config, runtime, given)
    total = len(run.plan)
    start_step, losses, eval_losses = 0, [], []
    if resume is None:  # dropout's random numbers, from --seed (a resumed run restores them)
        torch.manual_seed(config.seed)
    else:
        state = training.load_train_state(resume, SPEC.from_json)
        training.check_base_model(resume, state, cast(str, config.model))
        training.check_plan_position(resume, state, run.plan)
        training.resume_checkpoint(
            resume, state, run.model, run.optimizer, run.scheduler, runtime, total=total
        )
        start_step, losses, eval_losses = state.step, list(state.losses), list(state.eval_losses)
    num_params = sum(p.numel() for p in run.model.parameters())
    num_trained = sum(p.numel() for p in trainable_parameters(run.model))
    log(
        runtime,
        f"model: {num_params:,} parameters, {num_trained:,} trained ({config.train}); "
        f"{len(run.train_data.samples)} conversations, {total} steps; "
        f"{runtime.world_size} process(es) on {runtime.device}"
        + (f" ({config.parallel})" if runtime.distributed else ""),
    )
    root = training.checkpoint_root(output_dir)
    checkpoint = resume if resume is not None else root
    # A lora or projector run's checkpoints hold only what trains, and the base they need.
    base_model = None if config.train == "full" else model_fingerprint(config.model or "")
    pending: list[torch.Tensor] = []  # losses not read back yet
    tokens = slots = 0
    run.model.train()
    started = time.perf_counter()
    bar = training.progress_bar(runtime, total=total, initial=start_step, enabled=config.progress)
    # The loader makes the next micro-batches in --num-workers processes while one trains.
    run.stream = MicroBatches(
        run.batches, start=start_step * config.grad_accum, num_workers=config.num_workers,
        device=runtime.device,
    )  # fmt: skip
    try:
        with run.stream:
            for step in range(start_step, total):
                loss, step_tokens, step_slots = train_step(run, step)
                pending.append(loss)
                tokens, slots = tokens + step_tokens, slots + step_slots
                done = step + 1
                save = done % config.checkpoint_every == 0 or done == total
                evaluate_now = save or (config.eval_every and done % config.eval_every == 0)
                if save or evaluate_now or done % 10 == 0:
                    losses += torch.stack(pending).tolist()
                    pending.clear()
                    rate = tokens * runtime.world_size / max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
                bar.update(1)
                if evaluate_now and (value := evaluate(run)) is not None:
                    eval_losses.append((done, value))
                    log(runtime, f"step {done}: eval loss {value:.4f}")
                if save:
                    seen, epoch = training.plan_position(run.plan, done)
                    state = TrainState(
                        step=done, samples_seen=seen, epoch=epoch, losses=losses,
                        config=SPEC.to_json(config), world_size=runtime.world_size,
                        parallel=config.parallel if runtime.distributed else "none",
                        scheduler=run.scheduler.state_dict(), eval_losses=eval_losses,
                        base_model=base_model,
                    )  # fmt: skip
                    checkpoint = training.save_step(
                        root, run.model, run.optimizer, state, runtime,
                        keep=config.keep_checkpoints, trainable_only=base_model is not None,
                    )  # fmt: skip
    except LoaderError as error:
        if not error.died:
            raise TrainingError(f"--data: {error}", local=True) from None
        raise TrainingError(
            f"--num-workers: {error}; the checkpoints saved before are intact (--resume "
            "continues from the newest)",
            local=True,
        ) from None
    finally:
        run.stream = None
        bar.close()
    seconds = time.perf_counter() - started
    if runtime.distributed:  # every process's real tokens and slots
        counts = torch.tensor([tokens, slots], device=runtime.device, dtype=torch.float64)
        dist.all_reduce(counts)
        tokens, slots = int(counts[0]), int(counts[1])
    return TrainResult(
        losses, eval_losses, checkpoint, start_step, total, seconds, tokens, slots, run.train_data
    )
