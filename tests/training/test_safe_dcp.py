"""A DCP checkpoint directory is untrusted input: nothing in it runs, and every malformed
file is one ``TrainingError`` naming it, before anything is allocated."""

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
)

from dcp_helpers import DATA, Payload, append_entry, edit_metadata, storage_index, torch_bytes
from fusion.training import (
    TrainingError,
    load_training_checkpoint,
    read_model_state_dict,
    verify_checkpoint,
)

PLANTED = "model.norm.scale"  # a [32] float32 tensor every loader reads


@pytest.fixture(scope="module")
def saved(tmp_path_factory, trained) -> Path:
    return trained.saved(tmp_path_factory.mktemp("saved"))[3]


@pytest.fixture
def checkpoint(saved, tmp_path) -> Path:
    """A fresh copy of ``saved`` to damage."""
    path = tmp_path / saved.name
    path.mkdir()
    for file in saved.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    return path


def _loaders(path: Path, trained):
    model, optimizer, _ = trained.build(seed=1)
    return {
        "read_model_state_dict": lambda: read_model_state_dict(path),
        "verify_checkpoint": lambda: verify_checkpoint(path),
        "load_training_checkpoint": lambda: load_training_checkpoint(path, model, optimizer),
    }


def plant(kind: str, path: Path, marker: Path) -> bytes:
    """Plant a payload creating ``marker``; returns the bytes, which do run the payload when
    read the ordinary way (checked by the test)."""
    if kind == "metadata":  # DCP's reader: pickle.load
        data = pickle.dumps(Payload(marker))
        (path / ".metadata").write_bytes(data)
        return data
    data = torch_bytes(Payload(marker))
    if kind == "tensor_entry":  # DCP's reader of tensors: torch.load of the entry
        append_entry(path, storage_index(path, PLANTED), data)
    else:  # a non-tensor entry: DCP would torch.load(weights_only=False) it
        key = "optim.param_groups.0.lr"
        edit_metadata(
            path, lambda md: md.state_dict_metadata.__setitem__(key, BytesStorageMetadata())
        )
        append_entry(path, MetadataIndex(key), data)
    return data


PLANTED_KINDS = {
    "metadata": ".metadata: is not readable DCP metadata (truncated or corrupt?): refusing to "
    "load pathlib.Path.touch",
    "tensor_entry": f"{DATA}: entry {PLANTED} holds objects other than tensors; refused",
    "pickled_entry": ".metadata: optim.param_groups.0.lr is a pickled object",
}


@pytest.mark.parametrize("kind", PLANTED_KINDS)
def test_planted_code_never_runs(kind, checkpoint, trained, tmp_path):
    marker = tmp_path / "ran"
    data = plant(kind, checkpoint, marker)
    if kind == "metadata":
        pickle.loads(data)
    else:
        torch.load(io.BytesIO(data), weights_only=False)
    assert marker.exists()  # the payload is real: read the ordinary way, it runs
    marker.unlink()
    for name, load in _loaders(checkpoint, trained).items():
        with pytest.raises(TrainingError) as error:
            load()
        assert str(error.value).startswith(f"checkpoint {checkpoint}: {PLANTED_KINDS[kind]}"), name
        assert "\n" not in str(error.value)
    assert not marker.exists()


def _huge_tensor(md):
    """Claim 2**40 elements for a tensor whose bytes on disk hold a few."""
    meta = md.state_dict_metadata[PLANTED]
    meta.size = torch.Size([2**40])
    meta.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([2**40]))]


def _outside(md):
    [index] = [i for i in md.storage_data if i.fqn == PLANTED]
    md.storage_data[index] = _StorageInfo("../../../etc/passwd", 0, 10)


def _uncovered(md):
    md.state_dict_metadata[PLANTED].chunks[0].sizes = torch.Size([8])


def _overlapping(md):
    chunks = md.state_dict_metadata[PLANTED].chunks
    chunks.append(ChunkStorageMetadata(torch.Size([8]), torch.Size([8])))


def _shared_bytes(md):
    """Two tensors read from the same bytes: a small file standing for more tensors."""
    infos = {i.fqn: (i, v) for i, v in md.storage_data.items()}
    md.storage_data[infos[PLANTED][0]] = infos["model.tok_embeddings.weight"][1]


def _transform(md):
    [index] = [i for i in md.storage_data if i.fqn == PLANTED]
    md.storage_data[index].transform_descriptors = ["zstd"]


def _compressed(path: Path) -> None:
    source = zipfile.ZipFile(io.BytesIO(torch_bytes(torch.ones(32))))
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for info in source.infolist():
            archive.writestr(info.filename, source.read(info))
    append_entry(path, storage_index(path, PLANTED), data.getvalue())


def _wrong_dtype(path: Path) -> None:
    append_entry(
        path, storage_index(path, PLANTED), torch_bytes(torch.ones(32, dtype=torch.float64))
    )


def _flip_a_bit(path: Path) -> None:
    """Flip one bit of the stored values of a tensor: a well-formed file, wrong data."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    [info] = [v for i, v in metadata.storage_data.items() if i.fqn == PLANTED]
    data = bytearray((path / DATA).read_bytes())
    entry = bytes(data[info.offset : info.offset + info.length])
    values = torch.load(io.BytesIO(entry), weights_only=True).numpy().tobytes()
    data[info.offset + entry.index(values)] ^= 1
    (path / DATA).write_bytes(data)


def _truncated(path: Path) -> None:
    data = (path / DATA).read_bytes()
    (path / DATA).write_bytes(data[: len(data) // 2])


def _fifo(path: Path) -> None:
    (path / ".metadata").unlink()
    os.mkfifo(path / ".metadata")


def _dev_zero(path: Path) -> None:
    (path / ".metadata").unlink()
    (path / ".metadata").symlink_to("/dev/zero")


BAD_FILES = {
    "size without bytes": (lambda p: edit_metadata(p, _huge_tensor), "bytes cannot hold its data"),
    "path outside": (lambda p: edit_metadata(p, _outside), "is not __<r>_<n>.distcp"),
    "chunks not covering": (lambda p: edit_metadata(p, _uncovered), "chunks do not cover"),
    "overlapping chunks": (lambda p: edit_metadata(p, _overlapping), "chunks overlap"),
    "shared bytes": (lambda p: edit_metadata(p, _shared_bytes), "share bytes of __0_0.distcp"),
    "transforms": (lambda p: edit_metadata(p, _transform), "stream transforms are not supported"),
    "compressed entry": (_compressed, f"{DATA}: entry {PLANTED}: compressed member"),
    "wrong dtype": (_wrong_dtype, "expected a torch.float32 tensor of [32], got torch.float64"),
    "flipped bit": (_flip_a_bit, "fails its CRC check"),
    "truncated data": (_truncated, f"{DATA}: is "),
    "fifo": (_fifo, ".metadata: is not a regular file"),
    "/dev/zero": (_dev_zero, ".metadata: is not a regular file"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_files_are_refused(case, checkpoint, trained):
    damage, message = BAD_FILES[case]
    damage(checkpoint)
    for name, load in _loaders(checkpoint, trained).items():
        with pytest.raises(TrainingError, match=r"^checkpoint ") as error:
            load()
        assert message in str(error.value) and "\n" not in str(error.value), name
