"""A LoRA model's state split in two: the base model's (its plain keys, exactly) and the
adapters' (saved apart, in a safetensors file)."""

import json
import os
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from fusion._io import open_regular
from fusion.checkpoint.files import (
    CheckpointFiles,
    check_not_sharded,
    prepare_tensors,
    write_files,
)
from fusion.hf.errors import CheckpointError, as_path
from fusion.lora.apply import lora_linears, lora_settings

METADATA_KEY = "fusion_lora"  # safetensors metadata: layer name -> {"rank": r, "alpha": a}
_ADAPTER_PARAMETERS = ("lora_a.", "lora_b.")


def _adapter_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Key prefixes of every adapter's parameters, under every name its layer is reachable by
    (a state dict lists a shared module under each of them)."""
    adapted = {id(m) for m in lora_linears(model).values()}
    return tuple(
        f"{name}.{child}" if name else child
        for name, module in model.named_modules(remove_duplicate=False)
        if id(module) in adapted
        for child in _ADAPTER_PARAMETERS
    )


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' entries of ``model.state_dict()``: ``<layer>.lora_a.weight`` and
    ``<layer>.lora_b.weight`` for every adapted layer, keys as ``model`` names them.

    Adapters are found by the layers that carry them, never by key names: a module of yours
    named ``lora_a`` is base state. Under FSDP2 the values are ``DTensor`` shards.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    prefixes = _adapter_prefixes(model)
    return {k: v for k, v in model.state_dict().items() if k.startswith(prefixes)}


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the adapters: the keys of the model before
    :func:`~fusion.lora.apply_lora`, exactly, and its tensors (the base weights, unmerged).
    ``plain_model.load_state_dict(base_state_dict(model), strict=True)`` loads.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    prefixes = _adapter_prefixes(model)
    return {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}


def _settings(model: nn.Module) -> dict[str, dict[str, float]]:
    return {
        name: {"rank": settings.rank, "alpha": settings.alpha}
        for name, settings in ((n, lora_settings(m)) for n, m in lora_linears(model).items())
    }


def save_adapter(
    model: nn.Module, path: str | bytes | os.PathLike, *, overwrite: bool = False
) -> Path:
    """Write ``model``'s adapters (:func:`adapter_state_dict`) to a safetensors file, with each
    layer's rank and alpha in the file's metadata; crash-safely (written and fsynced aside,
    renamed into place: a file being replaced stays whole until the new one is complete).

    Args:
        model: a module with adapters, unsharded (gather a full state dict under FSDP2).
        path: a ``.safetensors`` file name; its directory is created if needed.
        overwrite: replace an existing file (a link there is replaced, not followed).

    Returns:
        the file written.

    Raises:
        TypeError: ``model`` not an ``nn.Module``; ``path`` not a path; ``overwrite`` not a
            bool.
        ValueError: ``model`` has no adapters; ``path`` does not end in ``.safetensors``; an
            adapter is sharded (``DTensor``) or on the meta device.
        CheckpointError: ``path`` exists and ``overwrite`` is False, or is a directory.
        OSError: the file system failed (an existing file is then left as it was).
    """
    file = as_path(path, "path")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite: expected a bool, got {type(overwrite).__name__}")
    if file.suffix != ".safetensors":
        raise ValueError(f"path: expected a .safetensors file name, got {str(file)!r}")
    state = adapter_state_dict(model)
    if not state:
        raise ValueError("model: has no LoRA adapters (see fusion.lora.apply_lora)")
    tensors = prepare_tensors(state, "model", safetensors=True)
    if file.is_dir():
        raise CheckpointError(file, None, "is a directory; expected a file name")
    if os.path.lexists(file) and not overwrite:
        raise CheckpointError(file, None, "exists; pass overwrite=True to replace it")
    metadata = {"format": "pt", METADATA_KEY: json.dumps(_settings(model), sort_keys=True)}
    write = partial(save_file, tensors, metadata=metadata)
    return write_files(file.parent, {file.name: lambda target: write(target)})[0]


def load_adapter(model: nn.Module, path: str | bytes | os.PathLike) -> None:
    """Load adapters saved by :func:`save_adapter` into ``model``'s adapters, in place.

    ``model`` must carry the same adapters (same layers and rank, from
    :func:`~fusion.lora.apply_lora` with the same targets): the file's keys must equal
    :func:`adapter_state_dict`'s, shapes included, and each layer's alpha recorded in the file
    must equal the model's (else the same weights would compute something else). Everything is
    checked before any weight is copied; values are cast to the adapters' dtype and device.

    Raises:
        TypeError: ``model`` not an ``nn.Module``; ``path`` not a path.
        ValueError: ``model`` has no adapters, or they are sharded (``DTensor``: load before
            sharding, or through ``torch.distributed.checkpoint``).
        CheckpointError: the file is missing, not a regular file, corrupt or truncated; a
            missing or unexpected key, a shape, a non-floating dtype, a rank or alpha that
            differs from the model's (named).
    """
    file = as_path(path, "path")
    ours = adapter_state_dict(model)
    if not ours:
        raise ValueError("model: has no LoRA adapters (see fusion.lora.apply_lora)")
    check_not_sharded(ours, "model")
    files = CheckpointFiles(file)
    missing = sorted(set(ours) - set(files.entries))
    unexpected = sorted(set(files.entries) - set(ours))
    if missing or unexpected:
        key = (missing or unexpected)[0]
        raise CheckpointError(
            file,
            key,
            f"the file's adapters differ from the model's: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]} (apply_lora with the targets the file was saved with, to the "
            "same module the file was saved from)",
        )
    for key, param in ours.items():
        entry = files.entries[key]
        if entry.shape != tuple(param.shape) or not entry.dtype.is_floating_point:
            raise CheckpointError(
                file,
                key,
                f"expected a floating tensor of shape {tuple(param.shape)} (the model's rank), "
                f"got {entry.dtype} of shape {entry.shape}",
            )
    _check_settings(file, _settings(model))
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key in ours:
            params[key].copy_(files.load(key))


def _check_settings(file: Path, ours: dict[str, dict[str, float]]) -> None:
    """Each layer's rank and alpha recorded in the file's metadata equal ``ours``."""
    with open_regular(file) as f:  # CheckpointFiles checked the header's length and JSON
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    recorded = header.get("__metadata__", {}).get(METADATA_KEY)
    if recorded is None:
        raise CheckpointError(
            file, "__metadata__", f"no {METADATA_KEY!r} entry: not an adapter file"
        )
    try:
        theirs = json.loads(recorded)
    except ValueError as error:
        raise CheckpointError(
            file, "__metadata__", f"unreadable {METADATA_KEY!r}: {error}"
        ) from None
    for name, settings in ours.items():
        saved = theirs.get(name) if isinstance(theirs, dict) else None
        if saved != settings:
            raise CheckpointError(
                file,
                name,
                f"saved with LoRA settings {saved}, the model's are {settings}: apply_lora with "
                "the same rank and alpha",
            )
