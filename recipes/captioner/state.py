"""The captioner's train state: :class:`fusion.training.TrainState` holding a
:class:`~recipes.captioner.config.TrainConfig`, with the data position the captioner's order
implies.

The data position follows from the step: ``samples_seen = step * config.batch_size`` and
``epoch = samples_seen // config.num_train``
(:class:`~recipes.captioner.batching.EpochSampler` orders the data by position alone); a file
that says otherwise is damaged.
"""

from pathlib import Path
from typing import Any

from fusion.training import state as generic
from fusion.training.state import TrainState, key_error
from recipes.captioner.config import TrainConfig, config_from_values


def train_state(
    *,
    step: int,
    losses: list[float],
    config: TrainConfig,
    world_size: int,
    parallel: str,
    scheduler: dict[str, Any],
) -> TrainState:
    """The train state after ``step`` steps of a run of ``config``, its data position
    derived from the step."""
    samples_seen = step * config.batch_size
    return TrainState(
        step=step,
        samples_seen=samples_seen,
        epoch=samples_seen // config.num_train,
        losses=losses,
        config=config,
        world_size=world_size,
        parallel=parallel,
        scheduler=scheduler,
    )


def load_train_state(path: Path) -> TrainState:
    """The checked ``train_state.json`` of checkpoint directory ``path``, its ``config`` a
    :class:`TrainConfig` (:func:`~recipes.captioner.config.config_from_values`).

    Raises:
        TrainingError: as :func:`fusion.training.load_train_state`, a config key is missing,
            unknown, of the wrong type or out of range, or the data position disagrees with
            the step; the message names the file and the key.
    """
    state = generic.load_train_state(path, parse_config=config_from_values)
    config: TrainConfig = state.config
    batch, num_train = config.batch_size, config.num_train
    samples_seen = state.step * batch
    positions = (
        (
            "samples_seen",
            state.samples_seen,
            samples_seen,
            f"step {state.step} x config.batch_size {batch}",
        ),
        (
            "epoch",
            state.epoch,
            samples_seen // num_train,
            f"samples_seen // config.num_train {num_train}",
        ),
    )
    for key, stored, expected, why in positions:
        if stored != expected:
            raise key_error(path, key, f"{expected} ({why})", stored)
    return state
