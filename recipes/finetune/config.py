"""The fine-tuning run's configuration: one dataclass, its command-line flags, its checks, and
what a resumed run takes from its checkpoint."""

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from fusion.lora import DEFAULT_TARGETS
from fusion.training import config as shared
from fusion.training.config import config_group, flag_name
from fusion.training.config import option as _opt

PROG = "python -m recipes.finetune"


# What --resume does with each group of settings (see resumed_config).
GROUP_TITLES = {
    "data": "data (restored by --resume; a different value is refused)",
    "model": "model and what trains (restored by --resume; a different value is refused)",
    "optim": "optimisation (restored by --resume; a different value is refused)",
    "run": "run (restored by --resume unless given; --steps/--epochs may extend the run)",
    "session": "this invocation (never restored)",
}
FIXED_GROUPS = ("data", "model", "optim")
STORED_GROUPS = (*FIXED_GROUPS, "run")  # what a checkpoint stores (config_to_json)
TRAIN_MODES = ("lora", "full", "projector")
DTYPES = ("float32", "bfloat16")


@dataclass
class FinetuneConfig:
    """Everything a fine-tuning run depends on, in groups (:data:`GROUP_TITLES`)."""

    # data
    data: str | None = _opt(
        None,
        "training conversations: JSON Lines, one conversation a line, in Hugging Face's "
        "messages format or LLaVA-Instruct's, image paths relative to the file; or a Hugging "
        "Face data set with TRL's messages and images columns (or LLaVA-Instruct's), images "
        "embedded: a Parquet file, a directory of them, or a datasets save_to_disk directory "
        "(the data extra) (required)",
        "data",
    )
    eval_data: str | None = _opt(
        None, "held-out conversations in the same formats (eval loss)", "data"
    )
    max_seq_len: int = _opt(2048, "longest packed sequence, in tokens", "data")
    packing: bool = _opt(
        True,
        "pack conversations into sequences of --max-seq-len tokens (block-causal attention); "
        "--no-packing pads each to the longest in its micro-batch",
        "data",
    )
    truncate: bool = _opt(
        False,
        "cut the answers' end of conversations longer than --max-seq-len (counted) instead of "
        "refusing them",
        "data",
    )
    skip_bad_samples: bool = _opt(
        False, "skip (and count) bad conversations instead of refusing the data file", "data"
    )
    seed: int = _opt(0, "seed of the data order, LoRA's initialisation and dropout", "data")
    # model and what trains
    model: str | None = _opt(
        None,
        "a Hugging Face model directory: LLaVA, Idefics3, SmolVLM, Qwen2-VL, Qwen2.5-VL, "
        "Qwen3-VL or a text-only Llama (required)",
        "model",
    )
    train: str = _opt(
        "lora",
        "what trains: 'lora' (adapters on the decoder's linear layers), 'full' (every "
        "parameter of the decoder and connector; the vision tower too with --train-vision), "
        "'projector' (the connector alone, LLaVA's stage 1)",
        "model",
        choices=TRAIN_MODES,
    )
    train_vision: bool = _opt(False, "with --train full: train the vision tower too", "model")
    lora_rank: int = _opt(8, "LoRA rank", "model")
    lora_alpha: float = _opt(16.0, "LoRA alpha (the update is scaled by alpha / rank)", "model")
    lora_dropout: float = _opt(0.0, "dropout on LoRA's input", "model")
    lora_targets: str = _opt(
        ",".join(DEFAULT_TARGETS),
        "comma-separated layers that get adapters: decoder layer names (Hugging Face's q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or ours: output_proj, w1, w2, "
        "w3, output; wildcards allowed), all-linear, or dotted names anywhere "
        "(encoders.image.connector.*)",
        "model",
    )
    init_adapter: str | None = _opt(
        None,
        "with --train lora: start from this PEFT LoRA adapter directory (adapter_config.json "
        "and adapter_model.safetensors, as peft's save_pretrained or a run's final/adapter/ "
        "writes them): its rank, alpha, dropout and layers replace --lora-rank, --lora-alpha, "
        "--lora-dropout and --lora-targets (given ones that differ are refused)",
        "model",
    )
    # optimisation
    lr: float = _opt(2e-4, "peak learning rate (AdamW)", "optim")
    batch_tokens: int = _opt(
        8192, "tokens per optimizer step (whole conversations, over every process)", "optim"
    )
    grad_accum: int = _opt(
        1, "micro-batches per optimizer step per process (gradients accumulated)", "optim"
    )
    warmup_steps: int = _opt(10, "linear warm-up steps, then cosine decay to 0", "optim")
    weight_decay: float = _opt(0.0, "AdamW weight decay", "optim")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0: no clipping)", "optim")
    dtype: str = _opt(
        "float32",
        "compute dtype: 'bfloat16' runs the forward under bf16 autocast (weights and optimizer "
        "state stay float32)",
        "optim",
        choices=DTYPES,
    )
    # run
    steps: int = _opt(0, "optimizer steps (0: as many as --epochs take)", "run")
    epochs: int = _opt(1, "passes over the data, when --steps is 0", "run")
    checkpoint_every: int = _opt(100, "save a checkpoint every N steps (and at the end)", "run")
    keep_checkpoints: int = _opt(2, "how many of the latest checkpoints to keep", "run")
    eval_every: int = _opt(0, "eval loss every N steps (0: at checkpoints only)", "run")
    parallel: str = _opt(
        "fsdp",
        "under torchrun: 'fsdp' (FSDP2, fusion.parallel's per-module plan) or 'ddp'",
        "run",
        choices=("fsdp", "ddp"),
    )
    activation_checkpointing: bool = _opt(
        False, "recompute each decoder layer's activations in the backward pass", "run"
    )
    # session
    output_dir: str | None = _opt(
        None,
        "where checkpoints, final/ (the fine-tuned model), metrics.json and the loss plot go "
        "(required)",
        "session",
    )
    resume: bool = _opt(
        False,
        "continue the run in --output-dir from its newest intact checkpoint, with its stored "
        "configuration",
        "session",
    )
    device: str = _opt(
        "auto",
        "'auto' (CUDA if available), 'cpu' or 'cuda'",
        "session",
        choices=("auto", "cpu", "cuda"),
    )
    threads: int = _opt(0, "CPU threads per process (0: torch's default)", "session")
    num_workers: int = _opt(
        2,
        "data loader worker processes per process that make the next micro-batches (decode "
        "and process the images, pack, collate) while one trains; 0: in the training process, "
        "when needed (the losses are the same)",
        "session",
    )
    compile: bool = _opt(
        False,
        "compile each decoder layer (torch.compile, dynamic shapes: one graph for every layer "
        "and row length)",
        "session",
    )
    progress: bool = _opt(True, "show the progress bar", "session")

    def group(self, name: str) -> dict[str, Any]:
        """The fields of one group as a dict."""
        return config_group(self, name)

    @property
    def lora_target_list(self) -> list[str]:
        return [t.strip() for t in self.lora_targets.split(",") if t.strip()]


_POSITIVE = (
    "max_seq_len",
    "lora_rank",
    "batch_tokens",
    "grad_accum",
    "checkpoint_every",
    "keep_checkpoints",
)
_NON_NEGATIVE = (
    "steps",
    "epochs",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "threads",
    "eval_every",
    "seed",
    "num_workers",
)
MAX_WORKERS = 64  # each worker makes whole micro-batches: more would wait on the training


# The flags that name files or directories: resolved against the working directory when
# given (a resumed run reads them from its checkpoint, wherever it is started).
PATH_FIELDS = ("model", "data", "eval_data", "output_dir", "init_adapter")


def check_config(config: FinetuneConfig, name: Callable[[str], str] = flag_name) -> None:
    """Raise ``ValueError`` naming the setting when a value is out of range or settings
    contradict each other. ``name`` turns a field name into how the message names it."""

    def fail(field_name: str, expected: str) -> NoReturn:
        got = getattr(config, field_name)
        raise ValueError(f"{name(field_name)}: expected {expected}, got {got!r}")

    shared.check_ranges(config, name, positive=_POSITIVE, non_negative=_NON_NEGATIVE, no_nul=True)
    if not config.lr > 0:
        fail("lr", "a positive learning rate")
    if not 0 <= config.lora_dropout < 1:
        fail("lora_dropout", "a probability in [0, 1)")
    if not config.lora_alpha > 0:
        fail("lora_alpha", "a positive value")
    if config.steps == 0 and config.epochs == 0:
        fail("epochs", f"a positive number of epochs when {name('steps')} is 0")
    targets = config.lora_target_list
    if not targets or len(set(targets)) != len(targets):
        fail("lora_targets", "distinct comma-separated layer names")
    if config.train_vision and config.train != "full":
        fail("train_vision", f"{name('train')} full")
    if config.init_adapter is not None and config.train != "lora":
        fail("init_adapter", f"{name('train')} lora (it starts LoRA adapters)")
    if config.batch_tokens < config.max_seq_len:
        fail("batch_tokens", f"at least {name('max_seq_len')}={config.max_seq_len}")
    if config.num_workers > MAX_WORKERS:
        fail("num_workers", f"at most {MAX_WORKERS} worker processes")
    for path in PATH_FIELDS:
        if getattr(config, path) == "":
            fail(path, "a path")


def check_command_line(config: FinetuneConfig) -> None:
    """:func:`check_config`, and the flags a new run (or ``--resume``) needs.

    Raises:
        ValueError: naming the flag.
    """
    check_config(config)
    if config.resume and config.output_dir is None:
        raise ValueError("--resume: expected --output-dir, the directory of the run to resume")
    for required in ("model", "data", "output_dir"):
        if not config.resume and getattr(config, required) is None:
            raise ValueError(f"{flag_name(required)}: required")


def config_to_json(config: FinetuneConfig) -> dict[str, Any]:
    """The run's stored settings (``data``, ``model``, ``optim`` and ``run`` groups)."""
    return {k: v for g in STORED_GROUPS for k, v in config.group(g).items()}


# Settings added since checkpoints were first written: the value a checkpoint without the key
# was trained with.
ADDED_SETTINGS: dict[str, Any] = {"init_adapter": None}


def config_from_json(values: Any, file: Path) -> FinetuneConfig:
    """A :class:`FinetuneConfig` from a checkpoint's stored settings (:func:`config_to_json`),
    every key present (those of :data:`ADDED_SETTINGS` may be missing from older
    checkpoints), of its type and in range.

    Raises:
        TrainingError: naming ``file`` and the key.
    """
    if isinstance(values, dict):
        values = {**ADDED_SETTINGS, **values}
    return shared.config_from_values(
        FinetuneConfig, values, file, check=check_config, stored_groups=STORED_GROUPS
    )


def build_parser() -> argparse.ArgumentParser:
    """One flag per :class:`FinetuneConfig` field, grouped. Flags not given are absent from
    the parsed namespace, so that a resumed run tells the flags given from its stored ones."""
    return shared.build_parser(
        FinetuneConfig,
        prog=PROG,
        description=(
            "Fine-tune a Hugging Face vision-language model (LLaVA, Idefics3, SmolVLM, "
            "Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or a Llama on your own conversations: packed "
            "batches, LoRA or full fine-tuning, "
            "crash-safe checkpoints that resume bit for bit, and at the end "
            "<output-dir>/final/, a Hugging Face directory transformers loads. Runs under "
            "torchrun for FSDP2 or DDP."
        ),
        group_titles=GROUP_TITLES,
    )


def parse_args(argv: list[str] | None = None) -> tuple[FinetuneConfig, frozenset[str]]:
    """Parse ``argv`` into a checked :class:`FinetuneConfig` and the names of the fields given;
    exits with status 2 and one line naming the flag on unknown flags or bad values."""
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    config = FinetuneConfig(**given)
    try:
        check_command_line(config)
    except ValueError as error:
        parser.error(str(error))
    # Stored absolute, so that --resume works from any working directory.
    absolute = {f: os.path.abspath(v) for f in PATH_FIELDS if (v := getattr(config, f))}
    return dataclasses.replace(config, **absolute), frozenset(given)


# A resumed run's configuration: the stored one with this invocation's session settings and the
# run settings given; a data, model or optim flag that changes is refused.
resumed_config = partial(shared.resumed_config, fixed_groups=FIXED_GROUPS)
