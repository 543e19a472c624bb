"""How a layer that carries a LoRA adapter is known below :mod:`fusion.lora`, which builds on
:mod:`fusion.checkpoint`: the checkpoint package refuses to export such a model without
importing it.

:func:`fusion.lora.apply_lora` keeps each adapter's scale in its layer's ``__dict__`` under
:data:`LORA_MARK` (a plain attribute, not state: it is no key of the state dict), and
:func:`fusion.lora.merge_lora` removes it with the adapter.
"""

from torch import nn

LORA_MARK = "lora_scale"


def first_lora_layer(model: nn.Module) -> str | None:
    """The qualified name of the first linear layer of ``model`` that carries a LoRA adapter,
    or None."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and LORA_MARK in module.__dict__:
            return name
    return None
