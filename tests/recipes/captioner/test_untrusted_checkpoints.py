"""A training checkpoint directory is untrusted input: nothing in it runs, nothing malformed
gets past a check before something is built or allocated, and every failure is one
``TrainingError`` naming the file (and the key). Malformed DCP files are
``tests/training/test_safe_dcp.py``'s; here the captioner's loaders and ``--resume``."""

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
)

import recipes.captioner.model
from dcp_helpers import DATA, Payload, append_entry, edit_metadata, torch_bytes
from fusion.training import load_training_checkpoint
from recipes.captioner import TrainingError, load_model, main, read_model_state_dict
from recipes.captioner.state import inspect_checkpoint

PLANTED = "model.decoder.norm.scale"  # a model tensor every loader reads


def resume_argv(output_dir: Path) -> list[str]:
    """Flags that resume the run in ``output_dir`` for one more step (its configuration is
    the checkpoint's)."""
    return ["--resume", "--output-dir", str(output_dir), "--steps", "2", "--no-progress"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, small) -> Path:
    """An intact checkpoint at step 1 of a run directory: ``<run>/checkpoints/step_00000001``."""
    model, optimizer = small.model_and_optimizer()
    return small.save(tmp_path_factory.mktemp("saved") / "run" / "checkpoints", 1, model, optimizer)


@pytest.fixture
def checkpoint(saved, tmp_path) -> Path:
    """A fresh copy of ``saved`` to damage."""
    run = tmp_path / "run"
    shutil.copytree(saved.parent.parent, run)
    return run / "checkpoints" / saved.name


# ---------------------------------------------------------------------------------- planted code


def plant(kind: str, path: Path, marker: Path) -> bytes:
    """Plant a payload creating ``marker`` in the file of ``kind``; returns the planted bytes,
    which do run the payload when read the ordinary way (checked by the test)."""
    if kind == "metadata":  # DCP's reader: pickle.load
        data = pickle.dumps(Payload(marker))
        (path / ".metadata").write_bytes(data)
    elif kind == "tensor_entry":  # DCP's reader of tensors: torch.load of the entry
        data = torch_bytes(Payload(marker))
        metadata = pickle.loads((path / ".metadata").read_bytes())
        [index] = [i for i in metadata.storage_data if i.fqn == PLANTED]
        append_entry(path, index, data)
    elif kind == "pickled_entry":  # DCP's reader of non-tensors: torch.load(weights_only=False)
        data = torch_bytes(Payload(marker))
        key = "optim.param_groups.0.lr"
        edit_metadata(
            path, lambda md: md.state_dict_metadata.__setitem__(key, BytesStorageMetadata())
        )
        append_entry(path, MetadataIndex(key), data)
    elif kind == "train_state":
        data = pickle.dumps(Payload(marker))
        (path / "train_state.json").write_bytes(data)
    elif kind == "legacy_train_state":  # format 1: a torch file
        data = torch_bytes({"format": 1, "step": 1, "payload": Payload(marker)})
        (path / "train_state.json").unlink()
        (path / "train_state.pt").write_bytes(data)
    return data


def naive_read(kind: str, data: bytes) -> None:
    if kind in ("metadata", "train_state"):
        pickle.loads(data)
    else:
        torch.load(io.BytesIO(data), weights_only=False)


KINDS = {  # kind: what the error must say, after naming the file
    "metadata": ".metadata: is not readable DCP metadata (truncated or corrupt?): refusing to "
    "load pathlib.Path.touch",
    "tensor_entry": f"{DATA}: entry {PLANTED} holds objects other than tensors; refused",
    "pickled_entry": ".metadata: optim.param_groups.0.lr is a pickled object",
    "train_state": "train_state.json: is not UTF-8 text",
    "legacy_train_state": "train_state.json: is missing: this checkpoint has a train_state.pt "
    "(format 1",
}


@pytest.mark.parametrize("kind", KINDS)
def test_planted_code_never_runs(kind, checkpoint, small, tmp_path, capsys):
    marker = tmp_path / "ran"
    data = plant(kind, checkpoint, marker)
    naive_read(kind, data)  # the payload is real: read the ordinary way, it runs
    assert marker.exists()
    marker.unlink()

    model, optimizer = small.model_and_optimizer()
    loaders = {
        "load_model": lambda: load_model(checkpoint),
        "read_model_state_dict": lambda: read_model_state_dict(checkpoint),
        "load_training_checkpoint": lambda: load_training_checkpoint(checkpoint, model, optimizer),
    }
    for name, load in loaders.items():
        if name == "read_model_state_dict" and "train_state" in kind:
            load()  # reads no train state: nothing planted to refuse
            continue
        with pytest.raises(TrainingError) as error:
            load()
        assert f"checkpoint {checkpoint}: {KINDS[kind]}" in str(error.value), name
        assert "\n" not in str(error.value)
    assert main(resume_argv(checkpoint.parent.parent)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and KINDS[kind] in err and "no intact checkpoint" in err
    assert not marker.exists()


# ---------------------------------------------------------------------------------- bad values


def _set(path: list, value):
    """An edit of the parsed train state: ``value`` at ``path`` (keys and indices)."""

    def edit(state):
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _replace(old: str, new: str):
    """An edit of the file's text (for what JSON values cannot hold)."""
    return lambda text: text.replace(old, new, 1)


MALFORMED = {
    "string": (_set(["config", "lr"], "abc"), "key 'config.lr': expected float, got 'abc'"),
    "list": (_set(["config", "decoder_dim"], [16]), "'config.decoder_dim': expected int, got a "),
    "bool": (_set(["config", "seed"], True), "key 'config.seed': expected int, got True"),
    "infinity": (
        _replace('"lr": 0.003', '"lr": Infinity'),
        "key 'config.lr': expected a finite number, got inf",
    ),
    "1e30": (
        _replace('"decoder_dim": 16', '"decoder_dim": 1e30'),
        "key 'config.decoder_dim': expected int, got 1e+30",
    ),
    "5000 digits": (
        _replace('"decoder_dim": 16', '"decoder_dim": ' + "9" * 5000),
        "'config.decoder_dim': expected an integer of at most 19 digits, got an integer of 5000",
    ),
    "deep nesting": (
        _replace('"seed": 0', '"seed": ' + "[" * 100_000 + "]" * 100_000),
        "train_state.json: is nested too deeply",
    ),
    "out of range": (_set(["config", "decoder_dim"], -16), "'config.decoder_dim': expected a posi"),
    "huge": (_set(["config", "num_train"], 2**40), "'config.num_train': expected at most"),
    "sizes that do not fit": (
        _set(["config", "decoder_heads"], 3),
        "key 'config.decoder_dim': expected a multiple of key 'config.decoder_heads'=3",
    ),
    "bad choice": (_set(["config", "parallel"], "zero"), "'config.parallel': expected one of"),
    "unknown config key": (_set(["config", "evil"], 1), "unknown keys ['evil']"),
    "negative step": (_set(["step"], -1), "key 'step': expected an integer in [0, "),
    "data position": (
        _set(["samples_seen"], 7),
        "key 'samples_seen': expected 64 (step 1 x config.batch_size 64), got 7",
    ),
    "epoch": (_set(["epoch"], 0), "key 'epoch': expected 8 (samples_seen // config.num_train 8)"),
    "losses": (_set(["losses"], "x"), "key 'losses': expected a list of 1, got 'x'"),
    "rng": (
        _set(["rng", 0, "python", 1], [1, 2]),
        "key 'rng[0].python[1]': expected a list of 625",
    ),
    "rng bytes": (_set(["rng", 0, "torch"], "!!"), "key 'rng[0].torch': expected base64 bytes"),
    "format": (_set(["format"], 1), "key 'format': expected 2, got 1"),
    "duplicate key": (_replace('"step": 1,', '"step": 1, "step": 2,'), "key 'step' appears twice"),
    "not UTF-8": (_replace('"parallel": "none"', '"parallel": "\udcff"'), "is not UTF-8 text"),
    "truncated": (lambda text: text[: len(text) // 2], "is not valid JSON (truncated or corrupt?)"),
    "empty": (lambda text: "", "is not valid JSON"),
    # Well-formed values that do not describe the stored tensors: refused before building.
    "layer count": (
        _set(["config", "decoder_layers"], 10**9),
        "config has 1000000001 layers, but the checkpoint holds only",
    ),
    "width": (
        _set(["config", "decoder_dim"], 32),
        ".metadata: its model tensors do not match: differ",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_train_state_is_refused_before_anything_is_built(case, checkpoint, monkeypatch):
    edit, message = MALFORMED[case]
    file = checkpoint / "train_state.json"
    text = file.read_text()
    if edit.__name__ == "edit":
        state = json.loads(text)
        edit(state)
        text = json.dumps(state)
    else:
        text = edit(text)
    file.write_bytes(text.encode("utf-8", "surrogateescape"))

    built_on = []  # the default device whenever a model is built: only ever "meta" here
    build = recipes.captioner.model.build_model

    def recording_build(config):
        built_on.append(torch.empty(0).device.type)
        return build(config)

    monkeypatch.setattr(recipes.captioner.model, "build_model", recording_build)
    for load in (load_model, inspect_checkpoint):
        with pytest.raises(TrainingError) as error:
            load(checkpoint)
        assert message in str(error.value) and str(checkpoint) in str(error.value)
        assert "\n" not in str(error.value)
    assert set(built_on) <= {"meta"}


# ---------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("load", [load_model, read_model_state_dict])
def test_loader_arguments(load, saved, tmp_path):
    for bad in (123, None, b"/tmp", ["a"]):
        with pytest.raises(TypeError, match=r"^path: expected a str or os\.PathLike, got "):
            load(bad)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    run = saved.parent.parent
    cases = {
        tmp_path / "missing": "does not exist",
        a_file: "is not a directory",
        empty: "has neither train_state.json nor .metadata",
        run: f"(its latest checkpoint is {saved})",  # a run directory, not a checkpoint
    }
    for path, message in cases.items():
        with pytest.raises(TrainingError, match=r"^path: ") as error:
            load(str(path))
        assert message in str(error.value)


def test_a_directory_name_that_is_not_utf8(small, tmp_path):
    model, optimizer = small.model_and_optimizer()
    path = small.save(tmp_path / os.fsdecode(b"run-\xff"), 1, model, optimizer)
    loaded, config = load_model(path)
    assert config == small.config
    for name, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
