"""Where :class:`CheckpointError` and its argument checks were first defined; they live in
:mod:`fusion.hf.errors` now, and this module keeps the old import path working."""

from fusion.hf.errors import (
    CheckpointError,
    as_path,
    check_positive_int,
    check_state_dict,
    short_repr,
)

__all__ = ["CheckpointError", "as_path", "check_positive_int", "check_state_dict", "short_repr"]
