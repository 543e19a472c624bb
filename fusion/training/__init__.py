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
- :mod:`~fusion.training.report`: log lines and warnings, the progress bar, ``metrics.json``
  (with :func:`peak_memory`), the loss plot.
- :mod:`~fusion.training.config`: a recipe's config dataclass as its flags, read back from a
  checkpoint and merged on ``--resume``.
- :mod:`~fusion.training.job`: a recipe's start (:func:`plan_start`, :func:`agree_on_start`:
  the output directory, or the checkpoint to resume and its configuration; a global batch
  split over the processes, :func:`check_batch_split`), checkpoints
  checked against what their config builds (and an early-fusion checkpoint's decoder against
  a plain one, :func:`compare_plain_decoder`), :func:`run_job` (one-line errors, exit status)
  and :func:`run_recipe` (a recipe's job: start, train, report).
- :mod:`~fusion.training.loop`: resuming and saving with their log lines
  (:func:`resume_checkpoint`, :func:`save_step`), the end of a step (:func:`optimizer_step`).
- :mod:`~fusion.training.accumulate`: losses over micro-batches made ahead: a step's
  gradients accumulated by tokens (:func:`accumulate_step`), a data set's :func:`mean_loss`.
- :mod:`~fusion.training.schedule`: the optimizer and its learning-rate schedule
  (:func:`adamw_warmup_cosine`, :func:`warmup_cosine`).
- :mod:`~fusion.training.host_memory`: freed host memory handed back to the system at a CPU
  step's two peaks (:func:`release_freed_memory`, hooks; :func:`release_freed_host_memory`).
- :mod:`~fusion.training.steps`: which samples each step trains on, a function of the
  position alone (:class:`EpochSampler`) or of a token budget (``plan_steps``); a resumed
  run's plan checked against its checkpoint's data position (:func:`check_plan_position`).
- :mod:`~fusion.training.fingerprint`: a cheap fingerprint of a model directory's weights, so
  checkpoints that hold only what trains (``save_checkpoint(trainable_only=True)``) can
  refuse a changed base (:func:`check_base_model`).
- :mod:`~fusion.training.export`: the end of a fine-tuning run, :func:`export_trained`: a
  Hugging Face directory (LoRA merged) with the PEFT adapter beside it, written whole or not
  at all (the trained tensors read back with :func:`load_model_tensors`).

Every problem with a job's input is a :class:`TrainingError` whose message is one line
naming the file (and key) or flag at fault; a recipe prints it and exits with status 1.
"""

from fusion.training.accumulate import accumulate_step, mean_loss
from fusion.training.checkpoint import (
    atomic_write_bytes,
    check_model_tensors,
    check_writable,
    checkpoint_dir,
    checkpoint_root,
    latest_checkpoint,
    list_checkpoints,
    load_model_tensors,
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
from fusion.training.export import export_trained
from fusion.training.fingerprint import check_base_model
from fusion.training.host_memory import (
    MemoryRelease,
    release_freed_host_memory,
    release_freed_memory,
)
from fusion.training.job import (
    Start,
    agree_on_start,
    check_batch_split,
    check_config_model,
    check_optimizer_state,
    compare_plain_decoder,
    default_output_dir,
    plan_start,
    run_job,
    run_recipe,
)
from fusion.training.loop import optimizer_step, resume_checkpoint, save_step
from fusion.training.report import (
    INSTALL_TRAIN_EXTRA,
    flat,
    log,
    peak_memory,
    plot_if_available,
    plot_losses,
    plotting_unavailable,
    progress_bar,
    progress_unavailable,
    warn,
    warn_missing_extras,
    write_json,
)
from fusion.training.schedule import adamw_warmup_cosine, lr_factor, warmup_cosine
from fusion.training.state import RngState, TrainState, key_error, load_train_state, match_saved
from fusion.training.steps import EpochSampler, check_plan_position, plan_position

__all__ = [
    "INSTALL_TRAIN_EXTRA",
    "EpochSampler",
    "MemoryRelease",
    "RngState",
    "Runtime",
    "Start",
    "TrainState",
    "TrainingError",
    "accumulate_step",
    "adamw_warmup_cosine",
    "agree_on_rank0",
    "agree_on_start",
    "atomic_write_bytes",
    "check_base_model",
    "check_batch_split",
    "check_config_model",
    "check_model_tensors",
    "check_optimizer_state",
    "check_plan_position",
    "check_writable",
    "checkpoint_dir",
    "checkpoint_root",
    "compare_plain_decoder",
    "default_output_dir",
    "export_trained",
    "flat",
    "init_runtime",
    "key_error",
    "latest_checkpoint",
    "launched_by_torchrun",
    "list_checkpoints",
    "load_model_tensors",
    "load_train_state",
    "load_training_checkpoint",
    "log",
    "lr_factor",
    "match_saved",
    "mean_loss",
    "newest_intact_checkpoint",
    "one_line",
    "optimizer_step",
    "peak_memory",
    "plan_position",
    "plan_start",
    "plot_if_available",
    "plot_losses",
    "plotting_unavailable",
    "progress_bar",
    "progress_unavailable",
    "read_model_state_dict",
    "release_freed_host_memory",
    "release_freed_memory",
    "resolve_device",
    "restore_checkpoint",
    "resume_checkpoint",
    "run_job",
    "run_recipe",
    "save_checkpoint",
    "save_step",
    "set_aside",
    "set_aside_damaged",
    "shutdown",
    "step_dir",
    "verify_checkpoint",
    "warmup_cosine",
    "warn",
    "warn_missing_extras",
    "wrap_model",
    "write_json",
]
