"""Crash-safe training checkpoints in ``torch.distributed.checkpoint`` (DCP) format.

A checkpoint is a directory ``<output_dir>/checkpoints/step_<step>/`` holding the DCP files of
``{"model": ..., "optim": ...}`` (one file per process, each fsynced, plus ``.metadata``) and
``train_state.pt`` (step, data position, scheduler, RNG states, losses, config). It is written
under a temporary name and renamed into place only when complete, so a crash at any moment
leaves every earlier checkpoint intact and never exposes a partial one. DCP checkpoints reshard:
one saved by N processes (DDP or FSDP2) resumes on M processes, and loads into a plain
single-process model (:func:`read_model_state_dict`, :func:`load_model`).
"""

import dataclasses
import io
import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fusion.early_fusion import EarlyFusion
from fusion.training.config import TrainConfig
from fusion.training.errors import TrainingError

FORMAT_VERSION = 1
TRAIN_STATE = "train_state.pt"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``root`` as ``(step, path)``, oldest first. Temporary
    directories of interrupted saves are not checkpoints and never listed."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    ]
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


# ---------------------------------------------------------------------------------- atomic files


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a mix:
    a temporary file in the same directory, flushed and fsynced, then renamed over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_torch_save(obj: Any, path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


# ---------------------------------------------------------------------------------- saving


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process save and load; here that is intended, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")
        yield


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(states: list[dict[str, Any]], rank: int, device: torch.device) -> None:
    """Restore this rank's RNG states; a rank the checkpoint has none for (more processes than
    when it was saved) takes rank 0's."""
    state = states[rank] if rank < len(states) else states[0]
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _trash_name(path: Path) -> Path:
    return path.with_name(f".trash-{path.name}-{os.getpid()}")


def _remove_dir(path: Path) -> None:
    """Remove a directory by first renaming it to a temporary name, so that a crash half-way
    through never leaves a partial ``step_*`` directory behind."""
    trash = _trash_name(path)
    os.replace(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash)


def _commit(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``; an existing ``final`` (the same step saved
    again) is moved aside first and deleted only once the new one is in place."""
    old = None
    if final.exists():
        old = _trash_name(final)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old)


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    *,
    device: torch.device,
    keep: int,
) -> Path:
    """Save a checkpoint of ``step`` collectively (every process calls this) and commit it.

    Args:
        root: the checkpoints directory.
        model, optimizer: plain, DDP-wrapped or FSDP2-sharded; saved through
            ``get_state_dict`` so keys are the unwrapped model's.
        train_state: everything else (picklable with ``weights_only`` loading); the RNG
            states of every process are added under ``"rng"``.
        keep: how many committed checkpoints to keep; older ones are removed after the commit.

    Returns:
        the committed checkpoint directory.
    """
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for pattern in (".tmp-*", ".trash-*"):  # left by crashes; never checkpoints
            for stale in root.glob(pattern):
                shutil.rmtree(stale)
        tmp.mkdir()
    rng = [_rng_state(device)]
    if distributed:
        dist.barrier()
        rng = [None] * dist.get_world_size()
        dist.all_gather_object(rng, _rng_state(device))

    model_state, optim_state = get_state_dict(model, optimizer)
    with _quiet_single_process():  # every file is fsynced before .metadata is renamed in
        dcp.save(
            {"model": model_state, "optim": optim_state},
            checkpoint_id=tmp,
            no_dist=not distributed,
        )
    if rank == 0:
        atomic_torch_save({**train_state, "rng": rng, "format": FORMAT_VERSION}, tmp / TRAIN_STATE)
        fsync_dir(tmp)
        _commit(tmp, final)
        for _, old in list_checkpoints(root)[:-keep]:
            _remove_dir(old)
    if distributed:
        dist.barrier()
    return final


# ---------------------------------------------------------------------------------- loading


def load_train_state(path: Path) -> dict[str, Any]:
    """The ``train_state.pt`` of checkpoint ``path`` (loaded with ``weights_only=True``).

    Raises:
        TrainingError: the file is missing, unreadable or of an unknown format.
    """
    file = path / TRAIN_STATE
    try:
        state = torch.load(file, weights_only=True)
    except Exception as error:  # any failure to read is the same problem for the user
        raise TrainingError(f"checkpoint {path}: cannot read {file.name}: {error}") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise TrainingError(
            f"checkpoint {path}: {file.name} is not a training state of format {FORMAT_VERSION}"
        )
    return state


def config_differences(saved: dict[str, Any], config: TrainConfig, group: str) -> list[str]:
    """``"--flag: checkpoint X, now Y"`` for each field of ``group`` that differs."""
    return [
        f"--{name.replace('_', '-')}: checkpoint {saved.get(name)!r}, now {value!r}"
        for name, value in config.group(group).items()
        if saved.get(name) != value
    ]


def check_compatible(path: Path, state: dict[str, Any], config: TrainConfig) -> None:
    """Raise ``TrainingError`` unless ``config`` may resume from checkpoint ``path``.

    The model, data and optimisation settings must equal the checkpoint's; ``--steps`` may
    grow but not fall below the checkpoint's step.
    """
    saved = state["config"]
    model_diff = config_differences(saved, config, "model")
    if model_diff:
        raise TrainingError(
            f"checkpoint {path} was written for a different model config; "
            f"resume with the same model flags ({'; '.join(model_diff)})"
        )
    other = config_differences(saved, config, "data") + config_differences(saved, config, "optim")
    if other:
        raise TrainingError(
            f"checkpoint {path} was written with different data/optimisation flags, so the "
            f"resumed run would not continue it ({'; '.join(other)})"
        )
    if state["step"] > config.steps:
        raise TrainingError(
            f"--steps: expected at least the checkpoint's step {state['step']}, got {config.steps}"
        )


def load_training_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Load model and optimizer state from ``path`` in place, collectively; any number of
    processes, DDP or FSDP2, whatever the checkpoint was saved with."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def read_model_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's full state dict from a checkpoint, in this process alone (no process group
    needed; whole tensors on CPU whatever the sharding it was saved with). Keys are the plain
    ``EarlyFusion``'s: ``decoder.*`` and ``encoders.image.*``.

    Raises:
        TrainingError: ``path`` is not a readable DCP checkpoint with model weights.
    """
    path = Path(path)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:
        raise TrainingError(f"checkpoint {path}: cannot read its DCP metadata: {error}") from error
    state = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise TrainingError(f"checkpoint {path}: holds no model weights")
    wrapped = {"model": state}
    with _quiet_single_process():
        dcp.load(wrapped, checkpoint_id=path, no_dist=True)
    return wrapped["model"]


def load_model(path: str | os.PathLike) -> tuple[EarlyFusion, TrainConfig]:
    """A single-process ``EarlyFusion`` (on CPU, in eval mode) and the config of checkpoint
    ``path``, loaded with ``strict=True``."""
    from fusion.training.model import build_model

    path = Path(path)
    config = TrainConfig(**load_train_state(path)["config"])
    with torch.random.fork_rng(devices=[]):  # the initial values are overwritten anyway
        model = build_model(config)
    model.load_state_dict(read_model_state_dict(path), strict=True)
    return model.eval(), config


def config_dict(config: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
