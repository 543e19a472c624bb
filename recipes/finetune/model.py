"""The model a fine-tuning run trains: loaded from a Hugging Face directory, with what
``--train`` says trainable, and activation checkpointing per decoder layer."""

import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusion import EarlyFusion, TransformerDecoder
from fusion.checkpoint import CheckpointError, load_hf_llama, load_hf_vlm
from fusion.checkpoint.hf_vlm import hf_model_kind
from fusion.early_fusion import fusion_parameter_names
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
    limit = decoder_of(model).max_seq_len
    if config.max_seq_len > limit:
        raise TrainingError(
            f"--max-seq-len: expected at most the model's {limit} positions "
            f"(max_position_embeddings), got {config.max_seq_len}"
        )
    return model


def decoder_of(model: nn.Module) -> TransformerDecoder:
    decoder = model.decoder if isinstance(model, EarlyFusion) else model
    assert isinstance(decoder, TransformerDecoder)
    return decoder


def set_trainable(model: Model, config: FinetuneConfig) -> None:
    """Make trainable what ``--train`` names (before LoRA is applied, which adds its own):

    - ``full``: the decoder and the connector (projector); the vision tower too with
      ``--train-vision``;
    - ``projector``: the connector alone (LLaVA's stage 1; Qwen2-VL's patch merger;
      Qwen3-VL's patch merger and DeepStack mergers);
    - ``lora``: nothing of the base model.

    Raises:
        TrainingError: ``--train projector`` for a text-only model (it has no connector).
    """
    model.requires_grad_(False)
    if config.train == "lora":
        return
    if config.train == "projector" and not isinstance(model, EarlyFusion):
        raise TrainingError("--train: 'projector' needs a vision-language --model, got a Llama")
    fusion = fusion_parameter_names(model)
    for name, param in model.named_parameters():
        if config.train == "projector":
            param.requires_grad_(name in fusion)
        else:
            in_encoders = name.startswith("encoders.")
            param.requires_grad_(not in_encoders or name in fusion or config.train_vision)


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass
    (``torch.utils.checkpoint``, non-reentrant), applied from outside: each layer's ``forward``
    is wrapped in place, so no module is replaced and no parameter or checkpoint key changes;
    hooks on the layer (FSDP2's unshard, LoRA) run around it as before.
    """
    for layer in decoder_of(model).layers:
        layer.forward = functools.partial(_checkpointed_forward, layer.forward)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
