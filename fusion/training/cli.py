"""``python -m fusion.training``: train, checkpoint, evaluate and check the early-fusion model."""

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fusion.checkpoint import select_prefix
from fusion.data import encode_captions
from fusion.training.checkpoint import (
    check_compatible,
    checkpoint_root,
    fsync_dir,
    inspect_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_model,
    read_model_state_dict,
)
from fusion.training.config import TrainConfig, parse_config
from fusion.training.distributed import Runtime, init_runtime, shutdown
from fusion.training.errors import TrainingError, one_line
from fusion.training.evaluate import exact_match, greedy_captions
from fusion.training.model import build_decoder, build_tokenizer, tokens_per_image
from fusion.training.report import plot_losses, plotting_unavailable, write_json
from fusion.training.trainer import (
    INSTALL_TRAIN_EXTRA,
    TrainResult,
    check_resume_state,
    log,
    progress_unavailable,
    train,
)

PROG = "python -m fusion.training"


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


def newest_intact_checkpoint(root: Path) -> tuple[Path, dict, list[tuple[Path, str]]]:
    """The newest checkpoint under ``root`` whose files all check out
    (:func:`inspect_checkpoint`, :func:`check_resume_state`), its train state, and the newer
    ones that are damaged, each with what is wrong with it.

    Raises:
        TrainingError: there is no checkpoint, or none is intact (naming what is wrong with
            each).
    """
    damaged: list[tuple[Path, str]] = []
    for _, path in reversed(list_checkpoints(root)):
        try:
            state = inspect_checkpoint(path)
            check_resume_state(path, state)
        except TrainingError as error:
            damaged.append((path, str(error)))
        else:
            return path, state, damaged
    if not damaged:
        raise TrainingError(
            f"--resume: no checkpoint in {root} (expected step_<N> directories); "
            "run without --resume to start a new run"
        )
    reasons = "; ".join(reason for _, reason in damaged)
    raise TrainingError(f"--resume: no intact checkpoint in {root}: {reasons}")


def _set_aside(path: Path) -> Path:
    """Rename the damaged checkpoint ``path`` out of the ``step_<N>`` names (never delete it):
    the resumed run would otherwise replace it when it saves that step again, and the next
    ``--resume`` would trip over it again."""
    target = path.with_name(f"{path.name}.damaged")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{n}")
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


def check_output_dir(config: TrainConfig) -> tuple[Path, Path | None]:
    """Validate the output directory before any work; create it for a new run.

    With ``--resume``, the checkpoint is the newest intact one: newer damaged ones are
    reported with a warning and renamed to ``step_<N>.damaged``, never deleted.

    Returns:
        the output directory and, with ``--resume``, the checkpoint to resume from.

    Raises:
        TrainingError: the path is not a directory or not writable; a new run would write
            into a directory that already holds checkpoints; ``--resume`` finds no intact
            checkpoint, or one written for another model or data/optimisation config. Nothing
            on disk is changed in any of these cases.
    """
    output_dir = Path(config.output_dir) if config.output_dir else default_output_dir()
    try:
        return _check_output_dir(config, output_dir)
    except OSError as error:
        raise TrainingError(
            f"--output-dir: cannot use {output_dir} ({error.strerror or error})"
        ) from None


def _check_output_dir(config: TrainConfig, output_dir: Path) -> tuple[Path, Path | None]:
    if output_dir.exists() and not output_dir.is_dir():
        raise TrainingError(f"--output-dir: {output_dir} exists and is not a directory")
    root = checkpoint_root(output_dir)
    latest, damaged = latest_checkpoint(root), []
    if not config.resume and latest is not None:
        raise TrainingError(
            f"--output-dir: {output_dir} already holds checkpoints (latest: {latest.name}); "
            "pass --resume to continue that run, or choose another --output-dir "
            "(nothing was changed)"
        )
    if config.resume:
        latest, state, damaged = newest_intact_checkpoint(root)
        check_compatible(latest, state, config)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as error:
        raise TrainingError(
            f"--output-dir: {output_dir} is not writable ({error.strerror or error})"
        ) from error
    for path, reason in damaged:
        kept = _set_aside(path)
        warn(f"{reason}; resuming from the older {latest.name}; the damaged one is kept as {kept}")
    return output_dir, latest


def agree_on_output_dir(config: TrainConfig, runtime: Runtime) -> tuple[Path, Path | None]:
    """Rank 0 checks (and creates) the output directory; every rank gets its verdict, so all
    processes fail alike with the same message."""
    if not runtime.distributed:
        return check_output_dir(config)
    verdict: list = [None]
    if runtime.is_main:
        try:
            output_dir, latest = check_output_dir(config)
            verdict = [("ok", str(output_dir), None if latest is None else str(latest))]
        except TrainingError as error:
            verdict = [("error", str(error), None)]
    dist.broadcast_object_list(verdict, src=0)
    status, value, latest = verdict[0]
    if status == "error":
        raise TrainingError(value)
    return Path(value), None if latest is None else Path(latest)


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
        heldout,
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
    plot_path: Path | None = None
    if plotting_unavailable(INSTALL_TRAIN_EXTRA) is None:  # else main warned at the start
        plot_path = output_dir / "loss.png"
        try:
            plot_losses(
                result.losses,
                plot_path,
                title=f"shapes captioning: held-out exact match {accuracy:.1%}",
            )
        except ImportError as error:  # matplotlib is there but a part of it is not
            warn(f"no loss plot: {error}; reinstall matplotlib with: {INSTALL_TRAIN_EXTRA}")
            plot_path = None
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
    config = parse_config(argv)
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
        if config.batch_size % runtime.world_size:
            raise TrainingError(
                f"--batch-size: expected a multiple of the {runtime.world_size} processes, "
                f"got {config.batch_size}"
            )
        output_dir, resume = agree_on_output_dir(config, runtime)
        log(runtime, f"output directory: {output_dir}")
        result = train(config, runtime, output_dir, resume)
        shutdown(runtime)  # the report runs in the main process alone, from the checkpoint
        if runtime.is_main:
            return final_report(config, runtime, output_dir, result, started)
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
