"""What every package that reads Hugging Face directories stands on: strict, bounded reading of
their files, and the names of their tensors.

- :func:`read_hf_config` and :class:`ConfigReader`: ``config.json`` and any config object
  (image processor configs too), each value checked, each refusal naming the file and key;
- :func:`read_json`, :func:`read_tokenizer`, :func:`read_bounded`: regular files only, capped
  in size before they are read (:data:`MAX_JSON_BYTES`, :data:`MAX_TOKENIZER_BYTES`);
- :class:`KeyLayout`: where a model's parts sit in a checkpoint, and the Llama key renaming
  and q/k row permutation below it (:mod:`fusion.hf.keys`);
- :class:`CheckpointError`, the one error of these files (a ``ValueError``), and the argument
  checks :func:`as_path`, :func:`short_repr`, :func:`check_positive_int`.

This package imports nothing of the library above it (only :mod:`fusion.errors`,
:mod:`fusion._io`, :mod:`fusion._validation` and torch), so that checkpoint, preprocessing,
data and lora all stand on it.
"""

from fusion.hf.config import CONFIG_NAME, MAX_SIDE, ConfigReader, read_hf_config
from fusion.hf.errors import CheckpointError, as_path, check_positive_int, short_repr
from fusion.hf.files import (
    MAX_JSON_BYTES,
    MAX_TOKENIZER_BYTES,
    read_bounded,
    read_json,
    read_tokenizer,
)
from fusion.hf.layout import KeyLayout

__all__ = [
    "CONFIG_NAME",
    "MAX_JSON_BYTES",
    "MAX_SIDE",
    "MAX_TOKENIZER_BYTES",
    "CheckpointError",
    "ConfigReader",
    "KeyLayout",
    "as_path",
    "check_positive_int",
    "read_bounded",
    "read_hf_config",
    "read_json",
    "read_tokenizer",
    "short_repr",
]
