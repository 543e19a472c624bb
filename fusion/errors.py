"""The base of every error this library defines for bad input.

Each error keeps the built-in base it always had, so ``except ValueError`` and
``except RuntimeError`` still catch what they caught, and ``except FusionError`` catches all of
them:

- :class:`fusion.checkpoint.CheckpointError` (a ``ValueError``): a checkpoint or model
  directory that cannot be read or does not match the model;
- :class:`fusion.data.DataError` (a ``ValueError``): a data file or one of its lines;
- :class:`fusion.data.ChatTemplateError` (a ``ValueError``): a chat template that cannot be
  read or rendered;
- :class:`fusion.training.TrainingError` (a ``RuntimeError``): a training job's flags, output
  directory, data or checkpoints;
- ``fusion._io.NotRegularFile`` and ``fusion._io.FileTooLarge`` (``OSError``\\ s): a file
  refused before it is read; readers turn them into the errors above, naming the file.

:func:`one_line` gives any error's message (torch's often span many lines) as the one line
that command-line reports print.
"""


class FusionError(Exception):
    """An input this library refuses: the message names the argument, file or flag at fault,
    what was expected and what was got."""


def one_line(error: BaseException) -> str:
    """An error's message as one line (torch's are often many), for a one-line report."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
