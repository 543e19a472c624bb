"""The main job: train an early-fusion captioner on generated shapes (``python -m
recipes.captioner --help``), and caption images with it (:mod:`recipes.captioner.caption`)."""

from fusion.training import TrainingError, read_model_state_dict
from recipes.captioner.config import TrainConfig, parse_config
from recipes.captioner.model import build_decoder, build_model, build_tokenizer
from recipes.captioner.state import load_model
from recipes.captioner.trainer import main

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
