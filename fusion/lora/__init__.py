"""LoRA applied from outside the model, as torchtitan applies its parallelisms.

No module is replaced: :func:`apply_lora` gives each chosen ``nn.Linear`` two small children
(``lora_a`` ``[r, in]``, ``lora_b`` ``[out, r]``, B zero) and a forward hook adding
``dropout(x) @ A^T @ B^T * alpha / r`` to its output. Base weights keep their keys and are
frozen; adapters train.

- :func:`apply_lora`: adapters on the decoder's linear layers chosen by name patterns
  (``("q_proj", "v_proj")``, Hugging Face's ``o_proj``/``gate_proj``/``up_proj``/``down_proj``
  or ours, peft's ``"all-linear"``; vision tower and connector only when a dotted pattern
  names them).
- :func:`adapter_state_dict` / :func:`base_state_dict`: the model's state split in two; the
  base part has exactly the plain model's keys.
- :func:`save_adapter` / :func:`load_adapter`: the adapters as a safetensors file (with each
  layer's rank and alpha), written crash-safely, checked before loading.
- :func:`merge_lora`: fold the adapters into the weights and remove them (the plain model
  again, e.g. for :mod:`fusion.checkpoint`'s Hugging Face savers).
- :func:`save_peft_adapter` / :func:`load_peft_adapter`: the adapters in peft's own format
  (``adapter_config.json`` + ``adapter_model.safetensors``, transformers' layer names), which
  ``peft.PeftModel.from_pretrained`` and vLLM load; adapters peft trained, applied here.

::

    from fusion.lora import apply_lora, merge_lora, save_adapter

    apply_lora(model, ("q_proj", "v_proj", "output_proj"), rank=8, alpha=16)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ...  # train: FSDP2 (fusion.parallel.apply_fsdp), torch.compile and autocast work
    save_adapter(model, "run/adapter.safetensors")
    merge_lora(model)  # model.state_dict() is the plain model's again
"""

from fusion.lora.apply import (
    ALL_LINEAR,
    DEFAULT_TARGETS,
    HF_LAYER_NAMES,
    apply_lora,
    is_lora_linear,
    lora_linears,
    select_lora_layers,
)
from fusion.lora.merge import merge_lora
from fusion.lora.peft import (
    PeftLoraConfig,
    load_peft_adapter,
    read_peft_config,
    save_peft_adapter,
)
from fusion.lora.state import adapter_state_dict, base_state_dict, load_adapter, save_adapter

__all__ = [
    "ALL_LINEAR",
    "DEFAULT_TARGETS",
    "HF_LAYER_NAMES",
    "PeftLoraConfig",
    "adapter_state_dict",
    "apply_lora",
    "base_state_dict",
    "is_lora_linear",
    "load_adapter",
    "load_peft_adapter",
    "lora_linears",
    "merge_lora",
    "read_peft_config",
    "save_adapter",
    "save_peft_adapter",
    "select_lora_layers",
]
