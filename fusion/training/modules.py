"""Training helpers on a model: its trainable parameters, and activation checkpointing and
regional compilation per decoder layer, applied from outside."""

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusion._wrappers import decoder_of, unwrap
from fusion.decoder import TransformerDecoder


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that require grad, in order."""
    return [p for p in model.parameters() if p.requires_grad]


def decoder_of_model(model: nn.Module) -> TransformerDecoder:
    """The decoder of ``model`` behind its wrappers (DDP, FSDP, compile): itself or its
    ``.decoder``.

    Raises:
        ValueError: there is none.
    """
    decoder = decoder_of(unwrap(model))
    if decoder is None:
        raise ValueError(
            f"model: expected a TransformerDecoder or a model over one, got {type(model).__name__}"
        )
    return decoder


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass
    (``torch.utils.checkpoint``, non-reentrant), applied from outside: each layer's ``forward``
    is wrapped in place, so no module is replaced and no parameter or checkpoint key changes;
    hooks on the layer (FSDP2's unshard, LoRA) run around it as before.

    Raises:
        ValueError: ``model`` is not (behind its wrappers) a decoder or a model over one.
    """
    decoder = decoder_of_model(model)
    for layer in decoder.layers:
        layer.forward = functools.partial(_checkpointed_forward, layer.forward)


def compile_layers(model: nn.Module, *, backend: str | Any = "inductor") -> None:
    """Regional compilation: each decoder layer compiled in place (``nn.Module.compile``),
    so no module is replaced and no key changes (compile after :func:`checkpoint_activations`
    and before wrapping for DDP/FSDP).

    The layers are alike, so they share what is compiled: with dynamic shapes
    (``dynamic=True``) the first layer's graph serves every layer and every packed row length,
    with no recompilation over a run. PyTorch specialises sizes 0 and 1, so a micro-batch of
    one row compiles once more than one of several rows; after those two, batches of any
    shape reuse them (tested with ``torch.compiler.set_stance("fail_on_recompile")``).

    Raises:
        ValueError: ``model`` is not (behind its wrappers) a decoder or a model over one.
    """
    decoder = decoder_of_model(model)
    for layer in decoder.layers:
        layer.compile(backend=backend, dynamic=True)
