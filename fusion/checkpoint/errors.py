"""The one error type of checkpoint reading and writing."""

import os
from pathlib import Path

from fusion.checkpoint._checks import short_repr


class CheckpointError(ValueError):
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
