"""What any training recipe needs, generic over the model it trains.

- :mod:`~fusion.training.checkpoint`: crash-safe checkpoints
  ``<output_dir>/checkpoints/step_XXXXXXXX/`` (DCP tensors of the model and optimizer plus
  ``train_state.json``): :func:`save_checkpoint` (atomic, keeps the latest N),
  :func:`newest_intact_checkpoint` and :func:`set_aside_damaged` (``.damaged``, never
  deleted), :func:`restore_checkpoint` on any number of processes, :func:`read_model_state_dict`
  in one process.
- :mod:`~fusion.training.state`: :class:`TrainState` (step, data position, losses, eval losses,
  the recipe's config, scheduler, optimizer hyper-parameters, every process's RNG states) and
  its strict JSON loader :func:`load_train_state`.
- :mod:`~fusion.training.safe_dcp`: reading DCP directories without executing code from them.
- :mod:`~fusion.training.distributed`: one process or ``torchrun``; DDP or FSDP2;
  :func:`agree_on_rank0` (rank 0 decides, every process gets its verdict or its error).
- :mod:`~fusion.training.report`: log lines, the progress bar, ``metrics.json``, the loss plot.
- :mod:`~fusion.training.config`: a recipe's config dataclass as its flags, read back from a
  checkpoint and merged on ``--resume``.
- :mod:`~fusion.training.fingerprint`: a cheap fingerprint of a model directory's weights, so
  checkpoints that hold only what trains (``save_checkpoint(trainable_only=True)``) can
  refuse a changed base.

Every problem with a job's input is a :class:`TrainingError` whose message is one line
naming the file (and key) or flag at fault; a recipe prints it and exits with status 1.
"""

from fusion.training.checkpoint import (
    atomic_write_bytes,
    check_model_tensors,
    check_writable,
    checkpoint_dir,
    checkpoint_root,
    latest_checkpoint,
    list_checkpoints,
    load_training_checkpoint,
    newest_intact_checkpoint,
    read_model_state_dict,
    restore_checkpoint,
    save_checkpoint,
    set_aside,
    set_aside_damaged,
    step_dir,
    verify_checkpoint,
)
from fusion.training.distributed import (
    Runtime,
    agree_on_rank0,
    init_runtime,
    launched_by_torchrun,
    resolve_device,
    shutdown,
    wrap_model,
)
from fusion.training.errors import TrainingError, one_line
from fusion.training.report import (
    INSTALL_TRAIN_EXTRA,
    log,
    plot_losses,
    plotting_unavailable,
    progress_bar,
    progress_unavailable,
    write_json,
)
from fusion.training.state import RngState, TrainState, key_error, load_train_state, match_saved

__all__ = [
    "INSTALL_TRAIN_EXTRA",
    "RngState",
    "Runtime",
    "TrainState",
    "TrainingError",
    "agree_on_rank0",
    "atomic_write_bytes",
    "check_model_tensors",
    "check_writable",
    "checkpoint_dir",
    "checkpoint_root",
    "init_runtime",
    "key_error",
    "latest_checkpoint",
    "launched_by_torchrun",
    "list_checkpoints",
    "load_train_state",
    "load_training_checkpoint",
    "log",
    "match_saved",
    "newest_intact_checkpoint",
    "one_line",
    "plot_losses",
    "plotting_unavailable",
    "progress_bar",
    "progress_unavailable",
    "read_model_state_dict",
    "resolve_device",
    "restore_checkpoint",
    "save_checkpoint",
    "set_aside",
    "set_aside_damaged",
    "shutdown",
    "step_dir",
    "verify_checkpoint",
    "wrap_model",
    "write_json",
]
