"""Crash-safe training checkpoints (what resuming needs) in ``torch.distributed.checkpoint``
(DCP) format; the library's model files are :mod:`fusion.checkpoint`'s business.

A checkpoint is a directory ``<output_dir>/checkpoints/step_00001000/`` (the step in 8 digits)
holding the DCP files of the tensors of ``{"model": ..., "optim": {"state": ...}}`` (one file
per process, each fsynced, plus ``.metadata``) and ``train_state.json`` (a
:class:`~fusion.training.state.TrainState`: step, data position, losses, config, scheduler, the
optimizer's hyper-parameters, RNG states). It is written under a temporary name and renamed
into place only when complete, so a crash at any moment leaves every earlier checkpoint intact
and never exposes a partial one. DCP checkpoints reshard: one saved by N processes (DDP or
FSDP2) resumes on M processes, and loads into a plain single-process model
(:func:`read_model_state_dict`).

A checkpoint directory is untrusted input: loading never executes code from it (no pickle
beyond the restricted reading of DCP's ``.metadata`` in :mod:`fusion.training.safe_dcp`), and
tensor keys, shapes and dtypes are checked against the live model before anything is
allocated or loaded. Nothing here knows what the model is: a recipe builds it (on the meta
device to check a checkpoint for free) and parses its own config (``parse_config`` of
:func:`~fusion.training.state.load_train_state`).

Resuming, as a recipe does it::

    root = checkpoint_root(output_dir)
    path, state, damaged = newest_intact_checkpoint(root, inspect)  # inspect: Path -> state
    set_aside_damaged(damaged, path, warn)         # step_<N>.damaged, never deleted
    ...build model, optimizer, scheduler...
    restore_checkpoint(path, state, model, optimizer, scheduler, rank=rank, device=device)
    ...train...
    save_checkpoint(root, model, optimizer, new_state, device=device, keep=2)
"""

import dataclasses
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from fusion.checkpoint.files import fsync_path, write_files
from fusion.training import safe_dcp
from fusion.training.errors import TrainingError
from fusion.training.safe_dcp import METADATA, CheckedMetadata, fail
from fusion.training.state import (
    TRAIN_STATE,
    RngState,
    TrainState,
    load_train_state,
    match_param_groups,
    match_saved,
)

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
S = TypeVar("S")


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    """Where a run in ``output_dir`` keeps its checkpoints: ``<output_dir>/checkpoints``."""
    return Path(output_dir) / CHECKPOINTS


def check_writable(output_dir: Path, root: Path) -> None:
    """Create ``root`` (a run's checkpoint root in ``output_dir``, :func:`checkpoint_root`) and
    write a file in it, as a save will, so an unwritable ``--output-dir`` fails before training.

    Raises:
        TrainingError: ``root`` cannot be created or written in; names ``--output-dir``.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as error:
        raise TrainingError(
            f"--output-dir: {output_dir} is not writable ({error.strerror or error})"
        ) from error


def step_dir(root: Path, step: int) -> Path:
    """The checkpoint directory of ``step`` under ``root``: ``step_XXXXXXXX`` (8 digits)."""
    return root / f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``root`` as ``(step, path)``, oldest first. Temporary
    directories of interrupted saves and checkpoints set aside as damaged are not listed."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    ]
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest committed checkpoint under ``root`` (intact or not), or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a mix
    (the library's crash-safe writer: staged, fsynced, renamed over ``path``).

    Raises:
        OSError: the file system failed; ``path`` is then as it was.
    """
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


_OPTIM_STATE = "optim.state."  # the prefix of the optimizer's tensors in the DCP files


def _options(trainable_only: bool) -> StateDictOptions:
    """Frozen parameters left out of the model's state dict (and not required when
    loading) with ``trainable_only``."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


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
    trainable_only: bool = False,
) -> Path:
    """Save a checkpoint of ``state.step`` collectively (every process calls this) and commit
    it: ``root/step_XXXXXXXX``, replacing one of the same step whole.

    With ``trainable_only`` the model's frozen parameters (``requires_grad=False``: the base
    under LoRA adapters, say) are not saved, only what trains, the buffers and the optimizer
    state: megabytes instead of the whole model. Resuming then needs the same frozen base
    loaded into the model first (the recipe's to check, e.g. with ``state.base_model``);
    :func:`read_model_state_dict` gives only the saved tensors.

    Args:
        root: the checkpoints directory (:func:`checkpoint_root`); created if missing.
        model, optimizer: plain, DDP-wrapped or FSDP2-sharded; saved through
            ``get_state_dict`` so keys are the unwrapped model's.
        state: the training state; its ``param_groups`` and ``rng`` are replaced by the
            optimizer's hyper-parameters and the RNG states of every process.
        device: this process's device (whose RNG state is saved besides the CPU's).
        keep: how many committed checkpoints to keep (>= 1); older ones are removed after
            the commit.
        trainable_only: save only the parameters that train (recorded in the train state,
            which :func:`load_training_checkpoint` follows).

    Returns:
        the committed checkpoint directory.

    Raises:
        ValueError: ``keep`` is below 1.
        OSError: the file system failed; earlier checkpoints are intact, and the next save
            removes what this one left.
    """
    if type(keep) is not int or keep < 1:
        raise ValueError(f"keep: expected an integer >= 1, got {keep!r:.40}")
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

    model_state, optim_state = get_state_dict(model, optimizer, options=_options(trainable_only))
    param_groups = _hyper_parameters(_param_groups(optim_state))
    with _quiet_single_process():  # every file is fsynced before .metadata is renamed in
        dcp.save(
            _tensor_state(model_state, optim_state), checkpoint_id=tmp, no_dist=not distributed
        )
    if rank == 0:
        state = dataclasses.replace(
            state, param_groups=param_groups, rng=rng, trainable_only=trainable_only
        )
        atomic_write_bytes(tmp / TRAIN_STATE, state.encode())
        fsync_path(tmp)
        _commit(tmp, final)
        for _, old in list_checkpoints(root)[:-keep]:
            _remove_dir(old)
    if distributed:
        dist.barrier()
    return final


# ---------------------------------------------------------------------------------- checking


def checkpoint_dir(path: Any, name: str = "path") -> Path:
    """``path`` as an existing checkpoint directory (one with ``train_state.json`` or
    ``.metadata``).

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        TrainingError: it does not exist, is not a directory or is no checkpoint (naming
            argument ``name``, and the latest checkpoint when ``path`` is a run's directory).
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


def check_tensors(
    path: Path,
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
    what: str,
) -> None:
    """Check that ``stored`` (``{key: (shape, dtype)}`` of checkpoint ``path``) has exactly
    the keys, shapes and dtypes of ``expected``; ``what`` names them in the message.

    Raises:
        TrainingError: naming up to 3 missing, unexpected and differing keys of each kind.
    """
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


def check_model_tensors(path: Path, checked: CheckedMetadata, model: nn.Module) -> None:
    """Check that checkpoint ``path`` (its metadata ``checked``) holds exactly ``model``'s
    state-dict tensors under ``model.``: keys, shapes, dtypes. ``model`` may live on the meta
    device (built without memory, to check before anything is allocated).

    Raises:
        TrainingError: naming the keys that differ.
    """
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    check_tensors(path, expected, checked.tensors("model."), "model")


def verify_checkpoint(path: Path, model: nn.Module | None = None) -> CheckedMetadata:
    """Check every tensor file of checkpoint ``path`` without loading it into a model: the
    metadata, the model tensors against ``model`` (if given; the meta device will do), and
    every tensor entry (CRCs, dtypes, shapes). Returns the checked metadata.

    Raises:
        TrainingError: naming the file and what is wrong with it.
    """
    checked = safe_dcp.read_metadata(path)
    if model is not None:
        check_model_tensors(path, checked, model)
    safe_dcp.verify_data(path, checked)
    return checked


def newest_intact_checkpoint(
    root: Path, inspect: Callable[[Path], S], flag: str = "--resume"
) -> tuple[Path, S, list[tuple[Path, str]]]:
    """The newest checkpoint under ``root`` that ``inspect`` accepts, what ``inspect``
    returned for it (the recipe's train state), and the newer ones it refused, each with the
    reason. Changes nothing on disk (:func:`set_aside_damaged` does, once the run starts).

    Args:
        root: the checkpoints directory.
        inspect: checks one checkpoint directory (say :func:`load_train_state`, then
            :func:`verify_checkpoint` against the model on the meta device), raising
            ``TrainingError`` when it is damaged or does not fit.
        flag: the recipe's flag that asked to resume, named in the messages.

    Raises:
        TrainingError: there is no checkpoint, or none is intact (naming what is wrong with
            each).
    """
    damaged: list[tuple[Path, str]] = []
    for _, path in reversed(list_checkpoints(root)):
        try:
            state = inspect(path)
        except TrainingError as error:
            damaged.append((path, str(error)))
        else:
            return path, state, damaged
    if not damaged:
        raise TrainingError(
            f"{flag}: no checkpoint in {root} (expected step_<N> directories); "
            f"run without {flag} to start a new run"
        )
    reasons = "; ".join(reason for _, reason in damaged)
    raise TrainingError(f"{flag}: no intact checkpoint in {root}: {reasons}")


def set_aside(path: Path) -> Path:
    """Rename the damaged checkpoint ``path`` out of the ``step_<N>`` names (never delete it):
    to ``step_<N>.damaged`` (or ``.damaged-2``, ...). A resumed run would otherwise replace it
    when it saves that step again, and the next resume would trip over it again. Returns the
    new path.

    Raises:
        OSError: the rename failed.
    """
    target = path.with_name(f"{path.name}.damaged")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{n}")
    os.replace(path, target)
    fsync_path(path.parent)
    return target


def set_aside_damaged(
    damaged: list[tuple[Path, str]], resumed: Path, warn: Callable[[str], None]
) -> list[Path]:
    """:func:`set_aside` each of ``damaged`` (as :func:`newest_intact_checkpoint` returns
    them) and ``warn`` about each in one line: what is wrong with it, that the run resumes from
    ``resumed``, and where the damaged one is kept. Returns the new paths.

    Raises:
        OSError: a rename failed.
    """
    kept = []
    for path, reason in damaged:
        kept.append(set_aside(path))
        warn(
            f"{reason}; resuming from the older {resumed.name}; the damaged one is kept as "
            f"{kept[-1]}"
        )
    return kept


# ---------------------------------------------------------------------------------- loading


def load_training_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState | None = None,
) -> None:
    """Load model and optimizer state from ``path`` in place, collectively; any number of
    processes, DDP or FSDP2, whatever the checkpoint was saved with. ``state`` is the
    checkpoint's train state if already loaded. A ``trainable_only`` checkpoint loads the
    parameters that train (they must be exactly the saved ones); the frozen ones are left as
    they are, so the model must hold its base already.

    Raises:
        TrainingError: a file is damaged or unsafe, or the stored tensors or optimizer
            hyper-parameters do not match ``model`` and ``optimizer``; all is checked before
            anything is changed, except a data entry found corrupt while loading.
    """
    if state is None:
        state = load_train_state(path)
    checked = safe_dcp.read_metadata(path)
    options = _options(state.trainable_only)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    tensors = _tensor_state(model_state, optim_state)
    # A trained parameter that never had a gradient (a layer whose output nothing uses, such
    # as the last layer of LLaVA's vision tower) has no optimizer state: torch's optimizers
    # create it at the first step that sees a gradient. The checkpoint then holds none for it,
    # and it is left without any here too, as it was (so the run goes on bit for bit); a
    # parameter with some of its state missing is still refused.
    saved_states = {
        name.removeprefix(_OPTIM_STATE).rsplit(".", 1)[0]
        for name in checked.tensors("")
        if name.startswith(_OPTIM_STATE)
    }
    stateless = [key for key in tensors["optim"]["state"] if key not in saved_states]
    for key in stateless:
        del tensors["optim"]["state"][key]
    if stateless:  # torch's strict loading would ask for their state; the check below is ours
        options = dataclasses.replace(options, strict=False)
    expected = {
        f"model.{key}": (tuple(value.shape), value.dtype) for key, value in tensors["model"].items()
    } | {
        f"optim.state.{key}.{name}": (tuple(value.shape), value.dtype)
        for key, values in tensors["optim"]["state"].items()
        for name, value in values.items()
    }
    check_tensors(path, expected, checked.tensors(""), "model and optimizer")
    live = _param_groups(optim_state)
    groups = match_param_groups(path, state.param_groups, _hyper_parameters(live))
    with _quiet_single_process():
        safe_dcp.load(path, checked, tensors, distributed=dist.is_initialized())
    optim = {
        "state": tensors["optim"]["state"],
        "param_groups": [
            {**group, "params": template["params"]}
            for group, template in zip(groups, live, strict=True)
        ],
    }
    set_state_dict(
        model,
        optimizer,
        model_state_dict=tensors["model"],
        optim_state_dict=optim,
        options=options,
    )


def restore_checkpoint(
    path: Path,
    state: TrainState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    rank: int,
    device: torch.device,
) -> None:
    """Resume from checkpoint ``path`` whose train state is ``state``, collectively: the
    model's and optimizer's tensors and hyper-parameters, the scheduler's state, and process
    ``rank``'s RNG states (a rank the checkpoint has none for takes rank 0's).

    Raises:
        TrainingError: a file of the checkpoint is damaged or does not fit the model,
            optimizer or scheduler; the scheduler state is checked before anything is loaded.
    """
    # Checked against the live scheduler's own state before anything is loaded.
    scheduler_state = match_saved(path, "scheduler", state.scheduler, scheduler.state_dict())
    load_training_checkpoint(path, model, optimizer, state)
    scheduler.load_state_dict(scheduler_state)
    state.rng_of(rank).restore(device)


def read_model_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's full state dict from a checkpoint, in this process alone (no process group
    needed; whole tensors on CPU whatever the sharding it was saved with). Keys are the plain
    (unwrapped) model's, as ``model.state_dict()`` gives them.

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


def load_model_tensors(path: Path, model: nn.Module, *, trainable_only: bool = False) -> None:
    """Load checkpoint ``path``'s model tensors into the plain single-process ``model`` in
    place (say to export what a run trained): all of them, or with ``trainable_only`` (a
    checkpoint :func:`save_checkpoint` wrote so) those of the parameters that train and the
    buffers, the frozen base left as ``model`` holds it (loaded from where the run read it).

    Raises:
        TrainingError: the stored tensors are not exactly the ones ``model`` expects (keys,
            shapes, dtypes), found before anything is allocated; a damaged checkpoint.
    """
    # The frozen parameters save_checkpoint leaves out (get_state_dict's ignore_frozen_params).
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    expected = {
        key: (tuple(value.shape), value.dtype)
        for key, value in model.state_dict().items()
        if not (trainable_only and key in frozen)
    }
    check_tensors(path, expected, safe_dcp.read_metadata(path).tensors("model."), "model")
    model.load_state_dict(read_model_state_dict(path), strict=not trainable_only)
