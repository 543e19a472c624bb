"""``python -m recipes.finetune``: check the command line and the output directory, train (or
resume), then write ``<output-dir>/final/``, ``metrics.json`` and the loss plot."""

import dataclasses
import resource
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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
    load_train_state,
    log,
    newest_intact_checkpoint,
    one_line,
    plot_losses,
    plotting_unavailable,
    progress_unavailable,
    set_aside_damaged,
    shutdown,
    verify_checkpoint,
    write_json,
)
from recipes.finetune.config import (
    PROG,
    FinetuneConfig,
    config_from_json,
    parse_args,
    resumed_config,
)
from recipes.finetune.export import FINAL, export_final
from recipes.finetune.model import init_adapter_config
from recipes.finetune.trainer import TrainResult, train


def warn(message: str) -> None:
    """One line on stderr, as the recipe's errors are."""
    print(f"{PROG}: warning: {_flat(message)}", file=sys.stderr, flush=True)


def _flat(message: object) -> str:
    return " ".join(str(message).splitlines())


@dataclass(frozen=True)
class Start:
    """Where a run starts: its configuration (a resumed run's restored from its checkpoint),
    its output directory and the checkpoint (and its train state) it resumes from."""

    config: FinetuneConfig
    output_dir: Path
    resume: tuple[Path, TrainState] | None


def inspect_checkpoint(path: Path) -> TrainState:
    """The train state of checkpoint ``path`` once every file of it checks out."""
    state = load_train_state(path, config_from_json)
    verify_checkpoint(path)
    return state


def plan_start(config: FinetuneConfig, given: Collection[str]) -> Start:
    """Check the output directory and, with ``--resume``, find the newest intact checkpoint
    and restore its configuration; damaged newer ones are renamed ``*.damaged`` (never
    deleted).

    A new run with ``--init-adapter`` takes its rank, alpha and dropout from the adapter
    (:func:`recipes.finetune.model.init_adapter_config`), so that its checkpoints record them.

    Raises:
        TrainingError: the path is not a writable directory; a new run would write where a
            run already is (checkpoints or ``final/``); ``--resume`` finds no intact
            checkpoint or flags that would change the run; an ``--init-adapter`` that
            cannot be used, or flags that contradict it. Nothing on disk changes then.
    """
    assert config.output_dir is not None
    output_dir = Path(config.output_dir)
    try:
        if output_dir.exists() and not output_dir.is_dir():
            raise TrainingError(f"--output-dir: {output_dir} exists and is not a directory")
        root = checkpoint_root(output_dir)
        if not config.resume:
            latest = latest_checkpoint(root)
            if latest is not None or (output_dir / FINAL).exists():
                what = f"checkpoints (latest: {latest.name})" if latest else f"a {FINAL}/"
                raise TrainingError(
                    f"--output-dir: {output_dir} already holds {what}; pass --resume to "
                    "continue that run, or choose another --output-dir (nothing was changed)"
                )
            config = init_adapter_config(config, given)
            check_writable(output_dir, root)
            return Start(config, output_dir, None)
        path, state, damaged = newest_intact_checkpoint(root, inspect_checkpoint)
        config = resumed_config(config, given, state.config, state.step)
        check_writable(output_dir, root)
        set_aside_damaged(damaged, path, warn)
        return Start(config, output_dir, (path, state))
    except OSError as error:
        raise TrainingError(
            f"--output-dir: cannot use {output_dir} ({error.strerror or error})"
        ) from None


def agree_on_start(config: FinetuneConfig, given: Collection[str], runtime: Runtime) -> Start:
    """Rank 0 plans the start; every process gets its verdict (or its error)."""

    def encode(start: Start) -> tuple[dict[str, Any], str, str | None]:
        resume = None if start.resume is None else str(start.resume[0])
        return dataclasses.asdict(start.config), str(start.output_dir), resume

    def decode(verdict: tuple[dict[str, Any], str, str | None]) -> Start:
        value, output_dir, resume = verdict
        resumed = None
        if resume is not None:
            resumed = (Path(resume), load_train_state(Path(resume), config_from_json))
        return Start(FinetuneConfig(**value), Path(output_dir), resumed)

    return agree_on_rank0(runtime, lambda: plan_start(config, given), encode, decode)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """This process's peak memory: the CUDA allocator's on GPU, else the peak resident set."""
    if device.type == "cuda":
        return {"kind": "cuda_max_allocated", "bytes": torch.cuda.max_memory_allocated(device)}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"kind": "cpu_max_rss", "bytes": kib * 1024}


def report(
    config: FinetuneConfig, runtime: Runtime, output_dir: Path, result: TrainResult, started: float
) -> None:
    """Export ``final/`` from the last checkpoint, then write ``metrics.json`` and the plot."""
    final = export_final(config, result.checkpoint, output_dir)
    log(runtime, f"fine-tuned model: {final}")
    steps_run = result.total_steps - result.start_step
    rate = result.tokens / result.train_seconds if result.train_seconds > 0 else 0.0
    padding = 1.0 - result.tokens / result.slots if result.slots else 0.0
    write_json(
        {
            "losses": result.losses,
            "eval_losses": [[step, loss] for step, loss in result.eval_losses],
            "steps": result.total_steps,
            "steps_run": steps_run,
            "tokens_per_second": rate,
            "tokens": result.tokens,
            "padding_fraction": padding,
            "peak_memory": peak_memory(runtime.device),
            "train_seconds": result.train_seconds,
            "total_seconds": time.perf_counter() - started,
            "conversations": result.num_samples,
            "skipped": result.skipped,
            "truncated": result.truncated,
            "checkpoint": str(result.checkpoint),
            "final": str(final),
        },
        output_dir / "metrics.json",
    )
    plot = None
    if plotting_unavailable(INSTALL_TRAIN_EXTRA) is None:
        plot = output_dir / "loss.png"
        plot_losses(
            result.losses,
            plot,
            title=f"fine-tuning {Path(config.model or '').name} ({config.train})",
            eval_losses=result.eval_losses,
            ylabel="cross-entropy on assistant tokens",
        )
    log(
        runtime,
        f"trained {steps_run} steps in {result.train_seconds:.1f}s ({rate:,.0f} tokens/s, "
        f"padding {padding:.1%}); loss curve: {plot or 'none'}; "
        f"metrics: {output_dir / 'metrics.json'}",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the recipe; returns the exit status: 0, 1 on any error (one line on stderr), 2 on
    a bad command line (argparse's ``SystemExit``), 130 on Ctrl-C."""
    started = time.perf_counter()
    config, given = parse_args(argv)
    runtime = None
    try:
        runtime = init_runtime(config.device)
        if runtime.is_main:
            missing = [plotting_unavailable(INSTALL_TRAIN_EXTRA)]
            missing.append(progress_unavailable() if config.progress else None)
            for message in filter(None, missing):
                warn(message)
        if config.threads:
            torch.set_num_threads(config.threads)
        start = agree_on_start(config, given, runtime)
        log(runtime, f"output directory: {start.output_dir}")
        result = train(start.config, runtime, start.output_dir, start.resume, given)
        shutdown(runtime)  # the export runs in the main process alone, from the checkpoint
        if runtime.is_main:
            report(start.config, runtime, start.output_dir, result, started)
        return 0
    except TrainingError as error:
        if runtime is None or runtime.is_main:
            print(f"{PROG}: error: {_flat(error)}", file=sys.stderr)
        return 1
    except (OSError, MemoryError) as error:
        where = f"[rank {runtime.rank}] " if runtime is not None and runtime.distributed else ""
        kind = "out of memory" if isinstance(error, MemoryError) else "I/O error"
        print(f"{PROG}: error: {where}{kind}: {_flat(one_line(error))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (checkpoints already committed are intact)", file=sys.stderr)
        return 130
    finally:
        if runtime is not None:
            shutdown(runtime)
