"""State dicts in files: safetensors (one file, or shards with their index) and torch files read
with ``torch.load(weights_only=True)``, which never unpickles objects.

A checkpoint directory is untrusted input: every failure is a :class:`CheckpointError` naming
the file and, where one is at fault, the key. Only regular files are read (links to them are
followed; FIFOs and devices refused). JSON files and safetensors headers are size-capped and
parsed strictly; a header must describe tensors that tile its data section exactly (as
safetensors requires) and is checked against the file size before any tensor is read. Headers
and tensors are read here rather than by ``safetensors``: its errors name no key, and
``safe_open`` refuses file names that are not UTF-8. A torch file's tensors must be dense CPU
tensors no larger than the storage behind them, its zip members stored, not compressed.
(Safetensors has no checksum: flipped bits inside a tensor cannot be detected.)

Every write goes through :func:`write_files`: what it replaces stays untouched until the new
files are complete and durable.
"""

import json
import math
import os
import pickle
import re
import secrets
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeGuard

import torch
from safetensors.torch import save_file

# The bounded readers moved to fusion.hf.files; imported ``as`` themselves, they stay importable
# from here.
from fusion.hf.errors import (
    CheckpointError,
    as_path,
    check_positive_int,
    check_state_dict,
    short_repr,
)
from fusion.hf.files import MAX_JSON_BYTES as MAX_JSON_BYTES
from fusion.hf.files import MAX_TOKENIZER_BYTES as MAX_TOKENIZER_BYTES
from fusion.hf.files import open_regular_file, parse_json, read_json
from fusion.hf.files import read_bounded as read_bounded
from fusion.hf.files import read_tokenizer as read_tokenizer

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_SINGLE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces

_DTYPES = {  # safetensors' names
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# The names a checkpoint of this library or Hugging Face uses; an overwrite replaces them all.
_CHECKPOINT_FILE = re.compile(
    r"model(-\d+-of-\d+(-[0-9a-f]+)?)?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(-\d+-of-\d+)?\.bin|pytorch_model\.bin\.index\.json"
)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a checkpoint lives, and what it is, known before reading it."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


class CheckpointFiles:
    """The tensors of a checkpoint, listed from headers (safetensors) without reading data.

    Args:
        path: a ``.safetensors`` file; a torch file (``.bin``, ``.pt``, ``.pth``, either
            serialization format); an index (``*.index.json``: a ``weight_map`` of key ->
            shard file name); or a directory holding ``model.safetensors``,
            ``model.safetensors.index.json``, ``pytorch_model.bin`` or
            ``pytorch_model.bin.index.json`` (safetensors preferred). str, bytes or PathLike.

    Attributes:
        path: the file or directory given.
        entries: key -> :class:`TensorEntry`, in file order.
        stored_bytes: the bytes of tensor data the files hold (storage shared by tensors of a
            torch file counted once).

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: no such file or no checkpoint in the directory; an unknown format; not
            a regular file; too large a header or JSON file; a corrupt, truncated or malformed
            file, header or index (wrong types, non-finite or absurd numbers, deep nesting); a
            missing shard; index and shards disagreeing on a key; a torch file with objects
            other than tensors, compressed members, or tensors that are sparse, quantized, on
            the meta device or larger than the storage behind them.
    """

    def __init__(self, path: str | bytes | os.PathLike) -> None:
        self.path = as_path(path, "path")
        self.entries: dict[str, TensorEntry] = {}
        self.stored_bytes = 0
        self._loaded: dict[str, torch.Tensor] = {}  # torch files are read whole
        self._ranges: dict[str, tuple[int, int]] = {}  # safetensors key -> bytes in its file
        file = _resolve(self.path)
        if file.name.endswith(".index.json"):
            self._read_index(file)
        else:
            self.entries = self._read_file(file)

    def load(self, key: str) -> torch.Tensor:
        """Read one tensor (on the CPU, in its stored dtype)."""
        if key not in self.entries:
            raise CheckpointError(self.path, key, "no such key in the checkpoint")
        if key in self._loaded:
            return self._loaded[key]
        entry, (start, end) = self.entries[key], self._ranges[key]
        data = bytearray(end - start)
        with open_regular_file(entry.file) as f:
            try:
                f.seek(start)
                complete = f.readinto(data) == len(data)
            except OSError as error:
                raise CheckpointError(entry.file, key, f"unreadable tensor: {error}") from error
        if not complete:
            raise CheckpointError(entry.file, key, "truncated since its header was read")
        if not data:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(entry.dtype).view(entry.shape)

    def load_all(self) -> dict[str, torch.Tensor]:
        """Read every tensor: key -> tensor (CPU, stored dtype), in file order."""
        return {key: self.load(key) for key in self.entries}

    def _read_file(self, file: Path) -> dict[str, TensorEntry]:
        if file.suffix == ".safetensors":
            entries, ranges = _read_header(file)
            self._ranges |= ranges
            self.stored_bytes += sum(end - start for start, end in ranges.values())
            return entries
        if file.suffix in TORCH_SUFFIXES:
            tensors = _torch_load(file)
            self._loaded |= tensors
            storages = {
                t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors.values()
            }
            self.stored_bytes += sum(s.nbytes() for s in storages.values())
            return {k: TensorEntry(file, tuple(t.shape), t.dtype) for k, t in tensors.items()}
        raise CheckpointError(
            file, None, f"unknown format: expected .safetensors, {', '.join(TORCH_SUFFIXES)}"
        )

    def _read_index(self, index: Path) -> None:
        content = read_json(index, "index")
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(index, "weight_map", "expected an object of key -> shard name")
        shards: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            # Shards live next to the index: a path elsewhere is refused, not followed.
            if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
                raise CheckpointError(
                    index, key, f"expected a shard file name, got {short_repr(name)}"
                )
            shards.setdefault(name, []).append(key)
        for name, keys in shards.items():
            shard = index.parent / name
            if not os.path.lexists(shard):
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
                    where = f"maps it to {weight_map[key]}" if key in weight_map else "omits it"
                    raise CheckpointError(shard, key, f"in this file, but {index.name} {where}")
            self.entries |= entries


def load_state_dict(path: str | bytes | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a whole checkpoint: a file, an index or a directory, as :class:`CheckpointFiles`.

    Returns:
        key -> tensor, on the CPU, in the stored dtypes, keys exactly as stored.

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: as :class:`CheckpointFiles`, naming the file and key.
    """
    return CheckpointFiles(path).load_all()


# ---------------------------------------------------------------------- reading files


def _resolve(path: Path) -> Path:
    """The file to start reading from: ``path`` itself, or the checkpoint in a directory."""
    if not path.is_dir():
        if not os.path.lexists(path):
            raise CheckpointError(path, None, "no such file or directory")
        return path  # anything but a regular file is refused when opened
    names = (SAFETENSORS_SINGLE, SAFETENSORS_INDEX, TORCH_SINGLE, TORCH_INDEX)
    present = [name for name in names if os.path.lexists(path / name)]
    if not present:
        raise CheckpointError(path, None, f"no checkpoint: expected one of {', '.join(names)}")
    if present[:2] == [SAFETENSORS_SINGLE, SAFETENSORS_INDEX]:
        raise CheckpointError(
            path,
            None,
            f"ambiguous: holds both {SAFETENSORS_SINGLE} and {SAFETENSORS_INDEX}; remove one",
        )
    return path / present[0]


def _is_int_list(value: object, length: int | None = None) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and (length is None or len(value) == length)
        and all(type(n) is int and 0 <= n < 2**63 for n in value)
    )


def _read_header(file: Path) -> tuple[dict[str, TensorEntry], dict[str, tuple[int, int]]]:
    """A safetensors file's entries and each key's byte range in the file, in file order, read
    and checked without reading tensor data."""
    with open_regular_file(file) as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(file, None, f"truncated: {size} bytes, shorter than a header")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(
                file,
                None,
                f"truncated or corrupt: the header claims {header_len} bytes, the file has "
                f"{size - 8} after the length field (and headers are capped at "
                f"{MAX_HEADER_BYTES})",
            )
        header = parse_json(f.read(header_len), file, "corrupt header")
    if not isinstance(header, dict):
        raise CheckpointError(file, None, "corrupt header: expected a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(file, "__metadata__", "expected an object of strings")
    tensors = []
    for key, info in header.items():
        fields = info if isinstance(info, dict) else {}
        name, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        dtype = _DTYPES.get(name) if isinstance(name, str) else None
        if isinstance(name, str) and dtype is None:
            raise CheckpointError(file, key, f"unsupported dtype {short_repr(name)}")
        if dtype is None or not _is_int_list(shape) or not _is_int_list(offsets, 2):
            raise CheckpointError(file, key, f"corrupt header entry {short_repr(info)}")
        (begin, end), nbytes = offsets, math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise CheckpointError(
                file,
                key,
                f"corrupt header: data offsets [{begin}, {end}) do not hold {short_repr(shape)} "
                f"{dtype} ({nbytes} bytes)",
            )
        tensors.append((begin, end, key, TensorEntry(file, tuple(shape), dtype)))
    tensors.sort(key=lambda t: t[:2])
    data_start, data_len, position = 8 + header_len, size - 8 - header_len, 0
    for begin, end, key, _ in tensors:
        if end > data_len:  # the first key whose bytes are missing
            raise CheckpointError(
                file,
                key,
                f"truncated: its data ends at byte {end} of the data section, which holds only "
                f"{data_len} bytes",
            )
        if begin != position:  # tensors must tile the data: no overlap (aliasing), no gap
            raise CheckpointError(
                file, key, f"corrupt header: data starts at byte {begin}, expected {position}"
            )
        position = end
    if position != data_len:
        raise CheckpointError(
            file, None, f"corrupt: {data_len - position} bytes after the last tensor's data"
        )
    entries = {key: entry for _, _, key, entry in tensors}
    return entries, {key: (data_start + b, data_start + e) for b, e, key, _ in tensors}


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    """``torch.load(weights_only=True)``: tensors and plain containers only, never objects."""
    with open_regular_file(file) as f:
        try:
            is_zip = zipfile.is_zipfile(f)
            if is_zip:
                with zipfile.ZipFile(f) as archive:
                    packed = [i.filename for i in archive.infolist() if i.compress_type]
                if packed:  # torch.save never compresses; inflating could dwarf the file
                    raise CheckpointError(file, None, f"compressed zip member {packed[0]!r}")
            f.seek(0)
            # Zip files are memory-mapped (nothing read up front) when torch can open the name,
            # which it cannot for names that are not UTF-8; legacy files are read whole.
            mmap = is_zip and _is_utf8(file)
            content = torch.load(
                file if mmap else f, map_location="cpu", weights_only=True, mmap=mmap
            )
        except CheckpointError:
            raise
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                file,
                None,
                f"refused by torch.load(weights_only=True), which never unpickles objects: {error}",
            ) from error
        except Exception as error:  # a hostile file can make torch raise nearly anything
            raise CheckpointError(
                file, None, f"unreadable (truncated or corrupt?): {error}"
            ) from error
    if not isinstance(content, dict):
        raise CheckpointError(
            file, None, f"expected a state dict (key -> tensor), got {type(content).__name__}"
        )
    for key, value in content.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                file, str(key), f"expected a tensor under a string key, got {type(value).__name__}"
            )
        if value.layout != torch.strided or value.device.type != "cpu" or value.is_quantized:
            raise CheckpointError(
                file,
                key,
                f"expected a dense CPU tensor, got layout {value.layout}, device "
                f"{value.device.type}, dtype {value.dtype}",
            )
        claimed, held = value.numel() * value.element_size(), value.untyped_storage().nbytes()
        if claimed > held:
            raise CheckpointError(
                file,
                key,
                f"claims {claimed} bytes but its storage holds {held} (an expanded or "
                "overlapping view): refused",
            )
    return content


def _is_utf8(path: Path) -> bool:
    return os.fsencode(path) == str(path).encode("utf-8", "replace")


# ---------------------------------------------------------------------- writing


def save_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    path: str | bytes | os.PathLike,
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write ``state_dict`` (key -> tensor) to ``path``, crash-safely (see :func:`write_files`):
    the checkpoint replaced stays loadable until the new one is complete, and a failed save
    removes what it wrote. (A crash between renames that change the layout, single file <->
    shards, can leave both ``model.safetensors`` and an index: loading refuses that as
    ambiguous rather than guessing.)

    Args:
        state_dict: the tensors (any device; written from the CPU, bit for bit; views and
            tensors sharing memory are stored as copies of their own).
        path: ``*.safetensors`` (one file); ``*.bin``/``*.pt``/``*.pth`` (``torch.save`` of a
            plain dict, readable with ``weights_only=True``); anything else is a directory,
            written as ``model.safetensors``, or as ``model-0000i-of-0000n.safetensors`` shards
            plus ``model.safetensors.index.json`` when the tensors exceed ``max_shard_size``.
        max_shard_size: bytes per shard (directories only); a tensor larger than it gets a shard
            of its own. None: one file.
        overwrite: replace an existing file (a symlink there is replaced, not followed), or the
            checkpoint files already in the directory (other files there are left alone).
            Otherwise their presence is an error, so that a stale index or shard is never mixed
            with the new ones.

    Returns:
        the files written.

    Raises:
        TypeError: ``state_dict`` not a mapping, ``path`` not a path, ``max_shard_size`` not an
            int, ``overwrite`` not a bool.
        ValueError: a non-string key or non-tensor value; a tensor on the meta device, sparse,
            quantized or sharded (a ``DTensor``: gather a full state dict first); for
            safetensors, the reserved key ``__metadata__`` or a dtype it cannot store;
            ``max_shard_size`` not positive or given for a single file.
        CheckpointError: the target exists and ``overwrite`` is False; the target directory is
            a file.
        OSError: the file system failed (the old checkpoint is then left as it was).
    """
    path = as_path(path, "path")
    check_save_options(max_shard_size, overwrite)
    is_file = path.suffix in (".safetensors", *TORCH_SUFFIXES)
    if max_shard_size is not None and is_file:
        raise ValueError(
            f"max_shard_size: applies to directories only, got {max_shard_size} with file {path}"
        )
    tensors = prepare_tensors(
        state_dict, "state_dict", safetensors=path.suffix not in TORCH_SUFFIXES
    )
    if not is_file:
        return write_checkpoint(tensors, path, max_shard_size=max_shard_size, overwrite=overwrite)
    if path.is_dir():
        raise CheckpointError(path, None, "is a directory; expected a file name")
    if os.path.lexists(path) and not overwrite:
        raise CheckpointError(path, None, "exists; pass overwrite=True to replace it")
    return write_files(path.parent, {path.name: partial(_write_tensors, tensors)})


def check_save_options(max_shard_size: object, overwrite: object) -> None:
    """Raise TypeError/ValueError naming ``max_shard_size`` or ``overwrite`` when invalid."""
    if max_shard_size is not None:
        check_positive_int(max_shard_size, "max_shard_size")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite: expected a bool, got {type(overwrite).__name__}")


def check_not_sharded(state_dict: Mapping[str, torch.Tensor], argument: str) -> None:
    """Refuse ``DTensor`` values (each process holds a shard), naming the first such key."""
    # No DTensor can exist unless its module was imported: do not import it here.
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for key, value in state_dict.items():
        if dtensor is not None and isinstance(value, dtensor):
            raise ValueError(
                f"{argument}: {key!r} is a DTensor, sharded (FSDP2, tensor parallelism): gather a "
                "full state dict first, e.g. torch.distributed.checkpoint.state_dict."
                "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))"
            )


def prepare_tensors(
    state_dict: Mapping[str, torch.Tensor], argument: str, *, safetensors: bool
) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors owning their storage, checked to be storable before any write.

    Raises:
        TypeError, ValueError: naming ``argument`` and the key, as :func:`save_state_dict`.
    """
    check_state_dict(state_dict, argument)
    check_not_sharded(state_dict, argument)
    tensors, storages = {}, set()
    for key, value in state_dict.items():
        if value.is_meta or value.layout != torch.strided or value.is_quantized:
            raise ValueError(
                f"{argument}: {key!r} has no dense data to save (device {value.device.type}, "
                f"layout {value.layout}, dtype {value.dtype})"
            )
        if safetensors and (key == "__metadata__" or value.dtype not in _DTYPES.values()):
            names = ", ".join(sorted(str(dtype) for dtype in _DTYPES.values()))
            raise ValueError(
                f"{argument}: {key!r} ({value.dtype}) cannot be stored in safetensors (the key "
                f"__metadata__ is reserved; dtypes: {names}); save to a .pt file"
            )
        tensor = value.detach().cpu().contiguous()
        # A view into a larger storage, or storage shared with another key (tied weights): store
        # a copy of its own, as safetensors requires and so that no file holds unrelated bytes.
        storage = tensor.untyped_storage()
        shared = tensor.numel() > 0 and storage.data_ptr() in storages
        if shared or storage.nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[key] = tensor
    return tensors


def write_checkpoint(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    *,
    max_shard_size: int | None,
    overwrite: bool,
    extra_files: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write prepared ``tensors`` (and ``extra_files``: name -> text, e.g. ``config.json``) into
    ``directory`` as :func:`save_state_dict` describes; the extra files are renamed in last.

    Raises:
        CheckpointError: an extra file or a checkpoint already there and ``overwrite`` False;
            ``directory`` a file, or one of the names a directory.
    """
    if os.path.lexists(directory) and not directory.is_dir():
        raise CheckpointError(directory, None, "exists and is not a directory")
    extra = dict(extra_files or {})
    for name in extra:
        if os.path.lexists(directory / name) and not overwrite:
            raise CheckpointError(directory / name, None, "exists; pass overwrite=True")
    existing = _checkpoint_files(directory) if directory.is_dir() else []
    if existing and not overwrite:
        raise CheckpointError(
            directory,
            None,
            f"already holds a checkpoint ({', '.join(existing)}); pass overwrite=True to "
            "replace it",
        )
    for name in {SAFETENSORS_SINGLE, SAFETENSORS_INDEX, *existing, *extra}:
        if (directory / name).is_dir() and not (directory / name).is_symlink():
            raise CheckpointError(directory / name, None, "is a directory; remove it first")
    shards = _split(tensors, max_shard_size)
    files: dict[str, str | bytes | Callable[[Path], None]] = {}
    if len(shards) == 1:
        files[SAFETENSORS_SINGLE] = partial(_write_tensors, shards[0])
    else:
        names = [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]
        if set(names) & set(existing):  # keep the old shards intact until the index flips
            tag = secrets.token_hex(4)
            names = [name.replace(".safetensors", f"-{tag}.safetensors") for name in names]
        for name, shard in zip(names, shards, strict=True):
            files[name] = partial(_write_tensors, shard)
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": dict(
                sorted((k, n) for n, s in zip(names, shards, strict=True) for k in s)
            ),
        }
        files[SAFETENSORS_INDEX] = json.dumps(index, indent=2) + "\n"
    files |= extra
    # Entry points first: a crash in between then leaves shards nothing refers to, not two
    # entry points (model.safetensors and an index) that loading refuses as ambiguous.
    stale = [name for name in existing if name not in files]
    stale.sort(key=lambda name: name not in (SAFETENSORS_SINGLE, SAFETENSORS_INDEX))
    return write_files(directory, files, remove=stale)


def _split(
    tensors: dict[str, torch.Tensor], max_shard_size: int | None
) -> list[dict[str, torch.Tensor]]:
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


def _checkpoint_files(directory: Path) -> list[str]:
    """The names in ``directory`` a checkpoint uses (links too, even dangling ones)."""
    return sorted(name for name in os.listdir(directory) if _CHECKPOINT_FILE.fullmatch(name))


def write_files(
    directory: Path,
    files: Mapping[str, str | bytes | Callable[[Path], None]],
    *,
    remove: Iterable[str] = (),
) -> list[Path]:
    """Write ``files`` into ``directory`` crash-safely, then remove the names in ``remove``.

    Each file is written and fsynced in a fresh private directory created exclusively inside
    ``directory`` (so no planted link is written through), then the files are renamed into
    place in the order given, each rename atomic and replacing a link rather than following
    it. Order them so that a crash between renames leaves something loadable (shards before
    the index naming them). If a rename fails before any existing file was replaced, the files
    already renamed in are removed again; the private directory is removed in any case.

    Args:
        directory: created (with its parents) if missing.
        files: name -> content: text (written as UTF-8), bytes, or a function that writes the
            file at the path it is given.
        remove: names to remove once every file is in place (stale files of what was replaced).

    Returns:
        the paths written, in order.

    Raises:
        OSError: the file system failed; what ``files`` replace is then left as it was unless a
            rename had already replaced one of them.
    """
    if not directory.is_dir():
        directory.mkdir(parents=True)
        fsync_path(directory.parent)
    staging = Path(tempfile.mkdtemp(prefix=".fusion-save-", suffix=".tmp", dir=directory))
    try:
        for name, content in files.items():
            if isinstance(content, str | bytes):
                _write_bytes(staging / name, content)
            else:
                content(staging / name)
            fsync_path(staging / name)
        moved: list[str] = []
        replaced = False
        try:
            for name in files:
                existed = os.path.lexists(directory / name)
                os.replace(staging / name, directory / name)
                moved.append(name)
                replaced = replaced or existed
        except BaseException:
            if not replaced:  # nothing that was there has changed: leave none of the new files
                for name in moved:
                    (directory / name).unlink(missing_ok=True)
            raise
        fsync_path(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for name in remove:
        (directory / name).unlink(missing_ok=True)
    fsync_path(directory)
    return [directory / name for name in files]


def _write_tensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    if file.suffix == ".safetensors":
        save_file(tensors, file, metadata={"format": "pt"})
    else:
        torch.save(tensors, file)


def _write_bytes(file: Path, content: str | bytes) -> None:
    with open(file, "xb") as f:  # exclusive: never through a planted link
        f.write(content.encode() if isinstance(content, str) else content)


def fsync_path(path: Path) -> None:
    """Make a file's content, or a directory's entries (new, renamed, removed), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
