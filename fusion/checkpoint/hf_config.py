"""Deprecated location of the Llama ``config.json`` mapping, now
:mod:`fusion.families.llama.config` (and of the config reader, now :mod:`fusion.hf.config`);
the names stay importable from here."""

from fusion.families.llama.config import (
    hf_config_from_decoder,
    llama3_2_kwargs_from_hf_config,
    llama_kwargs,
)
from fusion.hf.config import CONFIG_NAME, ConfigReader, read_hf_config

__all__ = [
    "CONFIG_NAME",
    "ConfigReader",
    "hf_config_from_decoder",
    "llama3_2_kwargs_from_hf_config",
    "llama_kwargs",
    "read_hf_config",
]
