import os
from pathlib import Path

import pytest
import torch

from fusion.checkpoint import select_prefix
from recipes.captioner import (
    build_decoder,
    load_model,
    read_model_state_dict,
)
from recipes.captioner import train_checkpoint as ckpt
from recipes.captioner.errors import TrainingError


def test_round_trip_into_a_single_process_model_and_a_plain_decoder(small, tmp_path):
    model, optimizer = small.model_and_optimizer()
    path = small.save(tmp_path, 1, model, optimizer)
    assert path == tmp_path / "step_00000001" and ckpt.latest_checkpoint(tmp_path) == path
    loaded, config = load_model(path)
    assert config == small.config
    for (name, expected), actual in zip(
        model.state_dict().items(), loaded.state_dict().values(), strict=True
    ):
        assert torch.equal(expected, actual), name
    decoder = build_decoder(config)
    decoder.load_state_dict(select_prefix(read_model_state_dict(path), "decoder."), strict=True)
    assert torch.equal(decoder.tok_embeddings.weight, model.decoder.tok_embeddings.weight)


def test_training_state_resumes_exactly(small, tmp_path):
    model, optimizer = small.model_and_optimizer(seed=0)
    path = small.save(tmp_path, 1, model, optimizer)
    fresh, fresh_optimizer = small.model_and_optimizer(seed=1)
    ckpt.load_training_checkpoint(path, fresh, fresh_optimizer)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    saved = optimizer.state_dict()["state"]
    for key, value in fresh_optimizer.state_dict()["state"].items():
        assert torch.equal(value["exp_avg"], saved[key]["exp_avg"])
        assert torch.equal(value["exp_avg_sq"], saved[key]["exp_avg_sq"])
        assert torch.equal(value["step"], saved[key]["step"])
    state = ckpt.load_train_state(path)
    assert state.step == 1 and len(state.rng) == 1
    torch.manual_seed(123)
    state.rng_of(0).restore(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state.rng[0].cpu)


def test_only_the_latest_checkpoints_are_kept(small, tmp_path):
    model, optimizer = small.model_and_optimizer()
    for step in (1, 2, 3, 4):
        small.save(tmp_path, step, model, optimizer, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_saving_a_step_again_replaces_it_whole(small, tmp_path):
    model, optimizer = small.model_and_optimizer(seed=0)
    small.save(tmp_path, 1, model, optimizer)
    (tmp_path / ".trash-step_00000000-1").mkdir()  # as left by a crash while pruning
    other, other_optimizer = small.model_and_optimizer(seed=1)
    path = small.save(tmp_path, 1, other, other_optimizer)
    loaded, _ = load_model(path)
    for a, b in zip(loaded.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("where", ["dcp_save", "train_state"])
def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(
    small, tmp_path, monkeypatch, where
):
    model, optimizer = small.model_and_optimizer()
    previous = small.save(tmp_path, 1, model, optimizer)
    before = _snapshot(tmp_path)

    def crash_in_dcp(state, *, checkpoint_id, **kwargs):  # some files written, then a failure
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError("disk full")

    def crash_in_train_state(path, data):
        path.write_bytes(data[:10])
        raise OSError("disk full")

    if where == "dcp_save":
        monkeypatch.setattr(ckpt.dcp, "save", crash_in_dcp)
    else:
        monkeypatch.setattr(ckpt, "atomic_write_bytes", crash_in_train_state)
    with pytest.raises(OSError, match="disk full"):
        small.save(tmp_path, 2, model, optimizer)
    monkeypatch.undo()

    assert ckpt.latest_checkpoint(tmp_path) == previous  # the temporary directory is no step
    assert {k: v for k, v in _snapshot(tmp_path).items() if k in before} == before
    load_model(previous)
    # The next save cleans up after the crash and commits normally.
    committed = small.save(tmp_path, 2, model, optimizer)
    assert ckpt.latest_checkpoint(tmp_path) == committed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_atomic_write_keeps_the_old_file_on_failure(small, tmp_path, monkeypatch):
    target = tmp_path / "file.bin"
    ckpt.atomic_write_bytes(target, b"old")

    def fail(fd):
        raise OSError("fsync failed")

    monkeypatch.setattr(ckpt.os, "fsync", fail)
    with pytest.raises(OSError, match="fsync failed"):
        ckpt.atomic_write_bytes(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["file.bin"]  # no temporary file left behind


def test_unreadable_checkpoints_raise_training_errors(small, tmp_path):
    bad = tmp_path / "step_00000001"
    bad.mkdir()
    (bad / ckpt.TRAIN_STATE).write_bytes(b"not a checkpoint")
    with pytest.raises(TrainingError, match=r"train_state\.json: is not valid JSON"):
        ckpt.load_train_state(bad)
    with pytest.raises(TrainingError, match=r"\.metadata: is missing"):
        read_model_state_dict(bad)
