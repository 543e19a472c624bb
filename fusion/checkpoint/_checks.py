"""Argument checks shared by the checkpoint functions: each names the argument at fault."""

import os
from collections.abc import Mapping
from pathlib import Path

import torch


def as_path(value: object, argument: str) -> Path:
    """``value`` (str, bytes or os.PathLike; bytes may be any file-system encoding) as a Path.

    Raises:
        TypeError: another type. ValueError: empty, or holding a NUL character.
    """
    if not isinstance(value, str | bytes | os.PathLike):
        raise TypeError(
            f"{argument}: expected a path (str, bytes or os.PathLike), got {type(value).__name__}"
        )
    text = os.fsdecode(value)  # undecodable bytes become surrogates and encode back unchanged
    if not text or "\x00" in text:
        raise ValueError(f"{argument}: expected a non-empty path without NUL, got {text!r}")
    return Path(text)


def check_positive_int(value: object, argument: str) -> int:
    """``value`` unless it is not an int (bools are not) or not positive.

    Raises:
        TypeError: not an int. ValueError: not positive.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument}: expected a positive int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{argument}: expected a positive int, got {value}")
    return value


def check_state_dict(state_dict: object, argument: str = "state_dict") -> None:
    """Raise unless ``state_dict`` maps strings to tensors.

    Raises:
        TypeError: not a Mapping. ValueError: a key that is not a string or a value that is not
            a tensor (named).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{argument}: expected a mapping, got {type(state_dict).__name__}")
    for key, value in state_dict.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{argument}: expected string keys and tensor values, got {key!r} -> "
                f"{type(value).__name__}"
            )


def short_repr(value: object, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters: hostile files hold huge values."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
