"""The captioner's checkpoints in one process: its model and a plain decoder load them, and
bad ones are one-line errors (the checkpoint machinery itself is tested in
``tests/training/``)."""

import pytest
import torch

from fusion.checkpoint import select_prefix
from fusion.training import TrainingError, latest_checkpoint
from fusion.training.state import TRAIN_STATE
from recipes.captioner import build_decoder, load_model, read_model_state_dict
from recipes.captioner.state import load_train_state


def test_round_trip_into_a_single_process_model_and_a_plain_decoder(small, tmp_path):
    model, optimizer = small.model_and_optimizer()
    path = small.save(tmp_path, 1, model, optimizer)
    assert path == tmp_path / "step_00000001" and latest_checkpoint(tmp_path) == path
    loaded, config = load_model(path)
    assert config == small.config
    for (name, expected), actual in zip(
        model.state_dict().items(), loaded.state_dict().values(), strict=True
    ):
        assert torch.equal(expected, actual), name
    decoder = build_decoder(config)
    decoder.load_state_dict(select_prefix(read_model_state_dict(path), "decoder."), strict=True)
    assert torch.equal(decoder.tok_embeddings.weight, model.decoder.tok_embeddings.weight)


def test_unreadable_checkpoints_raise_training_errors(small, tmp_path):
    bad = tmp_path / "step_00000001"
    bad.mkdir()
    (bad / TRAIN_STATE).write_bytes(b"not a checkpoint")
    with pytest.raises(TrainingError, match=r"train_state\.json: is not valid JSON"):
        load_train_state(bad)
    with pytest.raises(TrainingError, match=r"\.metadata: is missing"):
        read_model_state_dict(bad)
