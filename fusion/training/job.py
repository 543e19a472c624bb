"""What a recipe's command line does around its training loop: plan where a run starts (the
output directory, or the newest intact checkpoint to resume and the configuration it stores),
check a checkpoint against the model and optimizer its config builds, and turn what goes wrong
into one line on stderr and an exit status.

A recipe's ``main``, in outline::

    config, given = parse_args(argv)

    def job(runtime):
        plan = lambda: plan_start(config, given, output_dir, prog=PROG, inspect=inspect, ...)
        start = agree_on_start(runtime, plan, Config)  # rank 0 decides, every rank follows
        ...train from start.resume (None: a new run), report...
        return 0

    return run_job(PROG, config.device, job)

:func:`run_recipe` is that ``job`` with a recipe's usual steps (extras, threads, the start,
``train``, then ``report`` in the main process alone).
"""

import dataclasses
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from fusion.checkpoint.prefix import select_prefix
from fusion.training.checkpoint import (
    check_model_tensors,
    check_writable,
    checkpoint_root,
    latest_checkpoint,
    newest_intact_checkpoint,
    read_model_state_dict,
    set_aside_damaged,
)
from fusion.training.config import resumed_config
from fusion.training.distributed import Runtime, agree_on_rank0, init_runtime, shutdown
from fusion.training.errors import TrainingError, one_line
from fusion.training.report import flat, log, warn, warn_missing_extras
from fusion.training.safe_dcp import CheckedMetadata, fail
from fusion.training.state import TRAIN_STATE, TrainState, match_param_groups, match_saved

C = TypeVar("C")
R = TypeVar("R")


class _GlobalBatch(Protocol):
    batch_size: int


B = TypeVar("B", bound=_GlobalBatch)


# ------------------------------------------------------------------------------ the start


@dataclass(frozen=True)
class Start(Generic[C]):
    """Where a run starts: its configuration (a resumed run's restored from its checkpoint),
    its output directory and the checkpoint it resumes from (None: a new run)."""

    config: C
    output_dir: Path
    resume: Path | None


def plan_start(
    config: C,
    given: Collection[str],
    output_dir: Path,
    *,
    prog: str,
    inspect: Callable[[Path], TrainState],
    fixed_groups: Collection[str],
    prepare: Callable[[C, Path | None], C] | None = None,
    outputs: Collection[str] = (),
) -> Start[C]:
    """Check the output directory and, with ``config.resume``, find the newest intact
    checkpoint and restore its configuration; then set damaged newer checkpoints aside.

    A newer checkpoint that ``inspect`` refuses is reported in a warning and renamed to
    ``step_<N>.damaged``, never deleted; nothing else on disk changes here.

    Args:
        config: the command line's configuration (a dataclass with ``resume``).
        given: the names of the fields given as flags.
        output_dir: the run's directory (``--output-dir``).
        prog: the recipe's name in warnings.
        inspect: checks one checkpoint directory, returning its train state (its ``config``
            the recipe's) or raising ``TrainingError``.
        fixed_groups: the config groups a resumed run may not change
            (:func:`~fusion.training.config.resumed_config`).
        prepare: the recipe's last word on the configuration before the directory is used:
            its own checks, or settings it derives; gets the checkpoint resumed from (None:
            a new run) and returns the configuration to run.
        outputs: names of files or directories in ``output_dir`` that, like checkpoints,
            mean a run is already there.

    Raises:
        TrainingError: the path is not a directory or not writable; a new run would write
            where a run already is; ``--resume`` finds no intact checkpoint, or flags that
            would change the run; ``prepare`` refuses. Nothing on disk changes then.
    """
    try:
        if output_dir.exists() and not output_dir.is_dir():
            raise TrainingError(f"--output-dir: {output_dir} exists and is not a directory")
        root = checkpoint_root(output_dir)
        if not config.resume:  # type: ignore[attr-defined]
            latest = latest_checkpoint(root)
            there = [name for name in outputs if (output_dir / name).exists()]
            if latest is not None or there:
                what = f"checkpoints (latest: {latest.name})" if latest else f"a {there[0]}/"
                raise TrainingError(
                    f"--output-dir: {output_dir} already holds {what}; pass --resume to "
                    "continue that run, or choose another --output-dir (nothing was changed)"
                )
            config = prepare(config, None) if prepare else config
            check_writable(output_dir, root)
            return Start(config, output_dir, None)
        resume, state, damaged = newest_intact_checkpoint(root, inspect)
        config = resumed_config(config, given, state.config, state.step, fixed_groups=fixed_groups)
        config = prepare(config, resume) if prepare else config
        check_writable(output_dir, root)
        set_aside_damaged(damaged, resume, lambda message: warn(prog, message))
        return Start(config, output_dir, resume)
    except OSError as error:
        raise TrainingError(
            f"--output-dir: cannot use {output_dir} ({error.strerror or error})"
        ) from None


def check_batch_split(world_size: int, config: B, resume: Path | None) -> B:
    """A :func:`plan_start` ``prepare`` for a recipe of fixed-size global batches: ``config``
    if its ``batch_size`` splits over the ``world_size`` processes.

    Raises:
        TrainingError: naming ``--batch-size`` (and checkpoint ``resume`` when it set it).
    """
    batch_size = config.batch_size
    if batch_size % world_size:
        source = "" if resume is None else f" (the batch size of {resume.name})"
        raise TrainingError(
            f"--batch-size: expected a multiple of the {world_size} processes, "
            f"got {batch_size}{source}"
        )
    return config


def agree_on_start(
    runtime: Runtime, plan: Callable[[], Start[C]], config_class: Callable[..., C]
) -> Start[C]:
    """Rank 0 plans the start (say :func:`plan_start`); every process gets its verdict, so
    all of them run the same configuration (a ``config_class`` dataclass), or fail alike with
    the same message."""

    def encode(start: Start[C]) -> tuple[dict[str, Any], str, str | None]:
        resume = None if start.resume is None else str(start.resume)
        return dataclasses.asdict(start.config), str(start.output_dir), resume  # type: ignore[call-overload]

    def decode(verdict: tuple[dict[str, Any], str, str | None]) -> Start[C]:
        values, output_dir, resume = verdict
        resumed = None if resume is None else Path(resume)
        return Start(config_class(**values), Path(output_dir), resumed)

    return agree_on_rank0(runtime, plan, encode, decode)


def default_output_dir(name: str) -> Path:
    """A new run's directory when none is given: ``runs/<name>-<date>-<time>`` (``-2``,
    ``-3``, ... if it exists)."""
    base = Path("runs") / time.strftime(f"{name}-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


# ------------------------------------------------------------- checkpoints against a config


def check_config_model(
    path: Path, checked: CheckedMetadata, build: Callable[[], nn.Module], *, layers: int
) -> None:
    """The model tensors of checkpoint ``path`` (``checked``, its metadata) must be exactly
    those of the model its stored config describes: ``build()`` on the meta device (no
    memory), compared before anything is allocated.

    ``layers`` is how many layers the config asks for: building costs time per layer even on
    the meta device, so a count the stored tensors cannot hold is refused first.

    Raises:
        TrainingError: naming the file and what does not fit.
    """
    stored = checked.tensors("model.")
    if layers > len(stored):
        raise fail(
            path / TRAIN_STATE,
            f"config has {layers} layers, but the checkpoint holds only {len(stored)} "
            "model tensors",
        )
    try:
        with torch.device("meta"):
            model = build()
    except (RuntimeError, ValueError, OverflowError) as error:
        raise fail(path / TRAIN_STATE, f"its config builds no model: {one_line(error)}") from None
    check_model_tensors(path, checked, model)


def check_optimizer_state(
    path: Path,
    state: TrainState,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Check the optimizer hyper-parameters and scheduler state of checkpoint ``path`` (its
    train state ``state``) against an ``optimizer`` and ``scheduler`` built as the run builds
    them (one parameter will do), so that a damaged one is found while choosing the checkpoint
    to resume, before the run is built.

    Raises:
        TrainingError: naming the file and the key that does not fit.
    """
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    match_param_groups(path, state.param_groups, groups)
    match_saved(path, "scheduler", state.scheduler, scheduler.state_dict())


def compare_plain_decoder(
    path: Path, model: nn.Module, build_decoder: Callable[[], nn.Module], tokens: torch.Tensor
) -> tuple[bool, float]:
    """Whether an early-fusion checkpoint's decoder stands alone: the ``decoder.*`` tensors of
    checkpoint ``path``, loaded with ``strict=True`` into a plain ``build_decoder()`` (built as
    the fused model builds its own; the global RNG is left as it was), give the logits of
    ``model`` (the fused model, in eval mode) on text-only ``tokens`` [b, s], on ``tokens``'
    device without gradients.

    Returns:
        whether the two logits are bitwise equal, and their largest absolute difference.

    Raises:
        TrainingError: a file of the checkpoint is damaged (naming it).
        RuntimeError: the checkpoint's decoder tensors do not fit ``build_decoder()``'s.
    """
    with torch.random.fork_rng(devices=[]):  # its initial values are overwritten
        decoder = build_decoder()
    decoder.load_state_dict(select_prefix(read_model_state_dict(path), "decoder."), strict=True)
    with torch.no_grad():
        fused, plain = model(tokens), decoder.to(tokens.device).eval()(tokens)
    return torch.equal(fused, plain), float((fused - plain).abs().max())


# ------------------------------------------------------------------------ the exit status


def run_job(prog: str, device: str, job: Callable[[Runtime], int]) -> int:
    """Run ``job`` on this process's runtime (:func:`~fusion.training.init_runtime` of
    ``device``), shut it down in any case, and return the exit status: ``job``'s, or 1 with
    one line on stderr (no traceback) for a ``TrainingError`` (said by the main process when
    every process fails alike; by the process that found it, with its rank, when it is
    ``local``), an I/O error or running out of memory (said by each process, with its rank),
    or 130 on Ctrl-C. Other errors are bugs, whose traceback is wanted."""
    runtime = None
    try:
        runtime = init_runtime(device)
        return job(runtime)
    except TrainingError as error:
        if runtime is not None and runtime.distributed and error.local:
            print(f"{prog}: error: [rank {runtime.rank}] {flat(error)}", file=sys.stderr)
        elif runtime is None or runtime.is_main:
            print(f"{prog}: error: {flat(error)}", file=sys.stderr)
        return 1
    except (OSError, MemoryError, RuntimeError) as error:
        # Disk full, a vanished directory, out of memory: this process's own failure.
        out_of_memory = isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
            "can't allocate memory" in str(error)  # torch's CPU allocator
        )
        if not isinstance(error, OSError) and not out_of_memory:
            raise
        where = f"[rank {runtime.rank}] " if runtime is not None and runtime.distributed else ""
        kind = "out of memory" if out_of_memory else "I/O error"
        print(f"{prog}: error: {where}{kind}: {flat(one_line(error))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (checkpoints already committed are intact)", file=sys.stderr)
        return 130
    finally:
        if runtime is not None:
            shutdown(runtime)


def run_recipe(
    prog: str,
    config: Any,
    config_class: Callable[..., C],
    plan: Callable[[Runtime], Start[C]],
    train: Callable[[Runtime, Start[C]], R],
    report: Callable[[Runtime, Start[C], R], int],
) -> int:
    """A recipe's job, from its checked command line ``config`` (with ``device``, ``threads``
    and ``progress``) to its exit status (:func:`run_job`). Every process warns now (not
    after training) of a missing progress bar or plot, takes ``config.threads`` CPU threads (0:
    torch's default), agrees on the start (:func:`agree_on_start` of ``plan(runtime)``), logs
    its output directory and runs ``train(runtime, start)``; then the others shut down and the
    main process alone returns ``report(runtime, start, result)`` (the others 0)."""

    def job(runtime: Runtime) -> int:
        warn_missing_extras(prog, runtime, config.progress)
        if config.threads:
            torch.set_num_threads(config.threads)
        start = agree_on_start(runtime, lambda: plan(runtime), config_class)
        log(runtime, f"output directory: {start.output_dir}")
        result = train(runtime, start)
        shutdown(runtime)  # the report runs in the main process alone
        return report(runtime, start, result) if runtime.is_main else 0

    return run_job(prog, config.device, job)
