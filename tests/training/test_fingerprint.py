"""The fingerprint of a model directory's weights: stable when the directory moves, changed
by any retrained weights, a new architecture (header) or a missing file; and checkpoints that
hold only what trains."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from fusion.training import (
    TrainingError,
    load_train_state,
    load_training_checkpoint,
    save_checkpoint,
)
from fusion.training.fingerprint import fingerprint_changes, model_fingerprint
from fusion.training.safe_dcp import read_metadata


def write_model(directory, seed=0, shape=(300, 300)):
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {"a": torch.randn(shape, generator=generator), "b": torch.zeros(4)}
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "tokenizer.json").write_text("{}")  # not a weight file: not fingerprinted
    return directory


def test_fingerprint_follows_the_weights(tmp_path):
    model = write_model(tmp_path / "m")
    saved = model_fingerprint(model)
    assert set(saved) == {"config.json", "model.safetensors"}
    moved = tmp_path / "elsewhere"
    shutil.copytree(model, moved)
    assert fingerprint_changes(saved, model_fingerprint(moved)) == []
    (moved / "tokenizer.json").write_text('{"other": 1}')
    assert fingerprint_changes(saved, model_fingerprint(moved)) == []
    write_model(moved, seed=1)  # retrained: same size and header, other data
    assert fingerprint_changes(saved, model_fingerprint(moved)) == [
        "model.safetensors changed (content)"
    ]
    write_model(moved, shape=(300, 301))
    assert fingerprint_changes(saved, model_fingerprint(moved)) == [
        "model.safetensors changed (size)"
    ]
    (moved / "model.safetensors").unlink()
    assert fingerprint_changes(saved, model_fingerprint(moved)) == ["model.safetensors is gone"]
    with pytest.raises(TrainingError, match="expected a model directory"):
        model_fingerprint(tmp_path / "missing")


def test_one_changed_block_changes_the_fingerprint(tmp_path):
    """A file larger than the sampled blocks: a change in a sampled block is seen."""
    model = write_model(tmp_path / "m")
    file = model / "model.safetensors"
    saved = model_fingerprint(model)
    data = bytearray(file.read_bytes())
    data[-1] ^= 1  # the last block is always sampled
    file.write_bytes(bytes(data))
    assert fingerprint_changes(saved, model_fingerprint(model)) == [
        "model.safetensors changed (content)"
    ]


def test_trainable_only_checkpoint_round_trips(trained, tmp_path):
    """Only the trained parameters (and optimizer state) are saved; they load into a model
    holding the same frozen base, and training continues bit for bit."""
    torch.manual_seed(0)
    model, _, _ = trained.build(seed=0)
    frozen = [n for n, _ in model.named_parameters() if not n.startswith("layers.0.")]

    def build():
        model, _, _ = trained.build(seed=0)
        for name, param in model.named_parameters():
            param.requires_grad_(name not in frozen)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
        return model, optimizer, scheduler

    model, optimizer, scheduler = build()
    trained.step(model, optimizer, scheduler)
    base = {"model.safetensors": {"size": 1, "sha256": "ab" * 32}}
    state = trained.state(1, scheduler, base_model=base)
    path = save_checkpoint(
        tmp_path, model, optimizer, state, device=torch.device("cpu"), keep=1, trainable_only=True
    )
    stored = read_metadata(path).tensors("model.")
    assert stored and all(k.startswith("layers.0.") for k in stored)
    assert not set(stored) & set(frozen)
    loaded = load_train_state(path)
    assert loaded.trainable_only and loaded.base_model == base
    expected = [trained.step(model, optimizer, scheduler) for _ in range(2)]

    fresh, fresh_optimizer, fresh_scheduler = build()
    torch.manual_seed(99)
    trained.step(fresh, fresh_optimizer, fresh_scheduler)  # moved away from the checkpoint
    load_training_checkpoint(path, fresh, fresh_optimizer, loaded)
    fresh_scheduler.load_state_dict(loaded.scheduler)
    loaded.rng_of(0).restore(torch.device("cpu"))
    assert [trained.step(fresh, fresh_optimizer, fresh_scheduler) for _ in range(2)] == expected
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_malformed_base_model_is_refused(trained, tmp_path):
    _, _, _, path = trained.saved(tmp_path)
    file = path / "train_state.json"
    stored = json.loads(file.read_text())
    stored["base_model"] = {"model.safetensors": {"size": 1, "sha256": "xyz"}}
    file.write_text(json.dumps(stored))
    with pytest.raises(TrainingError, match=r"'base_model.model.safetensors.sha256': expected 64"):
        load_train_state(path)
    stored["base_model"] = {}
    stored["trainable_only"] = "yes"
    file.write_text(json.dumps(stored))
    with pytest.raises(TrainingError, match="'trainable_only': expected true or false"):
        load_train_state(path)
