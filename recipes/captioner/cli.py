"""``python -m recipes.captioner``: train, checkpoint, evaluate and check the early-fusion model."""

import dataclasses
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusion.checkpoint import select_prefix
from fusion.training import (
    INSTALL_TRAIN_EXTRA,
    Runtime,
    TrainingError,
    TrainState,
    agree_on_rank0,
    check_writable,
    checkpoint_root,
    init_runtime,
    latest_checkpoint,
    log,
    newest_intact_checkpoint,
    one_line,
    plot_losses,
    plotting_unavailable,
    progress_unavailable,
    read_model_state_dict,
    set_aside_damaged,
    shutdown,
    write_json,
)
from recipes.captioner.batching import encode_captions
from recipes.captioner.config import TrainConfig, parse_args, resumed_config
from recipes.captioner.evaluate import exact_match, greedy_captions
from recipes.captioner.model import build_decoder, build_tokenizer, tokens_per_image
from recipes.captioner.train_checkpoint import inspect_checkpoint, load_model
from recipes.captioner.trainer import TrainResult, check_resume_state, train

PROG = "python -m recipes.captioner"


def default_output_dir() -> Path:
    base = Path("runs") / time.strftime("shapes-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def warn(message: str) -> None:
    """One line on stderr, as the job's errors are."""
    print(f"{PROG}: warning: {_flat(message)}", file=sys.stderr, flush=True)


def _flat(message: object) -> str:
    """``message`` on one line, even with a newline in a path it names."""
    return " ".join(str(message).splitlines())


def inspect_for_resume(path: Path) -> TrainState:
    """Check every file of checkpoint ``path`` (:func:`inspect_checkpoint`) and that its
    scheduler and optimizer state fit what :func:`~recipes.captioner.trainer.setup` builds
    (:func:`check_resume_state`); returns its train state.

    Raises:
        TrainingError: naming the file (and key) that is damaged or does not fit.
    """
    state = inspect_checkpoint(path)
    check_resume_state(path, state)
    return state


@dataclass(frozen=True)
class Start:
    """Where a run starts: its configuration (a resumed run's restored from its checkpoint,
    :func:`resumed_config`), its output directory and the checkpoint it resumes from."""

    config: TrainConfig
    output_dir: Path
    resume: Path | None


def plan_start(config: TrainConfig, given: Collection[str], world_size: int) -> Start:
    """Check the output directory and, with ``--resume``, find the checkpoint and restore its
    configuration; then create the directory (a new run) or set damaged checkpoints aside.

    With ``--resume``, the checkpoint is the newest intact one: newer damaged ones are
    reported with a warning and renamed to ``step_<N>.damaged``, never deleted.

    Args:
        config: the command line's configuration.
        given: the names of the fields given as flags.
        world_size: the number of processes, which must divide the batch size.

    Raises:
        TrainingError: the path is not a directory or not writable; a new run would write
            into a directory that already holds checkpoints; ``--resume`` finds no intact
            checkpoint, or flags that would change the run; the batch size does not split
            over the processes. Nothing on disk is changed in any of these cases.
    """
    output_dir = Path(config.output_dir) if config.output_dir else default_output_dir()
    try:
        return _plan_start(config, given, world_size, output_dir)
    except OSError as error:
        raise TrainingError(
            f"--output-dir: cannot use {output_dir} ({error.strerror or error})"
        ) from None


def _plan_start(
    config: TrainConfig, given: Collection[str], world_size: int, output_dir: Path
) -> Start:
    if output_dir.exists() and not output_dir.is_dir():
        raise TrainingError(f"--output-dir: {output_dir} exists and is not a directory")
    root = checkpoint_root(output_dir)
    if not config.resume:
        latest = latest_checkpoint(root)
        if latest is not None:
            raise TrainingError(
                f"--output-dir: {output_dir} already holds checkpoints (latest: {latest.name}); "
                "pass --resume to continue that run, or choose another --output-dir "
                "(nothing was changed)"
            )
        _check_batch_split(config.batch_size, world_size, "")
        check_writable(output_dir, root)
        return Start(config, output_dir, None)

    resume, state, damaged = newest_intact_checkpoint(root, inspect_for_resume)
    config = resumed_config(config, given, state.config, state.step)
    _check_batch_split(config.batch_size, world_size, f" (the batch size of {resume.name})")
    check_writable(output_dir, root)
    set_aside_damaged(damaged, resume, warn)
    return Start(config, output_dir, resume)


def _check_batch_split(batch_size: int, world_size: int, source: str) -> None:
    if batch_size % world_size:
        raise TrainingError(
            f"--batch-size: expected a multiple of the {world_size} processes, "
            f"got {batch_size}{source}"
        )


def agree_on_start(config: TrainConfig, given: Collection[str], runtime: Runtime) -> Start:
    """Rank 0 plans the start (:func:`plan_start`); every rank gets its verdict, so all
    processes run the same configuration, or fail alike with the same message."""

    def encode(start: Start) -> tuple[dict[str, Any], str, str | None]:
        resume = None if start.resume is None else str(start.resume)
        return dataclasses.asdict(start.config), str(start.output_dir), resume

    def decode(verdict: tuple[dict[str, Any], str, str | None]) -> Start:
        value, output_dir, resume = verdict
        return Start(
            TrainConfig(**value), Path(output_dir), None if resume is None else Path(resume)
        )

    return agree_on_rank0(
        runtime, lambda: plan_start(config, given, runtime.world_size), encode, decode
    )


def decoder_check(
    model: torch.nn.Module, config: TrainConfig, checkpoint: Path, texts: torch.Tensor
) -> tuple[bool, float]:
    """Load the checkpoint's ``decoder.`` part with ``strict=True`` into a plain decoder built
    from the same config and compare its logits with the fused model's on text-only ``texts``
    [b, s]. Returns (bitwise equal, max abs difference)."""
    with torch.random.fork_rng(devices=[]):
        plain = build_decoder(config)
    decoder_state = select_prefix(read_model_state_dict(checkpoint), "decoder.")
    plain.load_state_dict(decoder_state, strict=True)
    plain = plain.to(texts.device).eval()
    with torch.no_grad():
        fused_logits, plain_logits = model(texts), plain(texts)
    difference = float((fused_logits - plain_logits).abs().max())
    return torch.equal(fused_logits, plain_logits), difference


def _plot(losses: list[float], path: Path, accuracy: float) -> Path | None:
    """The loss curve at ``path``, or None without matplotlib (said at the start)."""
    if plotting_unavailable(INSTALL_TRAIN_EXTRA) is not None:
        return None
    try:
        plot_losses(
            losses,
            path,
            title=f"shapes captioning: held-out exact match {accuracy:.1%}",
            ylabel="cross-entropy on caption tokens",
        )
    except ImportError as error:  # matplotlib is there but a part of it is not
        warn(f"no loss plot: {error}; reinstall matplotlib with: {INSTALL_TRAIN_EXTRA}")
        return None
    return path


def final_report(
    config: TrainConfig, runtime: Runtime, output_dir: Path, result: TrainResult, started: float
) -> int:
    """Evaluate the final checkpoint in this process alone and write the report files."""
    checkpoint = result.checkpoint
    model, saved_config = load_model(checkpoint)
    model = model.to(runtime.device)
    tokenizer = build_tokenizer()
    heldout = result.heldout
    predictions = greedy_captions(
        model,
        heldout.images,
        tokenizer,
        tokens_per_image=tokens_per_image(config),
        batch_size=config.eval_batch_size,
    )
    accuracy = exact_match(predictions, heldout.captions)
    correct = sum(p == t for p, t in zip(predictions, heldout.captions, strict=True))

    shown = list(zip(predictions, heldout.captions, strict=True))[: config.num_samples]
    print(f"\nsample generations (held-out, greedy, from {checkpoint}):")
    for predicted, truth in shown:
        mark = "ok   " if predicted == truth else "WRONG"
        extra = "" if predicted == truth else f"   (expected: {truth})"
        print(f"  [{mark}] {predicted}{extra}")
    print(
        f"held-out exact match: {accuracy:.2%} ({correct}/{len(heldout)} captions) "
        "with greedy generation"
    )

    # Text-only sequences (no image placeholder): "describe: <caption> <eos>".
    texts, _ = encode_captions(tokenizer, heldout.captions[:16], 0)
    equal, max_diff = decoder_check(model, saved_config, checkpoint, texts.to(runtime.device))
    print(
        f"decoder check: the checkpoint's decoder.* loaded with strict=True into a plain "
        f"TransformerDecoder; text-only logits of the fused model and the plain decoder "
        f"{'are bitwise equal' if equal else 'DIFFER'} "
        f"(max abs diff {max_diff:.3g}, {list(texts.shape)} tokens)"
    )

    steps_run = len(result.losses) - result.start_step
    total = time.perf_counter() - started
    # The metrics first: they are the result; the plot is optional.
    write_json(
        {
            "heldout_exact_match": accuracy,
            "heldout_size": len(heldout),
            "decoder_check_equal": equal,
            "losses": result.losses,
            "checkpoint": str(checkpoint),
            "steps_run": steps_run,
            "train_seconds": result.train_seconds,
            "total_seconds": total,
            "samples": [{"predicted": p, "expected": t} for p, t in shown],
        },
        output_dir / "metrics.json",
    )
    plot_path = _plot(result.losses, output_dir / "loss.png", accuracy)
    rate = steps_run / result.train_seconds if result.train_seconds > 0 else float("nan")
    print(
        f"trained {steps_run} steps in {result.train_seconds:.1f}s ({rate:.1f} steps/s); "
        f"total {total:.1f}s; loss curve: {plot_path or 'none'}; "
        f"metrics: {output_dir / 'metrics.json'}"
    )
    return 0 if equal else 1


def main(argv: list[str] | None = None) -> int:
    """Run the job; returns the exit status: 0, 1 on any error (one line on stderr, no
    traceback), 2 on a bad command line (argparse's ``SystemExit``), 130 on Ctrl-C.

    Raises:
        TypeError: ``argv`` is not None or a list of str.
        SystemExit: with status 2 on unknown flags or bad values (and 0 for ``--help``).
    """
    started = time.perf_counter()
    if argv is not None and (
        not isinstance(argv, (list, tuple)) or not all(isinstance(a, str) for a in argv)
    ):
        raise TypeError(f"argv: expected None or a list of str, got {argv!r:.80}")
    config, given = parse_args(argv)
    runtime = None
    try:
        runtime = init_runtime(config.device)
        if runtime.is_main:  # optional extras: say so now, not after training
            missing = [plotting_unavailable(INSTALL_TRAIN_EXTRA)]
            missing.append(progress_unavailable() if config.progress else None)
            for message in filter(None, missing):
                warn(message)
        if config.threads:
            torch.set_num_threads(config.threads)
        start = agree_on_start(config, given, runtime)
        log(runtime, f"output directory: {start.output_dir}")
        result = train(start.config, runtime, start.output_dir, start.resume)
        shutdown(runtime)  # the report runs in the main process alone, from the checkpoint
        if runtime.is_main:
            return final_report(start.config, runtime, start.output_dir, result, started)
        return 0
    except TrainingError as error:
        if runtime is None or runtime.is_main:  # every process fails alike; one says why
            print(f"{PROG}: error: {_flat(error)}", file=sys.stderr)
        return 1
    except (OSError, MemoryError, RuntimeError) as error:
        # Disk full, a vanished directory, out of memory: this process's own failure. Other
        # RuntimeErrors are bugs, whose traceback is wanted.
        out_of_memory = isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
            "can't allocate memory" in str(error)  # torch's CPU allocator
        )
        if not isinstance(error, OSError) and not out_of_memory:
            raise
        where = f"[rank {runtime.rank}] " if runtime is not None and runtime.distributed else ""
        kind = "out of memory" if out_of_memory else "I/O error"
        print(f"{PROG}: error: {where}{kind}: {_flat(one_line(error))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (checkpoints already committed are intact)", file=sys.stderr)
        return 130
    finally:
        if runtime is not None:
            shutdown(runtime)
