"""The error the training job reports as a one-line message and a non-zero exit status."""


class TrainingError(RuntimeError):
    """A problem with the job's input (flags, output directory, checkpoints), found before
    anything was changed on disk."""


def one_line(error: BaseException) -> str:
    """An error's message as one line (torch's are often many), for a one-line report."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
