"""Fine-tune a Hugging Face vision-language model (LLaVA, Idefics3, SmolVLM, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL) or a Llama on your own conversations.

``python -m recipes.finetune --model DIR --data train.jsonl --output-dir runs/x`` (``--help``
lists every flag): the data are checked whole before training, packed into block-causal
sequences, trained with LoRA (default), fully (FSDP2 or DDP under ``torchrun``) or the
connector alone; checkpoints resume bit for bit; ``runs/x/final/`` is a Hugging Face directory
transformers loads. A short script of library calls: :mod:`fusion.data`, :mod:`fusion.lora`,
:mod:`fusion.training`, :mod:`fusion.checkpoint`.
"""

from recipes.finetune.cli import main
from recipes.finetune.config import FinetuneConfig, parse_args

__all__ = ["FinetuneConfig", "main", "parse_args"]
