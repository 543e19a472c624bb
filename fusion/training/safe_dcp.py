"""Read ``torch.distributed.checkpoint`` (DCP) directories without executing code from them.

DCP's own ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` and loads
non-tensor entries with ``torch.load(weights_only=False)``: a planted object runs code. Here a
checkpoint directory is untrusted input:

- ``.metadata`` is unpickled by an unpickler that admits only the DCP metadata classes,
  ``torch.Size``, dtypes and the strided layout, then checked field by field (entries inside
  their data files, chunks that tile each tensor exactly, bytes present for every chunk);
- only tensor entries are read, each from its own byte range, which must be an uncompressed
  zip whose CRCs match, with ``torch.load(weights_only=True)``, and must hold a plain strided
  tensor of the recorded dtype and shape; non-tensor (pickled) entries are refused;
- every file is opened as a regular file (never a FIFO or a device) and capped in size.
"""

import io
import itertools
import os
import pathlib
import pickle
import re
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from fusion._io import FileTooLarge, NotRegularFile, open_regular, read_limited
from fusion.training.errors import TrainingError, one_line

METADATA = ".metadata"
# Far above what a model's metadata needs (about 1 KB per tensor), far below a memory problem.
MAX_METADATA_BYTES = 256 << 20
MAX_CHUNKS_PER_TENSOR = 4096
_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def fail(file: Path, message: str) -> TrainingError:
    """The error for a problem with ``file`` of a checkpoint directory."""
    return TrainingError(f"checkpoint {file.parent}: {file.name}: {message}")


def open_checked(file: Path) -> BinaryIO:
    """Open ``file`` for reading, refusing anything but a regular file (a FIFO would block,
    a device such as ``/dev/zero`` never ends).

    Raises:
        TrainingError: the file is missing, unreadable or not a regular file.
    """
    try:
        return open_regular(file)
    except FileNotFoundError:
        raise fail(file, "is missing") from None
    except NotRegularFile:
        raise fail(file, "is not a regular file") from None
    except OSError as error:
        raise fail(file, f"cannot be opened ({error.strerror or error})") from None


def read_regular_file(file: Path, *, limit: int) -> bytes:
    """The whole content of the regular file ``file``, at most ``limit`` bytes.

    Raises:
        TrainingError: missing, not a regular file, larger than ``limit`` or unreadable.
    """
    with open_checked(file) as f:
        try:
            return read_limited(f, limit, file)
        except FileTooLarge as error:
            if error.size is None:
                raise fail(file, f"is more than the {limit} bytes allowed") from None
            raise fail(file, f"is {error.size} bytes, more than the {limit} allowed") from None
        except OSError as error:
            raise fail(file, f"cannot be read ({error.strerror or error})") from None


# ---------------------------------------------------------------------------------- metadata


def _strided(name: str) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: only the layout DCP can load."""
    if name != "torch.strided":
        raise pickle.UnpicklingError(f"layout {name!r} is not allowed")
    return torch.strided


# What a DCP ``.metadata`` pickle may name, mapped to what it gets. Paths (the checkpoint id
# recorded at save time) become pure paths, which do no I/O.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", cls.__name__): cls
    for cls in (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _MEM_FORMAT_ENCODING,
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _strided,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the names in ``_ALLOWED`` and the dtypes: nothing it can build runs code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a persistent id: not DCP metadata")


@dataclass(frozen=True)
class _Chunk:
    """What a tensor entry of a data file must hold."""

    dtype: torch.dtype
    sizes: tuple[int, ...]


class _Checker:
    """Checks a ``Metadata`` object field by field; ``chunks`` maps every storage index of a
    tensor chunk to what its bytes must hold."""

    def __init__(self, file: Path):
        self.file = file
        self.chunks: dict[MetadataIndex, _Chunk] = {}

    def fail(self, message: str) -> TrainingError:
        return fail(self.file, message)

    def size(self, value: Any, what: str) -> tuple[int, ...]:
        if type(value) is not torch.Size or any(type(v) is not int or v < 0 for v in value):
            raise self.fail(f"{what}: expected a torch.Size of sizes >= 0, got {value!r:.80}")
        return tuple(value)

    def tensor(self, key: str, meta: TensorStorageMetadata) -> None:
        props = meta.properties
        if type(props) is not TensorProperties or props.dtype not in _DTYPES:
            raise self.fail(f"{key}: unsupported tensor properties {props!r:.120}")
        if props.layout is not torch.strided:
            raise self.fail(f"{key}: expected a strided tensor, got layout {props.layout}")
        size = self.size(meta.size, key)
        chunks = meta.chunks
        if type(chunks) is not list or not 0 < len(chunks) <= MAX_CHUNKS_PER_TENSOR:
            raise self.fail(f"{key}: expected 1 to {MAX_CHUNKS_PER_TENSOR} chunks")
        boxes = []
        for chunk in chunks:
            if type(chunk) is not ChunkStorageMetadata:
                raise self.fail(f"{key}: malformed chunk {chunk!r:.80}")
            offsets = self.size(chunk.offsets, f"{key} chunk offsets")
            sizes = self.size(chunk.sizes, f"{key} chunk sizes")
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True))
            ):
                box = f"chunk at {list(offsets)} of {list(sizes)}"
                raise self.fail(f"{key}: {box} lies outside the tensor's {list(size)}")
            boxes.append((offsets, sizes))
            self.chunks[MetadataIndex(key, chunk.offsets)] = _Chunk(props.dtype, sizes)
        # Chunks inside the tensor, pairwise disjoint and as large as it in total tile it
        # exactly: no element is left unread (it would keep uninitialised memory).
        if _overlapping(boxes):
            raise self.fail(f"{key}: chunks overlap")
        if sum(_numel(s) for _, s in boxes) != _numel(size):
            raise self.fail(f"{key}: chunks do not cover the tensor's {list(size)}")

    def check(self, metadata: Any) -> None:
        if type(metadata) is not Metadata:
            raise self.fail(f"expected DCP metadata, got {type(metadata).__name__}")
        entries = metadata.state_dict_metadata
        if type(entries) is not dict:
            raise self.fail("state_dict_metadata: expected a dict")
        for key, meta in entries.items():
            if type(key) is not str:
                raise self.fail(f"expected string keys, got {key!r:.80}")
            if type(meta) is BytesStorageMetadata:  # DCP would torch.load it with pickle
                raise self.fail(f"{key} is a pickled object; only tensors are loaded")
            if type(meta) is not TensorStorageMetadata:
                raise self.fail(f"{key}: unknown entry {type(meta).__name__}")
            self.tensor(key, meta)
        if metadata.version is not None and type(metadata.version) is not str:
            raise self.fail(f"version: expected a string, got {metadata.version!r:.80}")
        if metadata.storage_meta is not None and type(metadata.storage_meta) is not StorageMeta:
            raise self.fail("storage_meta: expected StorageMeta")
        self.storage(metadata.storage_data)

    def storage(self, storage: Any) -> None:
        if type(storage) is not dict:
            raise self.fail("storage_data: expected a dict")
        files: dict[str, int] = {}
        for index, info in storage.items():
            if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
                raise self.fail(f"storage_data: malformed entry {index!r:.80}")
            name = info.relative_path
            if type(name) is not str or not _DATA_FILE.match(name):
                # Never a path of its own: no entry may point outside the directory.
                raise self.fail(f"{index.fqn}: data file {name!r:.80} is not __<r>_<n>.distcp")
            if type(info.offset) is not int or type(info.length) is not int:
                raise self.fail(f"{index.fqn}: malformed byte range")
            if info.transform_descriptors:
                raise self.fail(f"{index.fqn}: stream transforms are not supported")
            if name not in files:
                files[name] = _file_size(self.file.parent / name)
            if info.offset < 0 or info.length < 0 or info.offset + info.length > files[name]:
                raise fail(
                    self.file.parent / name,
                    f"is {files[name]} bytes but {index.fqn} lies at bytes {info.offset} to "
                    f"{info.offset + info.length} (truncated?)",
                )
            chunk = self.chunks.get(index)
            if chunk is None:
                raise self.fail(f"storage_data: {index.fqn} is no tensor chunk")
            if info.length < _numel(chunk.sizes) * chunk.dtype.itemsize:
                raise self.fail(f"{index.fqn}: {info.length} bytes cannot hold its data")
        # Entries sharing bytes would let a small file stand for any number of tensors.
        ranges = sorted(
            (info.relative_path, info.offset, info.offset + info.length, index.fqn)
            for index, info in storage.items()
        )
        for (name_a, _, end_a, key_a), (name_b, start_b, _, key_b) in itertools.pairwise(ranges):
            if name_a == name_b and start_b < end_a:
                raise self.fail(f"{key_a} and {key_b} share bytes of {name_a}")
        missing = [i.fqn for i in self.chunks if i not in storage]
        if missing:
            raise self.fail(f"no data recorded for {missing[0]} ({len(missing)} entries)")


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two of the boxes ``(offsets, sizes)`` share an element. A sweep along dim 0
    compares only boxes whose dim-0 extents meet: O(n log n) for shards along dim 0."""
    if boxes and not boxes[0][0]:  # a 0-dim tensor: one element, so one chunk
        return len(boxes) > 1
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in sorted(boxes):
        active = [(o, s) for o, s in active if o[0] + s[0] > offsets[0]]
        for o, s in active:
            if all(
                max(a, b) < min(a + m, b + n)
                for a, m, b, n in zip(o, s, offsets, sizes, strict=True)
            ):
                return True
        active.append((offsets, sizes))
    return False


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _file_size(file: Path) -> int:
    try:
        st = os.stat(file)
    except FileNotFoundError:
        raise fail(file, "is missing") from None
    except OSError as error:
        raise fail(file, f"cannot be read ({error.strerror or error})") from None
    if not stat.S_ISREG(st.st_mode):
        raise fail(file, "is not a regular file")
    return st.st_size


@dataclass(frozen=True)
class CheckedMetadata:
    """DCP metadata that passed every check; ``chunks`` maps each tensor chunk's storage index
    to the dtype and shape its bytes must hold."""

    metadata: Metadata
    chunks: dict[MetadataIndex, _Chunk]

    def tensors(self, prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{key without prefix: (shape, dtype)}`` of the tensor entries under ``prefix``."""
        return {
            key.removeprefix(prefix): (tuple(meta.size), meta.properties.dtype)
            for key, meta in self.metadata.state_dict_metadata.items()
            if key.startswith(prefix) and type(meta) is TensorStorageMetadata
        }


def read_metadata(path: Path) -> CheckedMetadata:
    """The checked ``.metadata`` of DCP checkpoint directory ``path``.

    Raises:
        TrainingError: the file is missing, not a regular file, too large, not a DCP metadata
            pickle of the admitted classes (nothing else is ever constructed), or inconsistent
            with itself or with the sizes of the data files.
    """
    file = path / METADATA
    data = read_regular_file(file, limit=MAX_METADATA_BYTES)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except RecursionError:
        raise fail(file, "is nested too deeply to be DCP metadata") from None
    except Exception as error:  # any malformed pickle; nothing outside _ALLOWED was built
        reason = one_line(error)
        raise fail(
            file, f"is not readable DCP metadata (truncated or corrupt?): {reason}"
        ) from None
    checker = _Checker(file)
    try:
        checker.check(metadata)
    except (AttributeError, TypeError, ValueError, OverflowError) as error:
        raise fail(file, f"is malformed DCP metadata: {one_line(error)}") from None
    return CheckedMetadata(metadata, checker.chunks)


# ---------------------------------------------------------------------------------- data


def _read_entry(f: BinaryIO, file: Path, index: MetadataIndex, info: Any, chunk: _Chunk):
    """The tensor of one data-file entry: an uncompressed ``torch.save`` zip with good CRCs,
    loaded with ``weights_only=True``, of the recorded dtype and shape."""
    what = f"entry {index.fqn}"
    f.seek(info.offset)
    data = f.read(info.length)
    if len(data) != info.length:
        raise fail(file, f"{what} is cut short (truncated?)")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for member in archive.infolist():
                # torch.save stores members uncompressed; a compressed one could inflate a few
                # bytes on disk into any amount of memory.
                if member.compress_type != zipfile.ZIP_STORED:
                    raise fail(file, f"{what}: compressed member {member.filename!r:.80}")
            bad = archive.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as error:
        raise fail(file, f"{what} is not a tensor file (corrupt?): {one_line(error)}") from None
    if bad is not None:
        raise fail(file, f"{what}: member {bad!r:.80} fails its CRC check (corrupt)")
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # weights_only refused an object: loading it could run code
        raise fail(file, f"{what} holds objects other than tensors; refused") from None
    except Exception as error:  # malformed in some other way
        raise fail(file, f"{what} cannot be loaded: {one_line(error)}") from None
    if (
        type(tensor) not in (torch.Tensor, torch.nn.Parameter)
        or tensor.layout is not torch.strided
        or tensor.is_quantized
        or tensor.dtype != chunk.dtype
        or tuple(tensor.shape) != chunk.sizes
    ):
        got = (
            f"{tensor.dtype} {list(tensor.shape)}"
            if isinstance(tensor, torch.Tensor)
            else type(tensor).__name__
        )
        expected = f"a {chunk.dtype} tensor of {list(chunk.sizes)}"
        raise fail(file, f"{what}: expected {expected}, got {got}")
    return tensor


def verify_data(path: Path, checked: CheckedMetadata) -> None:
    """Read every tensor entry of checkpoint ``path`` and check it (CRCs, dtype, shape)
    without keeping it: the checkpoint would load.

    Raises:
        TrainingError: naming the file and entry that would not load.
    """
    storage = checked.metadata.storage_data
    by_file: dict[str, list[MetadataIndex]] = {}
    for index in checked.chunks:
        by_file.setdefault(storage[index].relative_path, []).append(index)
    for name, indices in sorted(by_file.items()):
        file = path / name
        with open_checked(file) as f:
            for index in indices:
                _read_entry(f, file, index, storage[index], checked.chunks[index])


class SafeFileSystemReader(FileSystemReader):
    """A DCP storage reader for a checkpoint whose metadata was read by :func:`read_metadata`:
    it never unpickles beyond that, reads tensors only, and checks each before use."""

    def __init__(self, path: Path, checked: CheckedMetadata):
        super().__init__(path)
        self.checked = checked

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP must not try rank-local files
        metadata = self.checked.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        directory = Path(self.path)
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:  # DCP would torch.load it with pickle
                key = item.storage_index.fqn
                raise fail(directory / METADATA, f"{key} is not a tensor; only tensors load")
            info = self.storage_data[item.storage_index]
            by_file.setdefault(info.relative_path, []).append(item)
        for name, items in by_file.items():
            file = directory / name
            with open_checked(file) as f:
                for item in items:
                    index = item.storage_index
                    tensor = _read_entry(
                        f, file, index, self.storage_data[index], self.checked.chunks[index]
                    )
                    for dim, (start, length) in enumerate(
                        zip(item.storage_offsets, item.lengths, strict=True)
                    ):
                        tensor = tensor.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.shape != tensor.shape:
                        shapes = f"{list(tensor.shape)} for {list(target.shape)}"
                        raise fail(file, f"entry {index.fqn}: shape {shapes}")
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def load(path: Path, checked: CheckedMetadata, state: dict[str, Any], *, distributed: bool):
    """``dcp.load`` of the tensors of ``state`` (in place) through :class:`SafeFileSystemReader`.

    Raises:
        TrainingError: the first failure of any process, as one line.
    """
    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(path, checked),
            no_dist=not distributed,
        )
    except CheckpointException as error:  # a BaseException carrying each rank's failure
        causes = [exc for exc, _ in error.failures.values()]
        ours = [exc for exc in causes if isinstance(exc, TrainingError)]
        if ours:
            raise TrainingError(str(ours[0])) from None
        first = causes[0] if causes else error
        raise TrainingError(f"checkpoint {path}: cannot be loaded: {one_line(first)}") from None
