"""The error the training job reports as a one-line message and a non-zero exit status."""


class TrainingError(RuntimeError):
    """A problem with the job's input (flags, output directory, checkpoints), found before
    anything was changed on disk."""
