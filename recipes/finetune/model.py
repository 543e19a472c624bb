"""The model a fine-tuning run trains (:func:`build_model`): loaded from a Hugging Face
directory, with what ``--train`` says trainable (LoRA adapters new, or a PEFT adapter's with
``--init-adapter``). Every problem raises a ``TrainingError`` naming the flag (and file)."""

import dataclasses
from collections.abc import Collection
from pathlib import Path

import torch

from fusion import EarlyFusion, TransformerDecoder
from fusion.checkpoint import CheckpointError, load_hf_model
from fusion.checkpoint.hf_model import HfDirectory
from fusion.lora import apply_lora, load_peft_adapter, read_peft_config, select_lora_layers
from fusion.lora.peft import ADAPTER_CONFIG
from fusion.training import TrainingError
from fusion.training.config import flag_errors, flag_name
from recipes.finetune.config import FinetuneConfig

Model = EarlyFusion | TransformerDecoder


def load_base_model(config: FinetuneConfig, directory: HfDirectory | None = None) -> Model:
    """The model of ``--model`` (``directory``, its config already parsed, if given) in
    float32 on CPU, every parameter frozen: an ``EarlyFusion`` for a vision-language
    directory, a ``TransformerDecoder`` for a Llama."""
    assert config.model is not None
    with flag_errors("--model", CheckpointError, ValueError, TypeError, OSError):
        model = load_hf_model(directory or config.model, dtype=torch.float32)
    limit = (model.decoder if isinstance(model, EarlyFusion) else model).max_seq_len
    if config.max_seq_len > limit:
        raise TrainingError(
            f"--max-seq-len: expected at most the model's {limit} positions "
            f"(max_position_embeddings), got {config.max_seq_len}"
        )
    return model.requires_grad_(False)


def set_trainable(model: Model, config: FinetuneConfig) -> None:
    """Make trainable what ``--train`` names, before LoRA adds its own: ``full``: the decoder
    and the connector, the vision tower too with ``--train-vision``; ``projector``: the
    connector alone (LLaVA's stage 1; Qwen-VL's mergers); ``lora``: nothing."""
    full = config.train == "full"
    if isinstance(model, EarlyFusion):
        trains_fusion = full or config.train == "projector"
        model.set_trainable(
            decoder=full, encoders=full and config.train_vision, fusion=trains_fusion
        )
    elif config.train == "projector":
        raise TrainingError("--train: 'projector' needs a vision-language --model, got a Llama")
    else:
        model.requires_grad_(full)


def init_adapter_config(config: FinetuneConfig, given: Collection[str]) -> FinetuneConfig:
    """With ``--init-adapter``: ``config`` with the adapter's rank, alpha and dropout (from its
    ``adapter_config.json``, :func:`fusion.lora.read_peft_config`), so the run records what
    trains; the flags in ``given`` (those on the command line) must agree with the adapter.
    ``config`` itself without it."""
    if config.init_adapter is None:
        return config
    with flag_errors("--init-adapter", CheckpointError, OSError, ValueError):
        adapter = read_peft_config(config.init_adapter)
    # Each flag, the key adapter_config.json has it under, and the adapter's value.
    theirs = {
        "lora_rank": ("r", adapter.rank),
        "lora_alpha": ("lora_alpha", adapter.alpha),
        "lora_dropout": ("lora_dropout", adapter.dropout),
    }
    for field, (key, value) in theirs.items():
        if field in given and getattr(config, field) != value:
            flag = flag_name(field)
            raise TrainingError(
                f"{flag}: {getattr(config, field)!r} conflicts with {key}={value!r} in "
                f"{Path(config.init_adapter) / ADAPTER_CONFIG}: --init-adapter takes the "
                f"adapter's rank, alpha, dropout and layers (leave {flag} out)"
            )
    return dataclasses.replace(
        config, lora_rank=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout
    )


def load_init_adapter(model: Model, config: FinetuneConfig, targets_given: bool) -> None:
    """Put ``--init-adapter``'s PEFT adapter onto ``model`` (:func:`fusion.lora.
    load_peft_adapter`), trainable, before anything trains; with ``--lora-targets`` given
    (``targets_given``), the layers those name must be the adapter's."""
    assert config.init_adapter is not None
    selected = None
    if targets_given:
        with flag_errors("--lora-targets", ValueError):
            selected = set(select_lora_layers(model, config.lora_target_list))
    with flag_errors("--init-adapter", CheckpointError, OSError, TypeError, ValueError):
        adapted = set(load_peft_adapter(model, config.init_adapter))
    if selected is not None and selected != adapted:
        extra, missing = sorted(selected - adapted), sorted(adapted - selected)
        raise TrainingError(
            f"--lora-targets: {config.lora_targets!r} conflicts with the adapter in "
            f"{config.init_adapter}: it names {extra[:3]} that the adapter does not adapt and "
            f"leaves out {missing[:3]} that it does; --init-adapter takes the adapter's layers "
            "(leave --lora-targets out)"
        )


def build_model(
    config: FinetuneConfig, *, targets_given: bool = False, directory: HfDirectory | None = None
) -> Model:
    """The base model with what ``--train`` trains (LoRA adapters seeded by ``--seed``, or
    ``--init-adapter``'s; ``targets_given``: check ``--lora-targets`` against them), in
    float32 on CPU, unwrapped; ``directory``: ``--model``'s, its config already parsed."""
    model = load_base_model(config, directory)
    set_trainable(model, config)
    if config.train == "lora" and config.init_adapter is not None:
        load_init_adapter(model, config, targets_given)
    elif config.train == "lora":
        with torch.random.fork_rng(devices=[]), flag_errors("--lora-targets", ValueError):
            torch.manual_seed(config.seed)
            apply_lora(
                model, config.lora_target_list, rank=config.lora_rank, alpha=config.lora_alpha,
                dropout=config.lora_dropout,
            )  # fmt: skip
    return model
