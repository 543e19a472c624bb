"""Editing DCP checkpoint directories the way an attacker or a bad disk would, for the tests
of :mod:`fusion.training.safe_dcp` and of the recipes that read checkpoints."""

import io
import pathlib
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

DATA = "__0_0.distcp"


class Payload:
    """Unpickling it creates ``marker``: a harmless stand-in for arbitrary code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def edit_metadata(path: Path, edit) -> None:
    """Rewrite ``.metadata`` after ``edit(metadata)`` (plain pickle: the test's own file)."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    edit(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def append_entry(path: Path, index: MetadataIndex, data: bytes) -> None:
    """Point storage entry ``index`` at ``data``, appended to the data file."""
    with open(path / DATA, "ab") as f:
        offset = f.tell()
        f.write(data)
    edit_metadata(
        path,
        lambda md: md.storage_data.__setitem__(index, _StorageInfo(DATA, offset, len(data))),
    )


def storage_index(path: Path, key: str) -> MetadataIndex:
    """The storage index of tensor ``key`` (one chunk) in checkpoint ``path``."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    [index] = [i for i in metadata.storage_data if i.fqn == key]
    return index
