"""The captioner's train state: :class:`fusion.training.TrainState` holding a
:class:`~recipes.captioner.config.TrainConfig`, with the data position the captioner's order
implies: ``samples_seen = step * config.batch_size`` and ``epoch = samples_seen //
config.num_train`` (:class:`fusion.training.EpochSampler` orders the data by position alone).
A file that says otherwise is damaged.
"""

from pathlib import Path
from typing import Any

from fusion.training import state as generic
from fusion.training.state import TrainState, key_error
from recipes.captioner.config import TrainConfig, config_from_values


def train_state(*, step: int, config: TrainConfig, **fields: Any) -> TrainState:
    """The train state after ``step`` steps of a run of ``config``, its data position derived
    from the step; ``fields``: the others (``losses``, ``world_size``, ``parallel``,
    ``scheduler``)."""
    samples_seen = step * config.batch_size
    epoch = samples_seen // config.num_train
    return TrainState(step=step, samples_seen=samples_seen, epoch=epoch, config=config, **fields)


def load_train_state(path: Path) -> TrainState:
    """The checked ``train_state.json`` of checkpoint directory ``path``, its ``config`` a
    :class:`TrainConfig` (:func:`~recipes.captioner.config.config_from_values`).

    Raises:
        TrainingError: as :func:`fusion.training.load_train_state`, a config key is missing,
            unknown, of the wrong type or out of range, or the data position disagrees with
            the step; the message names the file and the key.
    """
    state = generic.load_train_state(path, parse_config=config_from_values)
    batch, num_train = state.config.batch_size, state.config.num_train
    samples_seen = state.step * batch
    if state.samples_seen != samples_seen:
        why = f"step {state.step} x config.batch_size {batch}"
        raise key_error(path, "samples_seen", f"{samples_seen} ({why})", state.samples_seen)
    if state.epoch != samples_seen // num_train:
        expected = f"{samples_seen // num_train} (samples_seen // config.num_train {num_train})"
        raise key_error(path, "epoch", expected, state.epoch)
    return state
