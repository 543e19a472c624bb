"""The one error type of training jobs, reported as a one-line message and exit status 1."""

from fusion.errors import FusionError

# Moved down to fusion.errors for the data loader (below training); still importable from here.
from fusion.errors import one_line as one_line


class TrainingError(FusionError, RuntimeError):
    """A problem with a training job's input (flags, output directory, data, checkpoints),
    found before anything was changed on disk. The message is one line meant for the user:
    it names the file (and key) or the flag at fault.

    ``local``: found by this process alone (in its share of the data, by its data loader), so
    this process reports it, with its rank; otherwise every process finds it alike and the
    main process alone reports it."""

    def __init__(self, message: str, *, local: bool = False) -> None:
        super().__init__(message)
        self.local = local
