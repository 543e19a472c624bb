"""The captioner's checkpoints: :mod:`fusion.training.checkpoint`'s crash-safe DCP
checkpoints, checked against the captioner model their stored config describes.

Loading never executes code from a checkpoint directory, and the stored config and tensor
shapes are checked before anything is built or allocated (:func:`inspect_checkpoint`,
:func:`load_model`).
"""

import os
from pathlib import Path

import torch

from fusion.early_fusion import EarlyFusion
from fusion.training import safe_dcp
from fusion.training.checkpoint import (
    check_model_tensors,
    checkpoint_dir,
    read_model_state_dict,
)
from fusion.training.errors import one_line
from fusion.training.safe_dcp import CheckedMetadata, fail
from fusion.training.state import TRAIN_STATE, TrainState
from recipes.captioner.config import TrainConfig
from recipes.captioner.state import load_train_state


def _check_model_tensors(path: Path, checked: CheckedMetadata, config: TrainConfig) -> None:
    """The checkpoint's model tensors must be exactly those of ``config``'s model: compared
    with the model built on the meta device (no memory), before anything is allocated."""
    from recipes.captioner.model import build_model

    stored = checked.tensors("model.")
    # Building costs time per layer even on the meta device: a layer count the stored tensors
    # cannot hold is refused first.
    layers = config.decoder_layers + config.encoder_layers
    if layers > len(stored):
        raise fail(
            path / TRAIN_STATE,
            f"config has {layers} layers, but the checkpoint holds only {len(stored)} "
            "model tensors",
        )
    try:
        with torch.device("meta"):
            model = build_model(config)
    except (RuntimeError, ValueError, OverflowError) as error:
        raise fail(path / TRAIN_STATE, f"its config builds no model: {one_line(error)}") from None
    check_model_tensors(path, checked, model)


def inspect_checkpoint(path: Path) -> TrainState:
    """Check every file of checkpoint ``path`` without loading it into a model: the train
    state, the metadata, the model tensors against the stored config, and every tensor entry
    (CRCs, dtypes, shapes). Returns the train state.

    Raises:
        TrainingError: naming the file and what is wrong with it.
    """
    state = load_train_state(path)
    checked = safe_dcp.read_metadata(path)
    _check_model_tensors(path, checked, state.config)
    safe_dcp.verify_data(path, checked)
    return state


def load_model(path: str | os.PathLike) -> tuple[EarlyFusion, TrainConfig]:
    """A single-process ``EarlyFusion`` (on CPU, in eval mode) and the config of checkpoint
    ``path``, loaded with ``strict=True``.

    The stored config is checked (types, ranges) and the stored tensors compared with the
    model it describes before the model is built.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike.
        TrainingError: a file of the checkpoint is missing, damaged, unsafe or inconsistent
            with the others; the message names the file (and key).
    """
    from recipes.captioner.model import build_model

    path = checkpoint_dir(path)
    config = load_train_state(path).config
    _check_model_tensors(path, safe_dcp.read_metadata(path), config)
    with torch.random.fork_rng(devices=[]):  # the initial values are overwritten anyway
        model = build_model(config)
    model.load_state_dict(read_model_state_dict(path), strict=True)
    return model.eval(), config
