"""The model a fine-tuning run trains: loaded from a Hugging Face directory, with what
``--train`` says trainable (LoRA adapters new, or a PEFT adapter's with ``--init-adapter``),
(activation checkpointing: :func:`fusion.training.modules.checkpoint_activations`)."""

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from fusion import EarlyFusion, TransformerDecoder
from fusion._wrappers import decoder_of
from fusion.checkpoint import CheckpointError, load_hf_llama, load_hf_vlm
from fusion.checkpoint.hf_vlm import hf_model_kind
from fusion.lora import load_peft_adapter, read_peft_config, select_lora_layers
from fusion.lora.peft import ADAPTER_CONFIG
from fusion.training import TrainingError, one_line
from recipes.finetune.config import FinetuneConfig

Model = EarlyFusion | TransformerDecoder


def load_base_model(config: FinetuneConfig) -> Model:
    """The model of ``--model`` in float32 on CPU, every parameter frozen: an ``EarlyFusion``
    for LLaVA / Idefics3 / SmolVLM / Qwen2-VL / Qwen2.5-VL / Qwen3-VL directories, a
    ``TransformerDecoder`` for a Llama.

    Raises:
        TrainingError: naming the file and the problem (no config, an unknown ``model_type``,
            damaged weights) or ``--max-seq-len`` above the model's positions.
    """
    assert config.model is not None
    path = Path(config.model)
    try:
        kind = hf_model_kind(path)
        model: Model
        if kind == "llama":
            model = load_hf_llama(path, dtype=torch.float32)
        else:
            model = load_hf_vlm(path, dtype=torch.float32)
    except (CheckpointError, ValueError, TypeError, OSError) as error:
        raise TrainingError(f"--model: {one_line(error)}") from None
    model.requires_grad_(False)
    decoder = decoder_of(model)
    assert decoder is not None
    limit = decoder.max_seq_len
    if config.max_seq_len > limit:
        raise TrainingError(
            f"--max-seq-len: expected at most the model's {limit} positions "
            f"(max_position_embeddings), got {config.max_seq_len}"
        )
    return model


def set_trainable(model: Model, config: FinetuneConfig) -> None:
    """Make trainable what ``--train`` names, with :meth:`fusion.EarlyFusion.set_trainable`
    (before LoRA is applied, which adds its own): ``full``: the decoder and the connector, the
    vision tower too with ``--train-vision``; ``projector``: the connector alone (LLaVA's stage
    1; Qwen2-VL's patch merger; Qwen3-VL's and its DeepStack mergers); ``lora``: nothing.

    Raises:
        TrainingError: ``--train projector`` for a text-only model (it has no connector).
    """
    if isinstance(model, EarlyFusion):
        full = config.train == "full"
        model.set_trainable(
            decoder=full,
            encoders=full and config.train_vision,
            fusion=full or config.train == "projector",
        )
    elif config.train == "projector":
        raise TrainingError("--train: 'projector' needs a vision-language --model, got a Llama")
    else:
        model.requires_grad_(config.train == "full")


# --init-adapter: the flags whose values come from the adapter's adapter_config.json, and the
# key each is read from there.
ADAPTER_FLAGS = {"lora_rank": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}


def init_adapter_config(config: FinetuneConfig, given: Collection[str]) -> FinetuneConfig:
    """With ``--init-adapter``: ``config`` with the adapter's rank, alpha and dropout (read
    from its ``adapter_config.json``, checked by :func:`fusion.lora.read_peft_config`), so the
    run records what trains; ``config`` itself without it. The flags in ``given`` (those on
    the command line) must agree with the adapter.

    Raises:
        TrainingError: naming the file and key: an ``adapter_config.json`` that is missing,
            malformed or asks for what this library does not compute (DoRA,
            ``modules_to_save``, rank patterns, ...); naming the flag: ``--lora-rank``,
            ``--lora-alpha`` or ``--lora-dropout`` given with another value than the
            adapter's.
    """
    if config.init_adapter is None:
        return config
    try:
        adapter = read_peft_config(config.init_adapter)
    except (CheckpointError, OSError, ValueError) as error:
        raise TrainingError(f"--init-adapter: {one_line(error)}") from None
    theirs: dict[str, Any] = {"lora_rank": adapter.rank, "lora_alpha": adapter.alpha}
    theirs["lora_dropout"] = adapter.dropout
    for field, value in theirs.items():
        if field in given and getattr(config, field) != value:
            flag = "--" + field.replace("_", "-")
            raise TrainingError(
                f"{flag}: {getattr(config, field)!r} conflicts with {ADAPTER_FLAGS[field]}="
                f"{value!r} in {Path(config.init_adapter) / ADAPTER_CONFIG}: --init-adapter "
                f"takes the adapter's rank, alpha, dropout and layers (leave {flag} out)"
            )
    return dataclasses.replace(config, **theirs)


def load_init_adapter(model: Model, config: FinetuneConfig, targets_given: bool) -> None:
    """Put ``--init-adapter``'s PEFT adapter onto ``model`` (:func:`fusion.lora.
    load_peft_adapter`: the layers its weights adapt, its rank, alpha and dropout, its
    factors), trainable; the base stays frozen. With ``--lora-targets`` given
    (``targets_given``), the layers those name must be the adapter's.

    Raises:
        TrainingError: naming the file (and key): an adapter this library cannot apply
            (unsupported options, layers ``model`` does not have, shapes that do not fit
            ``--model``), refused before anything is trained; naming ``--lora-targets``: a
            pattern that matches nothing, or other layers than the adapter's.
    """
    assert config.init_adapter is not None
    selected = None
    if targets_given:
        try:
            selected = set(select_lora_layers(model, config.lora_target_list))
        except ValueError as error:
            raise TrainingError(f"--lora-targets: {one_line(error)}") from None
    try:
        adapted = load_peft_adapter(model, config.init_adapter)
    except (CheckpointError, OSError, TypeError, ValueError) as error:
        raise TrainingError(f"--init-adapter: {one_line(error)}") from None
    if selected is not None and selected != set(adapted):
        extra, missing = sorted(selected - set(adapted)), sorted(set(adapted) - selected)
        raise TrainingError(
            f"--lora-targets: {config.lora_targets!r} conflicts with the adapter in "
            f"{config.init_adapter}: it names {extra[:3]} that the adapter does not adapt and "
            f"leaves out {missing[:3]} that it does; --init-adapter takes the adapter's layers "
            "(leave --lora-targets out)"
        )
