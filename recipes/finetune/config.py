"""The fine-tuning run's configuration: one dataclass, its command-line flags, its checks, and
what a resumed run takes from its checkpoint."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

from fusion.data import check_template_variables
from fusion.lora import DEFAULT_TARGETS
from fusion.training import config as shared
from fusion.training.config import flag_name, option

PROG = "python -m recipes.finetune"


# What --resume does with each group of settings (see resumed_config).
GROUP_TITLES = shared.group_titles(model="model and what trains", extend="--steps/--epochs")
FIXED_GROUPS = shared.FIXED_GROUPS
TRAIN_MODES = ("lora", "full", "projector")
DTYPES = ("float32", "bfloat16")
# An option of each group (fusion.training.config.option without its group argument).
_data, _model, _optim, _run, _session = (partial(option, group=g) for g in GROUP_TITLES)


@dataclass
class FinetuneConfig:
    """Everything a fine-tuning run depends on, in groups (:data:`GROUP_TITLES`)."""

    data: str | None = _data(
        None,
        "training conversations: JSON Lines, one conversation a line, in Hugging Face's "
        "messages format or LLaVA-Instruct's, image paths relative to the file; or a Hugging "
        "Face data set with TRL's messages and images columns (or LLaVA-Instruct's), images "
        "embedded: a Parquet file, a directory of them, or a datasets save_to_disk directory "
        "(the data extra) (required)",
        path=True,
    )
    eval_data: str | None = _data(
        None, "held-out conversations in the same formats (eval loss)", path=True
    )
    max_seq_len: int = _data(
        2048,
        "longest conversation, in tokens (packed rows take as many as the model does)",
        positive=True,
    )
    packing: bool = _data(
        True,
        "pack conversations into sequences of --max-seq-len tokens (block-causal attention); "
        "--no-packing pads each to the longest in its micro-batch",
    )
    truncate: bool = _data(
        False,
        "cut the answers' end of conversations longer than --max-seq-len (counted) instead of "
        "refusing them",
    )
    skip_bad_samples: bool = _data(
        False, "skip (and count) bad conversations instead of refusing the data file"
    )
    seed: int = _data(
        0, "seed of the data order, LoRA's initialisation and dropout", non_negative=True
    )
    chat_template_kwargs: str | None = _data(
        None,
        "a JSON object of variables the chat template renders every conversation with, as "
        "transformers' apply_chat_template(**kwargs) passes them, e.g. "
        "'{\"enable_thinking\": false}' for Qwen3.5 answers without reasoning",
    )

    model: str | None = _model(
        None,
        "a Hugging Face model directory: LLaVA, Idefics3, SmolVLM, Qwen2-VL, Qwen2.5-VL, "
        "Qwen3-VL, Qwen3.5, Gemma 3, or a text-only Llama, Qwen3.5 or Gemma 3 (required)",
        path=True,
    )
    train: str = _model(
        "lora",
        "what trains: 'lora' (adapters on the decoder's linear layers), 'full' (every "
        "parameter of the decoder and connector; the vision tower too with --train-vision), "
        "'projector' (the connector alone, LLaVA's stage 1)",
        choices=TRAIN_MODES,
    )
    train_vision: bool = _model(False, "with --train full: train the vision tower too")
    lora_rank: int = _model(8, "LoRA rank", positive=True)
    lora_alpha: float = _model(
        16.0, "LoRA alpha (the update is scaled by alpha / rank)", positive=True
    )
    lora_dropout: float = _model(0.0, "dropout on LoRA's input")
    lora_targets: str = _model(
        ",".join(DEFAULT_TARGETS),
        "comma-separated layers that get adapters: decoder layer names (Hugging Face's q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or ours: output_proj, w1, w2, "
        "w3, output; wildcards allowed), all-linear, or dotted names anywhere "
        "(encoders.image.connector.*)",
    )
    init_adapter: str | None = _model(
        None,
        "with --train lora: start from this PEFT LoRA adapter directory (adapter_config.json "
        "and adapter_model.safetensors, as peft's save_pretrained or a run's final/adapter/ "
        "writes them): its rank, alpha, dropout and layers replace --lora-rank, --lora-alpha, "
        "--lora-dropout and --lora-targets (given ones that differ are refused)",
        path=True,
    )

    lr: float = _optim(2e-4, "peak learning rate (AdamW)")
    batch_tokens: int = _optim(
        8192,
        "tokens per optimizer step (whole conversations, over every process)",
        positive=True,
    )
    grad_accum: int = _optim(
        1,
        "micro-batches per optimizer step per process (gradients accumulated)",
        positive=True,
    )
    warmup_steps: int = _optim(
        10, "linear warm-up steps, then cosine decay to 0", non_negative=True
    )
    weight_decay: float = _optim(0.0, "AdamW weight decay", non_negative=True)
    grad_clip: float = _optim(
        1.0, "clip the global gradient norm to this (0: no clipping)", non_negative=True
    )
    dtype: str = _optim(
        "float32",
        "compute dtype: 'bfloat16' runs the forward under bf16 autocast (weights and optimizer "
        "state stay float32)",
        choices=DTYPES,
    )

    steps: int = _run(0, "optimizer steps (0: as many as --epochs take)", non_negative=True)
    epochs: int = _run(1, "passes over the data, when --steps is 0", non_negative=True)
    checkpoint_every: int = _run(
        100, "save a checkpoint every N steps (and at the end)", positive=True
    )
    keep_checkpoints: int = _run(2, "how many of the latest checkpoints to keep", positive=True)
    eval_every: int = _run(0, "eval loss every N steps (0: at checkpoints only)", non_negative=True)
    parallel: str = _run(
        "fsdp",
        "under torchrun: 'fsdp' (FSDP2, fusion.parallel's per-module plan) or 'ddp'",
        choices=("fsdp", "ddp"),
    )
    activation_checkpointing: bool = _run(
        False, "recompute each decoder layer's activations in the backward pass"
    )
    fused_loss: bool = _run(
        True,
        "on CPU in one process, the fused linear cross-entropy (fusion.fused_token_loss: the "
        "output layer's backward made chunk by chunk in the forward, each chunk projected "
        "once); --no-fused-loss, and always elsewhere: the checkpointed chunked loss "
        "(fusion.chunked_token_loss)",
    )

    output_dir: str | None = _session(
        None,
        "where checkpoints, final/ (the fine-tuned model), metrics.json and the loss plot go "
        "(required)",
        path=True,
    )
    resume: bool = _session(
        False,
        "continue the run in --output-dir from its newest intact checkpoint, with its stored "
        "configuration",
    )
    device: str = _session(
        "auto",
        "'auto' (CUDA if available), 'cpu' or 'cuda'",
        choices=("auto", "cpu", "cuda"),
    )
    threads: int = _session(0, "CPU threads per process (0: torch's default)", non_negative=True)
    num_workers: int = _session(
        2,
        "data loader worker processes per process that make the next micro-batches (decode "
        "and process the images, pack, collate) while one trains; 0: in the training process, "
        "when needed (the losses are the same)",
        non_negative=True,
    )
    compile: bool = _session(
        False,
        "compile each decoder layer (torch.compile, dynamic shapes: one graph for every layer "
        "and row length)",
    )
    release_freed_memory: bool = _session(
        True,
        "on CPU: hand freed host memory back to the system at each step's two peaks "
        "(fusion.training.release_freed_memory: glibc's malloc_trim before the loss and before "
        "the embedding's gradient), a lower peak for a little more time",
    )
    progress: bool = _session(True, "show the progress bar")

    @property
    def template_variables(self) -> dict[str, Any]:
        """:attr:`chat_template_kwargs` parsed (checked by :func:`check_config`)."""
        return {} if self.chat_template_kwargs is None else json.loads(self.chat_template_kwargs)

    @property
    def lora_target_list(self) -> list[str]:
        return [t.strip() for t in self.lora_targets.split(",") if t.strip()]


MAX_WORKERS = 64  # each worker makes whole micro-batches: more would wait on the training


def check_config(config: FinetuneConfig, name: Callable[[str], str] = flag_name) -> None:
    """Raise ``ValueError`` naming the setting when a value is out of range or settings
    contradict each other. ``name`` turns a field name into how the message names it."""

    fail = partial(shared.refuse, config, name=name)
    shared.check_ranges(config, name, no_nul=True)
    if not config.lr > 0:
        fail("lr", "a positive learning rate")
    if not 0 <= config.lora_dropout < 1:
        fail("lora_dropout", "a probability in [0, 1)")
    if config.steps == 0 and config.epochs == 0:
        fail("epochs", f"a positive number of epochs when {name('steps')} is 0")
    if config.chat_template_kwargs is not None:
        _check_template_variables(
            config.chat_template_kwargs, partial(fail, "chat_template_kwargs")
        )
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
    if config.resume and config.output_dir is None:
        expected = f"expected {name('output_dir')}, the directory of the run to resume"
        raise ValueError(f"{name('resume')}: {expected}")


def _check_template_variables(text: str, fail: Callable[[str], NoReturn]) -> None:
    """Refuse (through ``fail``, given what was expected) ``--chat-template-kwargs`` that is
    not a JSON object of identifiers to JSON data the template can take."""
    try:
        variables = json.loads(text)
    except json.JSONDecodeError as error:
        fail(f"a JSON object (not valid JSON: {error.msg} at character {error.pos})")
    if not isinstance(variables, dict):
        fail(f"a JSON object, got a JSON {type(variables).__name__}")
    try:
        check_template_variables(variables)
    except ValueError as error:
        fail(f"template variables ({error})")


# The recipe's command line and what its checkpoints store (data, model, optim and run).
SPEC = shared.ConfigSpec(
    FinetuneConfig,
    prog=PROG,
    description=(
        "Fine-tune a Hugging Face vision-language model (LLaVA, Idefics3, SmolVLM, "
        "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3) or a text-only Llama, Qwen3.5 or "
        "Gemma 3 on your own conversations: packed "
        "batches, LoRA or full fine-tuning, "
        "crash-safe checkpoints that resume bit for bit, and at the end "
        "<output-dir>/final/, a Hugging Face directory transformers loads. Runs under "
        "torchrun for FSDP2 or DDP."
    ),
    group_titles=GROUP_TITLES,
    check=check_config,
    fixed_groups=FIXED_GROUPS,
    stored_groups=(*FIXED_GROUPS, "run"),
    required=("model", "data", "output_dir"),  # for a new run (--resume reads them)
    # added since the first checkpoints: the value they had
    added={"init_adapter": None, "chat_template_kwargs": None},
)
build_parser, parse_args, resumed_config = SPEC.build_parser, SPEC.parse_args, SPEC.resumed
config_to_json, config_from_json = SPEC.to_json, SPEC.from_json
