"""Crash-safe training checkpoints (what resuming needs) in ``torch.distributed.checkpoint``
(DCP) format; the library's model files are :mod:`fusion.checkpoint`'s business.

A checkpoint is a directory ``<output_dir>/checkpoints/step_00001000/`` (the step in 8 digits)
holding the DCP files of the tensors of ``{"model": ..., "optim": {"state": ...}}`` (one file
per process, each fsynced, plus ``.metadata``) and ``train_state.json`` (a
:class:`~recipes.captioner.state.TrainState`: step, data position, scheduler, the optimizer's
hyper-parameters, RNG states, losses, config). It is written under a temporary name and
renamed into place only when complete, so a crash at any moment leaves every earlier
checkpoint intact and never exposes a partial one. DCP checkpoints reshard:
one saved by N processes (DDP or FSDP2) resumes on M processes, and loads into a plain
single-process model (:func:`read_model_state_dict`, :func:`load_model`).

A checkpoint directory is untrusted input: loading never executes code from it (no pickle
beyond the restricted reading of DCP's ``.metadata`` in :mod:`recipes.captioner.safe_dcp`), and
the stored config and tensor shapes are checked before anything is built or allocated.
"""

import dataclasses
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fusion.checkpoint.files import fsync_path, write_files
from fusion.early_fusion import EarlyFusion
from recipes.captioner import safe_dcp
from recipes.captioner.config import TrainConfig
from recipes.captioner.errors import TrainingError, one_line
from recipes.captioner.safe_dcp import METADATA, CheckedMetadata, fail
from recipes.captioner.state import (
    TRAIN_STATE,
    RngState,
    TrainState,
    load_train_state,
    match_saved,
)

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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a mix
    (the library's crash-safe writer: staged, fsynced, renamed over ``path``)."""
    write_files(path.parent, {path.name: data})


# ---------------------------------------------------------------------------------- saving


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process save and load; here that is intended, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")
        yield


def _trash_name(path: Path) -> Path:
    return path.with_name(f".trash-{path.name}-{os.getpid()}")


def _remove_dir(path: Path) -> None:
    """Remove a directory by first renaming it to a temporary name, so that a crash half-way
    through never leaves a partial ``step_*`` directory behind."""
    trash = _trash_name(path)
    os.replace(path, trash)
    fsync_path(path.parent)
    shutil.rmtree(trash)


def _commit(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``; an existing ``final`` (the same step saved
    again) is moved aside first and deleted only once the new one is in place."""
    old = None
    if final.exists():
        old = _trash_name(final)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old)


def _param_groups(optim_state: Any) -> list[dict[str, Any]]:
    """The ``param_groups`` of an optimizer state dict (typed loosely by torch)."""
    return list(optim_state["param_groups"])


def _hyper_parameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``param_groups`` without their ``params``: the plain hyper-parameters that
    ``train_state.json`` holds (DCP would pickle them)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in param_groups]


def _tensor_state(model_state: dict[str, Any], optim_state: dict[str, Any]) -> dict[str, Any]:
    """What goes into the DCP files: tensors only. The optimizer's ``param_groups`` (plain
    hyper-parameters, which DCP would pickle) go into ``train_state.json``."""
    return {"model": model_state, "optim": {"state": optim_state["state"]}}


def save_checkpoint(
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    *,
    device: torch.device,
    keep: int,
) -> Path:
    """Save a checkpoint of ``state.step`` collectively (every process calls this) and commit
    it.

    Args:
        root: the checkpoints directory.
        model, optimizer: plain, DDP-wrapped or FSDP2-sharded; saved through
            ``get_state_dict`` so keys are the unwrapped model's.
        state: the training state; its ``param_groups`` and ``rng`` are replaced by the
            optimizer's hyper-parameters and the RNG states of every process.
        keep: how many committed checkpoints to keep; older ones are removed after the commit.

    Returns:
        the committed checkpoint directory.
    """
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    final = step_dir(root, state.step)
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for pattern in (".tmp-*", ".trash-*"):  # left by crashes; never checkpoints
            for stale in root.glob(pattern):
                shutil.rmtree(stale)
        tmp.mkdir()
    rng = [RngState.capture(device)]
    if distributed:
        dist.barrier()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rng[0])
        rng = gathered

    model_state, optim_state = get_state_dict(model, optimizer)
    param_groups = _hyper_parameters(_param_groups(optim_state))
    with _quiet_single_process():  # every file is fsynced before .metadata is renamed in
        dcp.save(
            _tensor_state(model_state, optim_state), checkpoint_id=tmp, no_dist=not distributed
        )
    if rank == 0:
        state = dataclasses.replace(state, param_groups=param_groups, rng=rng)
        atomic_write_bytes(tmp / TRAIN_STATE, state.encode())
        fsync_path(tmp)
        _commit(tmp, final)
        for _, old in list_checkpoints(root)[:-keep]:
            _remove_dir(old)
    if distributed:
        dist.barrier()
    return final


# ---------------------------------------------------------------------------------- loading


def checkpoint_dir(path: Any, name: str = "path") -> Path:
    """``path`` as an existing checkpoint directory.

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        TrainingError: it does not exist or is not a directory (naming argument ``name``).
    """
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise TypeError(f"{name}: expected a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except (OSError, ValueError) as error:
        raise TrainingError(f"{name}: cannot access {path}: {error}") from None
    if not is_dir:
        what = "is not a directory" if exists else "does not exist"
        raise TrainingError(
            f"{name}: expected a checkpoint directory (step_<N>), but {path} {what}"
        )
    if not (path / TRAIN_STATE).exists() and not (path / METADATA).exists():
        latest = latest_checkpoint(checkpoint_root(path))
        hint = f" (its latest checkpoint is {latest})" if latest is not None else ""
        raise TrainingError(
            f"{name}: {path} is not a checkpoint directory: it has neither {TRAIN_STATE} nor "
            f"{METADATA}{hint}"
        )
    return path


def _check_tensors(
    path: Path, expected: dict[str, tuple[tuple[int, ...], torch.dtype]], stored: dict, what: str
) -> None:
    """Raise ``TrainingError`` unless ``stored`` has exactly the keys, shapes and dtypes of
    ``expected`` (both ``{key: (shape, dtype)}``)."""
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    wrong = [
        f"{key}: stored {list(stored[key][0])} {stored[key][1]}, expected {list(shape)} {dtype}"
        for key, (shape, dtype) in expected.items()
        if key in stored and stored[key] != (shape, dtype)
    ]
    if missing or unexpected or wrong:
        parts = [
            f"{label} ({len(keys)}): {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("differ", wrong))
            if keys
        ]
        raise fail(path / METADATA, f"its {what} tensors do not match: {'; '.join(parts)}")


def _check_model_tensors(path: Path, checked: CheckedMetadata, config: TrainConfig) -> None:
    """The checkpoint's model tensors must be exactly those of ``config``'s model: compared
    with the model built on the meta device (no memory), before anything is allocated."""
    from recipes.captioner.model import build_model

    stored = checked.tensors("model.")
    # Building costs time per layer even on the meta device: a layer count the stored tensors
    # cannot hold is refused first.
    layers = config.decoder_layers + config.encoder_layers
    if layers > len(stored):
        raise fail(
            path / TRAIN_STATE,
            f"config has {layers} layers, but the checkpoint holds only {len(stored)} "
            "model tensors",
        )
    try:
        with torch.device("meta"):
            model = build_model(config)
    except (RuntimeError, ValueError, OverflowError) as error:
        raise fail(path / TRAIN_STATE, f"its config builds no model: {one_line(error)}") from None
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    _check_tensors(path, expected, stored, "model")


def inspect_checkpoint(path: Path) -> TrainState:
    """Check every file of checkpoint ``path`` without loading it into a model: the train
    state, the metadata, the model tensors against the stored config, and every tensor entry
    (CRCs, dtypes, shapes). Returns the train state.

    Raises:
        TrainingError: naming the file and what is wrong with it.
    """
    state = load_train_state(path)
    checked = safe_dcp.read_metadata(path)
    _check_model_tensors(path, checked, state.config)
    safe_dcp.verify_data(path, checked)
    return state


def load_training_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState | None = None,
) -> None:
    """Load model and optimizer state from ``path`` in place, collectively; any number of
    processes, DDP or FSDP2, whatever the checkpoint was saved with. ``state`` is the
    checkpoint's train state if already loaded.

    Raises:
        TrainingError: a file is damaged or unsafe, or the stored tensors or optimizer
            hyper-parameters do not match ``model`` and ``optimizer``; all is checked before
            anything is changed, except a data entry found corrupt while loading.
    """
    if state is None:
        state = load_train_state(path)
    checked = safe_dcp.read_metadata(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors = _tensor_state(model_state, optim_state)
    expected = {
        f"model.{key}": (tuple(value.shape), value.dtype) for key, value in tensors["model"].items()
    } | {
        f"optim.state.{key}.{name}": (tuple(value.shape), value.dtype)
        for key, values in tensors["optim"]["state"].items()
        for name, value in values.items()
    }
    _check_tensors(path, expected, checked.tensors(""), "model and optimizer")
    live = _param_groups(optim_state)
    groups = match_saved(
        path, "optimizer.param_groups", state.param_groups, _hyper_parameters(live)
    )
    with _quiet_single_process():
        safe_dcp.load(path, checked, tensors, distributed=dist.is_initialized())
    optim = {
        "state": tensors["optim"]["state"],
        "param_groups": [
            {**group, "params": template["params"]}
            for group, template in zip(groups, live, strict=True)
        ],
    }
    set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=optim)


def read_model_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's full state dict from a checkpoint, in this process alone (no process group
    needed; whole tensors on CPU whatever the sharding it was saved with). Keys are the plain
    ``EarlyFusion``'s: ``decoder.*`` and ``encoders.image.*``.

    Nothing is allocated before the metadata is checked: every tensor has its bytes in the
    data files.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike.
        TrainingError: ``path`` is not a readable, intact DCP checkpoint with model weights.
    """
    path = checkpoint_dir(path)
    checked = safe_dcp.read_metadata(path)
    stored = checked.tensors("model.")
    if not stored:
        raise fail(path / METADATA, "holds no model weights")
    try:
        state = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in stored.items()}
    except RuntimeError as error:  # the allocator's refusal
        raise TrainingError(f"checkpoint {path}: cannot allocate its weights: {error}") from None
    wrapped = {"model": state}
    with _quiet_single_process():
        safe_dcp.load(path, checked, wrapped, distributed=False)
    return wrapped["model"]


def load_model(path: str | os.PathLike) -> tuple[EarlyFusion, TrainConfig]:
    """A single-process ``EarlyFusion`` (on CPU, in eval mode) and the config of checkpoint
    ``path``, loaded with ``strict=True``.

    The stored config is checked (types, ranges) and the stored tensors compared with the
    model it describes before the model is built.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike.
        TrainingError: a file of the checkpoint is missing, damaged, unsafe or inconsistent
            with the others; the message names the file (and key).
    """
    from recipes.captioner.model import build_model

    path = checkpoint_dir(path)
    config = load_train_state(path).config
    _check_model_tensors(path, safe_dcp.read_metadata(path), config)
    with torch.random.fork_rng(devices=[]):  # the initial values are overwritten anyway
        model = build_model(config)
    model.load_state_dict(read_model_state_dict(path), strict=True)
    return model.eval(), config
