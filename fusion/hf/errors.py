"""The one error type of Hugging Face and checkpoint files (:class:`CheckpointError`), and the
argument checks that name the argument, for every package that reads such files."""

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from fusion._validation import is_int
from fusion.errors import FusionError


def short_repr(value: object, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters: hostile files hold huge values."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class CheckpointError(FusionError, ValueError):
    """A checkpoint that cannot be read or does not match the model.

    The message starts with the file (and the key, when one is at fault), so it can be acted on
    without a debugger. Bytes of a file name that are not UTF-8 show as ``\\xNN`` escapes.

    Attributes:
        file: the file at fault (a weights file, an index or ``config.json``).
        key: the tensor or config key at fault, or None when the whole file is.
    """

    def __init__(self, file: str | os.PathLike, key: str | None, message: str) -> None:
        self.file = Path(file)
        self.key = key
        # Printable even when the name is not UTF-8 (surrogate escapes cannot be printed).
        name = os.fsencode(self.file).decode("utf-8", "backslashreplace")
        where = name if key is None else f"{name}, key {short_repr(key)}"
        super().__init__(f"{where}: {message}")


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
    if not is_int(value):
        raise TypeError(f"{argument}: expected a positive int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{argument}: expected a positive int, got {value}")
    return value


def check_state_dict(
    state_dict: object, argument: str = "state_dict", *, tensors: bool = True
) -> None:
    """Raise unless ``state_dict`` maps strings to tensors (to anything, with ``tensors=False``).

    Raises:
        TypeError: not a Mapping. ValueError: a key that is not a string or a value that is not
            a tensor (named).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{argument}: expected a mapping, got {type(state_dict).__name__}")
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise ValueError(f"{argument}: expected string keys, got {key!r}")
        if tensors and not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{argument}: expected string keys and tensor values, got {key!r} -> "
                f"{type(value).__name__}"
            )
