"""Folding LoRA adapters into the weights they adapt."""

import sys

import torch
from torch import nn

from fusion.lora.apply import ADAPTER_CHILDREN, LORA_HOOK, lora_linears, lora_settings


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter of ``model`` into its layer's weight, then remove the adapter and its
    hook: each layer becomes the plain ``nn.Linear`` it was, with
    ``W <- W + (B @ A) * alpha / rank`` (computed in float32, stored in ``W``'s dtype), so
    ``model``'s state dict is the plain model's again (what the Hugging Face savers write).

    A merge has to read the adapter's weights (it rewrites the layer's): do it on a whole,
    unsharded model. In eval mode (no dropout) the logits are unchanged up to rounding (1e-5
    in float32, tested). ``requires_grad`` of the merged weights is left as it was (frozen
    by :func:`~fusion.lora.apply_lora`). Compile the model again after merging.

    Args:
        model: a module holding layers :func:`~fusion.lora.apply_lora` adapted (none is fine).

    Returns:
        ``model``, changed in place.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError, before anything changes: a layer's weight or adapter is sharded (a
            ``DTensor``) or on the meta device.
    """
    linears = lora_linears(model)
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for name, linear in linears.items():
        adapter = lora_settings(linear)
        tensors = (linear.weight, adapter.lora_a.weight, adapter.lora_b.weight)
        if dtensor is not None and any(isinstance(t, dtensor) for t in tensors):
            raise ValueError(
                f"model: {name!r} is sharded (DTensor): load a full state dict into an "
                "unsharded model (fusion.lora.base_state_dict / adapter_state_dict) and merge that"
            )
        if any(t.is_meta for t in tensors):
            raise ValueError(f"model: {name!r} is on the meta device: there is nothing to merge")
    with torch.no_grad():
        for linear in linears.values():
            adapter = lora_settings(linear)
            a, b = adapter.lora_a.weight, adapter.lora_b.weight  # [r, in], [out, r]
            delta = (b.float() @ a.float()) * adapter.scale  # [out, in]
            linear.weight.copy_((linear.weight.float() + delta).to(linear.weight.dtype))
            _remove_adapter(linear)
    return model


def _remove_adapter(linear: nn.Linear) -> None:
    linear.__dict__.pop(LORA_HOOK).remove()
    for child in ADAPTER_CHILDREN:
        delattr(linear, child)
    for attribute in ("lora_rank", "lora_alpha", "lora_scale"):
        linear.__dict__.pop(attribute, None)
