"""The fine-tuning loop, in steps: :func:`setup` reads the data and builds what a run trains
with, :func:`train_step` is one optimizer step over its micro-batches, :func:`evaluate` the
eval loss, :func:`train` the loop with its checkpoints."""

import dataclasses
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from fusion import chunked_token_loss
from fusion._wrappers import decoder_of
from fusion.checkpoint import CheckpointError
from fusion.checkpoint.files import read_json
from fusion.data import (
    Batch,
    ChatTemplateError,
    Collate,
    ConversationEncoder,
    DataError,
    EncodedData,
    LoaderError,
    MicroBatches,
    StepBatches,
    encode_conversations,
    has_images,
    image_filler,
    read_conversations,
)
from fusion.decoder import TransformerDecoder
from fusion.lora import apply_lora, lora_linears
from fusion.training import (
    Runtime,
    TrainingError,
    TrainState,
    checkpoint_root,
    log,
    one_line,
    optimizer_step,
    progress_bar,
    resume_checkpoint,
    save_step,
    warmup_cosine,
    wrap_model,
)
from fusion.training.fingerprint import fingerprint_changes, model_fingerprint
from fusion.training.modules import (
    checkpoint_activations,
    compile_layers,
    trainable_parameters,
)
from fusion.training.steps import Step, plan_in_order, plan_steps
from recipes.finetune.config import FinetuneConfig, config_to_json
from recipes.finetune.model import load_base_model, load_init_adapter, set_trainable


def read_data(
    encoder: ConversationEncoder, path: str, config: FinetuneConfig, flag: str
) -> EncodedData:
    """Read, check and encode a whole data file before any training.

    ``path`` is JSON Lines or a Hugging Face data set (a Parquet file, a directory of them, a
    ``save_to_disk`` directory: :func:`fusion.data.read_conversations`).

    Raises:
        TrainingError: one line naming the file, line (or row) and problem (unless
            ``--skip-bad-samples``), a file with no usable conversation, or a data set
            without the ``data`` extra installed.
    """
    try:
        read = read_conversations(path, skip_bad=config.skip_bad_samples)
        encoded = encode_conversations(
            encoder,
            read.conversations,
            max_seq_len=config.max_seq_len,
            truncate=config.truncate,
            skip_bad=config.skip_bad_samples,
        )
    except (DataError, ImportError) as error:
        raise TrainingError(f"{flag}: {one_line(error)}") from None
    return dataclasses.replace(encoded, skipped=[*read.skipped, *encoded.skipped])


def trains_base(config: FinetuneConfig) -> bool:
    """Whether checkpoints hold the whole model (``--train full``); with ``lora`` and
    ``projector`` they hold only what trains, and the frozen base comes from ``--model``."""
    return config.train == "full"


def check_base_model(path: Path, state: TrainState, config: FinetuneConfig) -> None:
    """Refuse checkpoint ``path`` (train state ``state``) that holds only trained tensors
    when ``--model`` is no longer the base it was trained on (its weight files'
    fingerprint, :func:`fusion.training.fingerprint.model_fingerprint`).

    Raises:
        TrainingError: naming the checkpoint and the files that changed.
    """
    if not state.trainable_only:
        return  # the whole model is in the checkpoint
    assert config.model is not None
    if state.base_model is None:
        raise TrainingError(
            f"--resume: {path} holds only the trained tensors but no fingerprint of its base "
            "model, so --model cannot be checked"
        )
    changes = fingerprint_changes(state.base_model, model_fingerprint(config.model))
    if changes:
        raise TrainingError(
            f"--resume: {path} holds only the trained tensors of a run on another base "
            f"model: in --model {config.model}, {'; '.join(changes)} since it was saved; "
            "resume with the model directory it was trained on"
        )


@dataclass
class Setup:
    """What a run trains with, the same on every process: its micro-batches (this process's
    share of each step, :class:`fusion.data.StepBatches`) and, while :func:`train` runs,
    ``stream``, which makes them ahead in ``--num-workers`` processes."""

    config: FinetuneConfig
    runtime: Runtime
    train_data: EncodedData
    eval_data: EncodedData | None
    plan: list[Step]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    num_params: int
    num_trainable: int
    batches: StepBatches
    eval_batches: StepBatches | None = None
    stream: MicroBatches | None = None
    decoder: TransformerDecoder | None = None


def _pad_id(encoder: ConversationEncoder, vocab: int, directory: str) -> int:
    """The tokenizer's pad token (else its EOS, else 0): padding is never attended to by a
    real token nor a target, so any id in the model's vocabulary ``[0, vocab)`` does.

    Raises:
        TrainingError: the token's id (``tokenizer.json``'s) lies outside the vocabulary, which
            no embedding can take: naming the file and key it comes from (the EOS token is
            not taken instead: a pad token that does not fit is a broken directory).
    """
    tokens = encoder.template.special_tokens
    for key in ("pad_token", "eos_token"):
        if key in tokens and (found := encoder.tokenizer.token_to_id(tokens[key])) is not None:
            if not 0 <= found < vocab:
                raise TrainingError(
                    f"--model: {_special_token_source(directory, key)} {key} "
                    f"{tokens[key]!r} is id {found} in tokenizer.json, outside the model's "
                    f"vocabulary [0, {vocab}) (config.json vocab_size): no embedding row pads "
                    f"with it; set {key} to a token of the vocabulary"
                )
            return int(found)
    return 0


def _special_token_source(directory: str, key: str) -> str:
    """The file :func:`fusion.data.load_special_tokens` took special token ``key`` from."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = Path(directory) / name
        try:
            if file.exists() and key in read_json(file, name):
                return name
        except (CheckpointError, OSError, TypeError):
            continue
    return "the tokenizer's"


def build_model(config: FinetuneConfig, *, targets_given: bool = False) -> nn.Module:
    """The base model with what ``--train`` trains (LoRA adapters seeded by ``--seed``, or
    ``--init-adapter``'s; ``targets_given``: check ``--lora-targets`` against them), in
    float32 on CPU, unwrapped."""
    model = load_base_model(config)
    set_trainable(model, config)
    if config.train == "lora" and config.init_adapter is not None:
        load_init_adapter(model, config, targets_given)
    elif config.train == "lora":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            try:
                apply_lora(
                    model,
                    config.lora_target_list,
                    rank=config.lora_rank,
                    alpha=config.lora_alpha,
                    dropout=config.lora_dropout,
                )
            except ValueError as error:
                raise TrainingError(f"--lora-targets: {one_line(error)}") from None
    return model


def setup(config: FinetuneConfig, runtime: Runtime, given: Collection[str] = ()) -> Setup:
    """Read and encode the data (all of it checked first), build the model and optimizer;
    ``given``: the flags on the command line (``--lora-targets`` given is checked against
    ``--init-adapter``'s layers)."""
    assert config.model is not None and config.data is not None
    try:
        encoder = ConversationEncoder.from_directory(config.model)
    except (CheckpointError, ChatTemplateError, OSError, ValueError) as error:
        raise TrainingError(f"--model: {one_line(error)}") from None
    train_data = read_data(encoder, config.data, config, "--data")
    eval_data = None
    if config.eval_data is not None:
        eval_data = read_data(encoder, config.eval_data, config, "--eval-data")
    for name, data in (("--data", train_data), ("--eval-data", eval_data)):
        if data is not None and (data.skipped or data.truncated):
            log(
                runtime,
                f"{name}: {len(data.samples)} conversations; skipped {len(data.skipped)} bad "
                f"ones, truncated {data.truncated}"
                + (f" (first skipped: {data.skipped[0]})" if data.skipped else ""),
            )
    lengths = [len(sample) for sample in train_data.samples]
    plan = plan_steps(
        lengths,
        batch_tokens=config.batch_tokens,
        seed=config.seed,
        epochs=config.epochs,
        steps=config.steps,
    )
    model = build_model(config, targets_given="lora_targets" in given)
    decoder = decoder_of(model)
    assert decoder is not None
    pad_id = _pad_id(encoder, decoder.vocab_size, config.model)
    if config.init_adapter is not None:
        log(
            runtime,
            f"--init-adapter {config.init_adapter}: rank {config.lora_rank}, alpha "
            f"{config.lora_alpha:g}, dropout {config.lora_dropout:g}, on "
            f"{len(lora_linears(model))} layers",
        )
    if config.train == "projector" and not has_images(train_data.samples):
        raise TrainingError("--train: 'projector' trains on images, but --data holds none")
    num_params = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in trainable_parameters(model))
    # DDP wants a gradient for every trained parameter at every step: with trained encoder
    # parameters, every micro-batch shows an image (a filler with no target if need be).
    filler = None
    encoders_train = any(
        p.requires_grad for n, p in model.named_parameters() if n.startswith("encoders.")
    )
    if runtime.distributed and config.parallel == "ddp" and encoders_train:
        filler = image_filler(train_data.samples)
        if filler is None:
            raise TrainingError(
                f"--parallel: 'ddp' with --train {config.train} trains the connector, which "
                "needs images in --data; use --parallel fsdp, or --train lora"
            )
    decoder.skip_output_layer = True  # hidden states for the chunked loss (_forward_loss)
    if config.activation_checkpointing:
        checkpoint_activations(model)
    if config.compile:
        compile_layers(model)
    wrapped = wrap_model(model, runtime, config.parallel)
    optimizer = torch.optim.AdamW(
        trainable_parameters(wrapped),
        lr=config.lr,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
    )
    scheduler = warmup_cosine(optimizer, config.warmup_steps, len(plan))
    collate = Collate(pad_id, config.max_seq_len, config.packing, encoder)

    def share(data: EncodedData, steps: list[Step], micro_batches: int = 1) -> StepBatches:
        """This process's micro-batches of ``steps``."""
        indices = [step.samples for step in steps]
        return StepBatches(
            data.samples,
            indices,
            collate,
            micro_batches=micro_batches,
            world_size=runtime.world_size,
            rank=runtime.rank,
            filler=filler,
        )

    eval_batches = None
    if eval_data is not None:  # file order, --batch-tokens per step
        lengths = [len(sample) for sample in eval_data.samples]
        eval_batches = share(eval_data, plan_in_order(lengths, batch_tokens=config.batch_tokens))
    return Setup(
        config,
        runtime,
        train_data,
        eval_data,
        plan,
        wrapped,
        optimizer,
        scheduler,
        num_params,
        num_trainable,
        share(train_data, plan, config.grad_accum),
        eval_batches,
        decoder=decoder,
    )


# ------------------------------------------------------------------------------------ steps


def _forward_loss(run: Setup, batch: Batch) -> torch.Tensor:
    """The summed cross-entropy of ``batch``'s targets (0-d, float32): the model returns
    hidden states (``skip_output_layer``), which are projected to the vocabulary only where a
    target is, a chunk at a time (:func:`fusion.chunked_token_loss`; the count is the host's,
    so there is no device sync)."""
    enabled = run.config.dtype == "bfloat16"
    with torch.autocast(run.runtime.device.type, dtype=torch.bfloat16, enabled=enabled):
        hidden = run.model(**batch.model_inputs())
        unembed = cast(TransformerDecoder, run.decoder).unembed  # the wrapped model's own
        return chunked_token_loss(hidden, batch.labels, unembed, num_targets=batch.num_targets)[0]


@dataclass
class StepStats:
    """Host-side counts of one step (no device sync): real tokens and batch slots."""

    tokens: int = 0
    slots: int = 0


def train_step(run: Setup, step: int) -> tuple[torch.Tensor, StepStats]:
    """One optimizer step on ``run.plan[step]``, over its micro-batches from ``run.stream``;
    returns its mean loss per target token (0-d on the device, summed over processes, not
    read back) and its token counts.

    The step's samples are dealt into ``grad_accum`` micro-batches per process
    (:class:`fusion.data.StepBatches`). Each micro-batch's summed loss is divided by the
    step's number of targets over all processes (known on the host), so gradients accumulate
    by tokens and do not depend on how the step is split; processes average gradients, hence
    the factor ``world``.
    """
    config, runtime = run.config, run.runtime
    assert run.stream is not None
    samples = run.train_data.samples
    num_targets = sum(samples[i].num_targets for i in run.plan[step].samples)
    total = torch.zeros((), device=runtime.device)
    stats = StepStats()
    for _ in range(config.grad_accum):
        item = next(run.stream)  # made ahead by the loader's workers
        assert item.step == step, f"the loader is at step {item.step}, the loop at {step}"
        if item.batch is None:
            continue
        loss_sum = _forward_loss(run, item.batch)
        (loss_sum * (runtime.world_size / num_targets)).backward()
        total += loss_sum.detach()
        stats.tokens += item.tokens
        stats.slots += item.batch.tokens.numel()
    parameters = trainable_parameters(run.model)
    loss = optimizer_step(
        runtime,
        parameters,
        run.optimizer,
        run.scheduler,
        grad_clip=config.grad_clip,
        loss_sum=total,
        num_targets=num_targets,
    )
    return loss, stats


@torch.no_grad()
def evaluate(run: Setup) -> float | None:
    """The mean loss per target token over the eval data (every process takes its share),
    or None without eval data. Its batches are made in this process, as they are needed.

    Raises:
        TrainingError: an eval image that can no longer be read.
    """
    if run.eval_batches is None:
        return None
    device = run.runtime.device
    run.model.eval()
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # loss, targets
    try:
        with MicroBatches(run.eval_batches, device=device) as stream:
            for item in stream:
                if item.batch is not None:
                    sums[0] += _forward_loss(run, item.batch).double()
                    sums[1] += item.batch.num_targets
    except LoaderError as error:
        if error.died:  # a worker of the training's loader
            raise
        raise TrainingError(f"--eval-data: {error}") from None
    finally:
        run.model.train()
    if run.runtime.distributed:
        dist.all_reduce(sums)
    return float(sums[0] / sums[1])


# ------------------------------------------------------------------------------------ the loop


@dataclass
class TrainResult:
    """What a finished run hands to the report."""

    losses: list[float]
    eval_losses: list[tuple[int, float]]
    checkpoint: Path
    start_step: int
    total_steps: int
    train_seconds: float
    tokens: int
    slots: int
    num_samples: int
    skipped: int
    truncated: int


def _position(run: Setup, step: int) -> tuple[int, int]:
    """(samples seen, epoch) after ``step`` steps."""
    seen = sum(len(s.samples) for s in run.plan[:step])
    epoch = run.plan[step].epoch if step < len(run.plan) else run.plan[-1].epoch + 1
    return seen, epoch


def train(
    config: FinetuneConfig,
    runtime: Runtime,
    output_dir: Path,
    resume: tuple[Path, TrainState] | None,
    given: Collection[str] = (),
) -> TrainResult:
    """Train to the end of the plan (or continue from checkpoint ``resume``), checkpoint every
    ``--checkpoint-every`` steps and at the end; every process calls this. ``given``: the
    flags on the command line (:func:`setup`).

    Raises:
        TrainingError: bad data or model (before any step), a checkpoint that does not fit, an
            image that can no longer be read or a data loader worker that died (the
            checkpoints saved before are intact).
    """
    run = setup(config, runtime, given)
    total = len(run.plan)
    start_step, losses, eval_losses = 0, [], []
    if resume is None:  # dropout's random numbers, from --seed (a resumed run restores them)
        torch.manual_seed(config.seed)
    else:
        path, state = resume
        check_base_model(path, state, config)
        expected = _position(run, state.step)
        if state.step > total or (state.samples_seen, state.epoch) != expected:
            raise TrainingError(
                f"--resume: {path} is at step {state.step} (samples {state.samples_seen}, "
                f"epoch {state.epoch}), which the run's data plan of {total} steps does not "
                f"have (expected samples {expected[0]}, epoch {expected[1]}): was --data changed?"
            )
        resume_checkpoint(
            path, state, run.model, run.optimizer, run.scheduler, runtime, total=total
        )
        start_step, losses, eval_losses = state.step, list(state.losses), list(state.eval_losses)
    log(
        runtime,
        f"model: {run.num_params:,} parameters, {run.num_trainable:,} trained ({config.train}); "
        f"{len(run.train_data.samples)} conversations, {total} steps; "
        f"{runtime.world_size} process(es) on {runtime.device}"
        + (f" ({config.parallel})" if runtime.distributed else ""),
    )
    root = checkpoint_root(output_dir)
    checkpoint = resume[0] if resume is not None else root
    base_model = None if trains_base(config) else model_fingerprint(config.model or "")
    pending: list[torch.Tensor] = []
    tokens = slots = 0
    run.model.train()
    started = time.perf_counter()
    bar = progress_bar(runtime, total=total, initial=start_step, enabled=config.progress)
    # The loader makes the next micro-batches in --num-workers processes while one trains.
    run.stream = MicroBatches(
        run.batches,
        start=start_step * config.grad_accum,
        num_workers=config.num_workers,
        device=runtime.device,
    )
    try:
        with run.stream:
            for step in range(start_step, total):
                loss, stats = train_step(run, step)
                pending.append(loss)
                tokens, slots = tokens + stats.tokens, slots + stats.slots
                done = step + 1
                save = done % config.checkpoint_every == 0 or done == total
                evaluate_now = save or (config.eval_every and done % config.eval_every == 0)
                if save or evaluate_now or done % 10 == 0:
                    losses += torch.stack(pending).tolist()
                    pending.clear()
                    rate = tokens * runtime.world_size / max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
                bar.update(1)
                if evaluate_now and run.eval_data is not None:
                    value = evaluate(run)
                    assert value is not None
                    eval_losses.append((done, value))
                    log(runtime, f"step {done}: eval loss {value:.4f}")
                if save:
                    seen, epoch = _position(run, done)
                    state = TrainState(
                        step=done,
                        samples_seen=seen,
                        epoch=epoch,
                        losses=losses,
                        config=config_to_json(config),
                        world_size=runtime.world_size,
                        parallel=config.parallel if runtime.distributed else "none",
                        scheduler=run.scheduler.state_dict(),
                        eval_losses=eval_losses,
                        base_model=base_model,
                    )
                    keep, only = config.keep_checkpoints, base_model is not None
                    checkpoint = save_step(
                        root,
                        run.model,
                        run.optimizer,
                        state,
                        runtime,
                        keep=keep,
                        trainable_only=only,
                    )
    except LoaderError as error:
        if not error.died:
            raise TrainingError(f"--data: {error}") from None
        raise TrainingError(
            f"--num-workers: {error}; the checkpoints saved before are intact (--resume "
            "continues from the newest)"
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
        losses,
        eval_losses,
        checkpoint,
        start_step,
        total,
        seconds,
        tokens,
        slots,
        len(run.train_data.samples),
        len(run.train_data.skipped),
        run.train_data.truncated,
    )
