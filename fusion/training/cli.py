"""``python -m fusion.training``: train, checkpoint, evaluate and check the early-fusion model."""

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
    latest_checkpoint,
    load_model,
    load_train_state,
    read_model_state_dict,
)
from fusion.training.config import TrainConfig, parse_config
from fusion.training.distributed import Runtime, init_runtime, shutdown
from fusion.training.errors import TrainingError
from fusion.training.evaluate import exact_match, greedy_captions
from fusion.training.model import build_decoder, build_tokenizer, tokens_per_image
from fusion.training.report import plot_losses, write_json
from fusion.training.trainer import TrainResult, log, train

PROG = "python -m fusion.training"


def default_output_dir() -> Path:
    base = Path("runs") / time.strftime("shapes-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_output_dir(config: TrainConfig) -> tuple[Path, Path | None]:
    """Validate the output directory before any work; create it for a new run.

    Returns:
        the output directory and, with ``--resume``, the checkpoint to resume from.

    Raises:
        TrainingError: the path is not a directory or not writable; a new run would write
            into a directory that already holds checkpoints; ``--resume`` finds no checkpoint,
            or one written for another model or data/optimisation config. Nothing on disk is
            changed in any of these cases.
    """
    output_dir = Path(config.output_dir) if config.output_dir else default_output_dir()
    if output_dir.exists() and not output_dir.is_dir():
        raise TrainingError(f"--output-dir: {output_dir} exists and is not a directory")
    root = checkpoint_root(output_dir)
    latest = latest_checkpoint(root)
    if config.resume and latest is None:
        raise TrainingError(
            f"--resume: no checkpoint in {root} (expected step_<N> directories); "
            "run without --resume to start a new run"
        )
    if not config.resume and latest is not None:
        raise TrainingError(
            f"--output-dir: {output_dir} already holds checkpoints (latest: {latest.name}); "
            "pass --resume to continue that run, or choose another --output-dir "
            "(nothing was changed)"
        )
    if latest is not None:
        check_compatible(latest, load_train_state(latest), config)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as error:
        raise TrainingError(
            f"--output-dir: {output_dir} is not writable ({error.strerror or error})"
        ) from error
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

    plot_path = output_dir / "loss.png"
    plot_losses(
        result.losses,
        plot_path,
        title=f"shapes captioning: held-out exact match {accuracy:.1%}",
    )
    steps_run = len(result.losses) - result.start_step
    total = time.perf_counter() - started
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
    rate = steps_run / result.train_seconds if result.train_seconds > 0 else float("nan")
    print(
        f"trained {steps_run} steps in {result.train_seconds:.1f}s ({rate:.1f} steps/s); "
        f"total {total:.1f}s; loss curve: {plot_path}; metrics: {output_dir / 'metrics.json'}"
    )
    return 0 if equal else 1


def main(argv: list[str] | None = None) -> int:
    """Run the job; returns the exit status (argparse exits with 2 on bad flags)."""
    started = time.perf_counter()
    config = parse_config(argv)
    if config.threads:
        torch.set_num_threads(config.threads)
    runtime = None
    try:
        runtime = init_runtime(config.device)
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
            print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    finally:
        if runtime is not None:
            shutdown(runtime)
