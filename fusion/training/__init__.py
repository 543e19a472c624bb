"""The main job: train an early-fusion captioner on generated shapes, on one process or many.

``python -m fusion.training --help`` lists the flags; under ``torchrun`` it runs DDP or FSDP2.
"""

from fusion.training.checkpoint import load_model, read_model_state_dict
from fusion.training.cli import main
from fusion.training.config import TrainConfig, parse_config
from fusion.training.errors import TrainingError
from fusion.training.model import build_decoder, build_model, build_tokenizer

__all__ = [
    "TrainConfig",
    "TrainingError",
    "build_decoder",
    "build_model",
    "build_tokenizer",
    "load_model",
    "main",
    "parse_config",
    "read_model_state_dict",
]
