"""Reading and writing state dicts: safetensors (one file, or shards with their index) and torch
files read with ``torch.load(weights_only=True)``. Nothing is ever unpickled beyond tensors and
plain containers.

Every failure is a :class:`CheckpointError` naming the file and, where one is at fault, the key.
Safetensors headers are parsed and checked against the file size before any tensor is read, so a
truncated file is reported with the first key whose bytes are missing. (Safetensors has no
checksums: flipped bytes inside a tensor's data cannot be detected by any reader.)
"""

import json
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fusion.checkpoint.errors import CheckpointError

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_SINGLE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a checkpoint lives, and what it is, known before reading it."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


class CheckpointFiles:
    """The tensors of a checkpoint, listed from headers (safetensors) without reading data.

    Args:
        path: a ``.safetensors`` file; a torch file (``.bin``, ``.pt``, ``.pth``); an index
            (``*.index.json`` with a ``weight_map`` of key -> shard file name); or a directory
            holding ``model.safetensors``, ``model.safetensors.index.json``,
            ``pytorch_model.bin`` or ``pytorch_model.bin.index.json`` (safetensors preferred).

    Attributes:
        path: the file or directory given.
        entries: key -> :class:`TensorEntry`, in file order.

    Raises:
        CheckpointError: no such file or no checkpoint in the directory; an unknown format; a
            corrupt or truncated file or index; a missing shard; a key listed in the index but
            not in its shard, or the other way round; a key in two shards.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._torch_files: dict[Path, dict[str, torch.Tensor]] = {}
        self.entries: dict[str, TensorEntry] = {}
        file = _resolve(self.path)
        if file.name.endswith(".index.json"):
            self._read_index(file)
        else:
            self.entries = self._read_file(file)

    def load(self, key: str) -> torch.Tensor:
        """Read one tensor (on the CPU, in its stored dtype)."""
        if key not in self.entries:
            raise CheckpointError(self.path, key, "no such key in the checkpoint")
        file = self.entries[key].file
        if file in self._torch_files:
            return self._torch_files[file][key]
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                return f.get_tensor(key)
        except (SafetensorError, OSError) as error:
            raise CheckpointError(file, key, f"unreadable tensor: {error}") from error

    def load_all(self) -> dict[str, torch.Tensor]:
        """Read every tensor: key -> tensor (CPU, stored dtype), in file order."""
        by_file: dict[Path, list[str]] = {}
        for key, entry in self.entries.items():
            by_file.setdefault(entry.file, []).append(key)
        tensors = {}
        for file, keys in by_file.items():
            if file in self._torch_files:
                tensors.update({key: self._torch_files[file][key] for key in keys})
                continue
            key = None
            try:
                with safe_open(file, framework="pt", device="cpu") as f:
                    for key in keys:
                        tensors[key] = f.get_tensor(key)
            except (SafetensorError, OSError) as error:
                raise CheckpointError(file, key, f"unreadable tensor: {error}") from error
        return {key: tensors[key] for key in self.entries}

    # ------------------------------------------------------------------ reading

    def _read_file(self, file: Path) -> dict[str, TensorEntry]:
        if file.suffix == ".safetensors":
            return _read_safetensors_header(file)
        if file.suffix in TORCH_SUFFIXES:
            tensors = _torch_load(file)
            self._torch_files[file] = tensors
            return {k: TensorEntry(file, tuple(t.shape), t.dtype) for k, t in tensors.items()}
        raise CheckpointError(
            file, None, f"unknown format: expected .safetensors, {', '.join(TORCH_SUFFIXES)}"
        )

    def _read_index(self, index: Path) -> None:
        weight_map = _read_weight_map(index)
        shards: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            shards.setdefault(name, []).append(key)
        for name, keys in shards.items():
            shard = index.parent / name
            if not shard.is_file():
                raise CheckpointError(
                    shard,
                    keys[0],
                    f"missing shard: {index.name} lists it for {len(keys)} key(s), but the "
                    "file does not exist",
                )
            entries = self._read_file(shard)
            for key in keys:
                if key not in entries:
                    raise CheckpointError(
                        shard, key, f"listed in {index.name} but not in this file"
                    )
            for key in entries:
                if weight_map.get(key) != name:
                    raise CheckpointError(
                        shard,
                        key,
                        f"in this file, but {index.name} "
                        + (f"maps it to {weight_map[key]}" if key in weight_map else "omits it"),
                    )
            self.entries.update(entries)


def _resolve(path: Path) -> Path:
    """The file to start reading from: ``path`` itself, or the checkpoint in a directory."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(path, None, "no such file or directory")
    single, index = path / SAFETENSORS_SINGLE, path / SAFETENSORS_INDEX
    if single.is_file() and index.is_file():
        raise CheckpointError(
            path, None, f"ambiguous: holds both {single.name} and {index.name}; remove one"
        )
    for name in (SAFETENSORS_SINGLE, SAFETENSORS_INDEX, TORCH_SINGLE, TORCH_INDEX):
        if (path / name).is_file():
            return path / name
    raise CheckpointError(
        path,
        None,
        f"no checkpoint: expected one of {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, "
        f"{TORCH_SINGLE}, {TORCH_INDEX}",
    )


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        content = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(index, None, f"unreadable index: {error}") from error
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(index, "weight_map", "expected an object of key -> shard file name")
    for key, name in weight_map.items():
        # Shards live next to the index: a path elsewhere is refused, not followed.
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(index, key, f"expected a shard file name, got {name!r}")
    return weight_map


def _read_safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """Parse and check the header of a safetensors file without reading tensor data."""
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(file, None, f"truncated: {size} bytes, shorter than a header")
        header_len = int.from_bytes(prefix, "little")
        if header_len > size - 8:
            raise CheckpointError(
                file,
                None,
                f"truncated or corrupt: the header claims {header_len} bytes, the file has "
                f"{size - 8} after the length field",
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(file, None, f"corrupt header: {error}") from error
    if not isinstance(header, dict):
        raise CheckpointError(file, None, "corrupt header: expected a JSON object")
    data_len = size - 8 - header_len
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(file, key, f"corrupt header entry {info!r}") from error
        expected = dtype.itemsize
        for n in shape:
            expected *= n
        if end - begin != expected or begin < 0:
            raise CheckpointError(
                file,
                key,
                f"corrupt header: data offsets [{begin}, {end}) do not hold {list(shape)} "
                f"{dtype} ({expected} bytes)",
            )
        if end > data_len:
            raise CheckpointError(
                file,
                key,
                f"truncated: its data ends at byte {end} of the data section, which holds only "
                f"{data_len} bytes",
            )
        entries[key] = (begin, TensorEntry(file, shape, dtype))
    return {key: entry for key, (_, entry) in sorted(entries.items(), key=lambda kv: kv[1][0])}


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    """``torch.load(weights_only=True)``: tensors and plain containers only, never objects."""
    try:
        content = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            file,
            None,
            f"refused by torch.load(weights_only=True), which never unpickles objects: {error}",
        ) from error
    except (RuntimeError, OSError, EOFError, ValueError) as error:
        raise CheckpointError(file, None, f"unreadable (truncated or corrupt?): {error}") from error
    if not isinstance(content, dict):
        raise CheckpointError(
            file, None, f"expected a state dict (key -> tensor), got {type(content).__name__}"
        )
    for key, value in content.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                file, str(key), f"expected a tensor under a string key, got {type(value).__name__}"
            )
    return content


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a whole checkpoint: a file, an index or a directory, as :class:`CheckpointFiles`.

    Returns:
        key -> tensor, on the CPU, in the stored dtypes, keys exactly as stored.

    Raises:
        CheckpointError: as :class:`CheckpointFiles`, naming the file and key.
    """
    return CheckpointFiles(path).load_all()


# ---------------------------------------------------------------------- writing


def save_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write ``state_dict`` (key -> tensor) to ``path``; each file is written atomically.

    Args:
        state_dict: the tensors (any device; written from the CPU, bit for bit).
        path: ``*.safetensors`` (one file); ``*.bin``/``*.pt``/``*.pth`` (``torch.save`` of a
            plain dict, readable with ``weights_only=True``); anything else is a directory,
            written as ``model.safetensors``, or as ``model-0000i-of-0000n.safetensors`` shards
            plus ``model.safetensors.index.json`` when the tensors exceed ``max_shard_size``.
        max_shard_size: bytes per shard (directories only); a tensor larger than it gets a shard
            of its own. None: one file.
        overwrite: replace an existing file, or the checkpoint files already in the directory
            (other files there are left alone). Otherwise their presence is an error, so that a
            stale index or shard is never mixed with the new ones.

    Returns:
        the files written.

    Raises:
        CheckpointError: the target exists and ``overwrite`` is False.
        ValueError: a non-string key or non-tensor value; ``max_shard_size`` not positive or
            given for a single file.
    """
    path = Path(path)
    tensors = _prepare_tensors(state_dict)
    is_file = path.suffix == ".safetensors" or path.suffix in TORCH_SUFFIXES
    if max_shard_size is not None and (max_shard_size <= 0 or is_file):
        raise ValueError(
            "max_shard_size: expected a positive byte count with a directory path, got "
            f"{max_shard_size} with path {path}"
        )
    if is_file:
        if path.exists() and not overwrite:
            raise CheckpointError(path, None, "exists; pass overwrite=True to replace it")
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(tensors, path)
        return [path]

    path.mkdir(parents=True, exist_ok=True)
    existing = _existing_checkpoint_files(path)
    if existing and not overwrite:
        names = ", ".join(sorted(f.name for f in existing))
        raise CheckpointError(
            path, None, f"already holds a checkpoint ({names}); pass overwrite=True to replace it"
        )
    for file in existing:
        file.unlink()
    shards = _split(tensors, max_shard_size)
    if len(shards) == 1:
        _write(shards[0], path / SAFETENSORS_SINGLE)
        return [path / SAFETENSORS_SINGLE]
    written, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write(shard, path / name)
        weight_map.update(dict.fromkeys(shard, name))
        written.append(path / name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _atomic_write_text(path / SAFETENSORS_INDEX, json.dumps(index, indent=2) + "\n")
    return [*written, path / SAFETENSORS_INDEX]


def _prepare_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors, storages = {}, set()
    for key, value in state_dict.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(
                f"state_dict: expected string keys and tensor values, got {key!r} -> "
                f"{type(value).__name__}"
            )
        tensor = value.detach().cpu().contiguous()
        # safetensors refuses tensors that share memory (tied weights, views): store copies.
        if tensor.untyped_storage().data_ptr() in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[key] = tensor
    return tensors


def _split(tensors: dict[str, torch.Tensor], max_shard_size: int | None) -> list[dict]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_size is not None and shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def _existing_checkpoint_files(directory: Path) -> list[Path]:
    patterns = ("model.safetensors*", "model-*-of-*.safetensors", "pytorch_model*.bin*")
    return sorted({f for pattern in patterns for f in directory.glob(pattern) if f.is_file()})


def _write(tensors: dict[str, torch.Tensor], file: Path) -> None:
    tmp = file.with_name(file.name + ".tmp")
    if file.suffix == ".safetensors":
        save_file(tensors, tmp, metadata={"format": "pt"})
    else:
        torch.save(tensors, tmp)
    _fsync_replace(tmp, file)


def _atomic_write_text(file: Path, text: str) -> None:
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(text)
    _fsync_replace(tmp, file)


def _fsync_replace(tmp: Path, file: Path) -> None:
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, file)
