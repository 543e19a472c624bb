"""The one error type of checkpoint reading and writing."""

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the model.

    The message starts with the file (and the key, when one is at fault), so it can be acted on
    without a debugger.

    Attributes:
        file: the file at fault (a weights file, an index or ``config.json``).
        key: the tensor or config key at fault, or None when the whole file is.
    """

    def __init__(self, file: str | Path, key: str | None, message: str) -> None:
        self.file = Path(file)
        self.key = key
        where = f"{self.file}" if key is None else f"{self.file}, key {key!r}"
        super().__init__(f"{where}: {message}")
