"""The captioner's checkpoints: :mod:`fusion.training`'s crash-safe DCP checkpoints, checked
against the captioner model their stored config describes before anything is built or
allocated. Loading never executes code from a checkpoint directory."""

import os
from pathlib import Path

import torch

from fusion.early_fusion import EarlyFusion
from fusion.training import check_config_model, checkpoint_dir, read_model_state_dict, safe_dcp
from fusion.training.safe_dcp import CheckedMetadata
from fusion.training.state import TrainState
from recipes.captioner import model as models  # build_model looked up when called: tests patch it
from recipes.captioner.config import TrainConfig
from recipes.captioner.state import load_train_state


def _check_model_tensors(path: Path, checked: CheckedMetadata, config: TrainConfig) -> None:
    layers = config.decoder_layers + config.encoder_layers
    check_config_model(path, checked, lambda: models.build_model(config), layers=layers)


def inspect_checkpoint(path: Path) -> TrainState:
    """Check every file of checkpoint ``path`` without loading it into a model: the train
    state, the metadata, the model tensors against the stored config, and every tensor entry
    (CRCs, dtypes, shapes). Returns the train state; a ``TrainingError`` names the file and
    what is wrong with it."""
    state = load_train_state(path)
    checked = safe_dcp.read_metadata(path)
    _check_model_tensors(path, checked, state.config)
    safe_dcp.verify_data(path, checked)
    return state


def load_model(path: str | os.PathLike) -> tuple[EarlyFusion, TrainConfig]:
    """A single-process ``EarlyFusion`` (on CPU, in eval mode) and the config of checkpoint
    ``path``, loaded with ``strict=True`` once the stored config is checked and the stored
    tensors are compared with the model it describes.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike.
        TrainingError: a file of the checkpoint is missing, damaged, unsafe or inconsistent
            with the others; the message names the file (and key).
    """
    path = checkpoint_dir(path)
    config = load_train_state(path).config
    _check_model_tensors(path, safe_dcp.read_metadata(path), config)
    with torch.random.fork_rng(devices=[]):  # the initial values are overwritten anyway
        model = models.build_model(config)
    model.load_state_dict(read_model_state_dict(path), strict=True)
    return model.eval(), config
