"""A cheap fingerprint of a model directory's weights, so that a checkpoint holding only the
tensors that train (LoRA adapters, a connector) can refuse a base model that changed.

Reading every byte of a model of many gigabytes at each start would cost seconds to minutes,
so each weight file is fingerprinted by its size, its safetensors header (every key, dtype,
shape and offset) and blocks of its data spread evenly through it: any retraining of the
weights changes nearly every block, a different architecture changes the header. Two files
equal in those blocks but different elsewhere are not told apart: it guards against a wrong
or replaced directory, not against an adversary.
"""

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

from fusion._io import NotRegularFile, open_regular
from fusion.checkpoint.files import _checkpoint_files
from fusion.training.errors import TrainingError
from fusion.training.state import TrainState

CONFIG = "config.json"
BLOCKS = 16
BLOCK_BYTES = 64 << 10
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def _file_fingerprint(file: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of ``file``'s header (safetensors) and sampled
    blocks (the whole file when it holds at most ``BLOCKS`` blocks)."""
    digest = hashlib.sha256()
    try:
        with open_regular(file) as handle:
            size = os.fstat(handle.fileno()).st_size
            if file.name.endswith(".safetensors") and size >= 8:
                (length,) = struct.unpack("<Q", handle.read(8))
                digest.update(handle.read(min(length, MAX_HEADER_BYTES, size - 8)))
            if size <= BLOCKS * BLOCK_BYTES:
                handle.seek(0)
                digest.update(handle.read())
            else:
                stride = (size - BLOCK_BYTES) // (BLOCKS - 1)
                for index in range(BLOCKS):
                    handle.seek(index * stride)
                    digest.update(handle.read(BLOCK_BYTES))
    except NotRegularFile:
        raise TrainingError(f"{file}: not a regular file") from None
    except OSError as error:
        raise TrainingError(f"{file}: cannot be read ({error.strerror or error})") from None
    return {"size": size, "sha256": digest.hexdigest()}


def model_fingerprint(directory: str | os.PathLike) -> dict[str, Any]:
    """``{name: {"size", "sha256"}}`` for ``config.json`` and every weight file of
    ``directory`` (``model*.safetensors``, ``pytorch_model*.bin`` and their indexes), by name
    relative to it (the directory may move).

    Raises:
        TrainingError: ``directory`` is not a directory, or a file cannot be read.
    """
    path = Path(directory)
    if not path.is_dir():
        raise TrainingError(f"{path}: expected a model directory")
    names = [CONFIG] if (path / CONFIG).exists() else []
    return {name: _file_fingerprint(path / name) for name in [*names, *_checkpoint_files(path)]}


def fingerprint_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, one phrase per file (empty when equal)."""
    changes = []
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            changes.append(f"{name} is gone")
        elif name not in saved:
            changes.append(f"{name} is new")
        elif saved[name] != current[name]:
            was, now = saved[name], current[name]
            what = "size" if was.get("size") != now.get("size") else "content"
            changes.append(f"{name} changed ({what})")
    return changes


def check_base_model(
    path: Path, state: TrainState, model_dir: str | os.PathLike, *, flag: str = "--model"
) -> None:
    """Refuse checkpoint ``path`` (its train state ``state``) when it holds only the tensors
    that train (``state.trainable_only``) and ``model_dir``, the base given by ``flag``, is no
    longer the one it was trained on (:func:`model_fingerprint` against
    ``state.base_model``). A checkpoint of the whole model needs no base and passes.

    Raises:
        TrainingError: naming the checkpoint and the files that changed, or a checkpoint with
            no fingerprint to check against.
    """
    if not state.trainable_only:
        return
    if state.base_model is None:
        raise TrainingError(
            f"--resume: {path} holds only the trained tensors but no fingerprint of its base "
            f"model, so {flag} cannot be checked"
        )
    changes = fingerprint_changes(state.base_model, model_fingerprint(model_dir))
    if changes:
        raise TrainingError(
            f"--resume: {path} holds only the trained tensors of a run on another base "
            f"model: in {flag} {model_dir}, {'; '.join(changes)} since it was saved; "
            "resume with the model directory it was trained on"
        )
