"""The captioner's train state and checkpoints (:mod:`fusion.training`'s), checked against the
model their stored config describes before anything is built or allocated."""

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion import EarlyFusion, training
from fusion.training import TrainState, key_error, safe_dcp
from recipes.captioner import model as models  # build_model looked up when called: tests patch it
from recipes.captioner.config import TrainConfig, config_from_values


def train_state(*, step: int, config: TrainConfig, **fields: Any) -> TrainState:
    """The train state after ``step`` steps of a run of ``config``, at the data position of
    :class:`fusion.training.EpochSampler`'s order; ``fields``: the rest."""
    samples_seen = step * config.batch_size
    epoch = samples_seen // config.num_train
    return TrainState(step=step, samples_seen=samples_seen, epoch=epoch, config=config, **fields)


def load_train_state(path: Path) -> TrainState:
    """The checked ``train_state.json`` of checkpoint ``path``, its data position
    :func:`train_state`'s; a ``TrainingError`` names the file and key at fault."""
    state = training.load_train_state(path, parse_config=config_from_values)
    batch, num_train = state.config.batch_size, state.config.num_train
    samples_seen = state.step * batch
    if state.samples_seen != samples_seen:
        why = f"step {state.step} x config.batch_size {batch}"
        raise key_error(path, "samples_seen", f"{samples_seen} ({why})", state.samples_seen)
    if state.epoch != samples_seen // num_train:
        expected = f"{samples_seen // num_train} (samples_seen // config.num_train {num_train})"
        raise key_error(path, "epoch", expected, state.epoch)
    return state


def _checked_metadata(path: Path, config: TrainConfig) -> safe_dcp.CheckedMetadata:
    """The metadata of checkpoint ``path``, its model tensors those of ``config``'s model."""
    checked = safe_dcp.read_metadata(path)
    layers = config.decoder_layers + config.encoder_layers
    training.check_config_model(path, checked, lambda: models.build_model(config), layers=layers)
    return checked


def inspect_checkpoint(path: Path) -> TrainState:
    """The train state of checkpoint ``path`` once every file of it checks out (the optimizer
    and scheduler state included); a ``TrainingError`` names the file and what is wrong."""
    state = load_train_state(path)
    safe_dcp.verify_data(path, _checked_metadata(path, state.config))
    built = models.build_optimizer([nn.Parameter(torch.zeros(1))], state.config)
    training.check_optimizer_state(path, state, *built)
    return state


def load_model(path: str | os.PathLike) -> tuple[EarlyFusion, TrainConfig]:
    """A single-process ``EarlyFusion`` (on CPU, in eval mode) and the config of checkpoint
    ``path``, loaded with ``strict=True``; a ``TypeError`` for a ``path`` of another type, a
    one-line ``TrainingError`` naming the file (and key) for a bad checkpoint."""
    path = training.checkpoint_dir(path)
    config = load_train_state(path).config
    _checked_metadata(path, config)
    with torch.random.fork_rng(devices=[]):  # the initial values are overwritten anyway
        model = models.build_model(config)
    model.load_state_dict(training.read_model_state_dict(path), strict=True)
    return model.eval(), config
