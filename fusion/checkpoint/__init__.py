"""Checkpoints in and out: Hugging Face directories, Meta and torchtune state dicts, safetensors
and torch files.

- :func:`load_hf_model` / :func:`save_hf_model`: a Hugging Face directory of any registered
  family (:data:`fusion.families.FAMILIES`) <-> a text decoder or a ready ``EarlyFusion``.
- :func:`load_hf_llama` / :func:`save_hf_llama`: the same for a Llama directory only (config,
  key names and the q/k rotary row permutation). The per-family loaders and savers of
  earlier releases (:mod:`fusion.checkpoint.hf_vlm`) are deprecated aliases, kept for one
  release.
- :func:`export_hf`: a trained model (LoRA merged) as a Hugging Face directory with the
  source directory's tokenizer, processor, chat-template and generation-config files, written
  whole or not at all.
- :func:`hf_to_fusion` / :func:`fusion_to_hf`, :func:`meta_to_fusion` / :func:`fusion_to_meta`:
  the same renaming on state dicts (Meta's original ``consolidated.*.pth``). torchtune's own
  checkpoints already use this library's keys: load them as they are.
- :func:`load_state_dict` / :func:`save_state_dict`: safetensors files, shards + index, and
  ``torch.load(weights_only=True)`` files, in any key layout.
- :func:`select_prefix`: an ``EarlyFusion`` checkpoint's ``decoder.`` part as a plain decoder's;
  :func:`decoder_state_dict` finds the decoder's prefix behind any wrapper.

The building blocks (the file reader :class:`~fusion.checkpoint.files.CheckpointFiles`, config
conversion in :mod:`~fusion.checkpoint.hf_config`, single keys and the row permutation in
:mod:`~fusion.checkpoint.keys`) stay importable from their modules.
"""

from fusion.checkpoint.export import export_hf
from fusion.checkpoint.files import load_state_dict, save_state_dict
from fusion.checkpoint.hf_llama import load_hf_llama, save_hf_llama
from fusion.checkpoint.hf_model import load_hf_model, save_hf_model
from fusion.checkpoint.hf_vlm import (
    load_hf_idefics3,
    load_hf_llava,
    load_hf_vlm,
    save_hf_idefics3,
    save_hf_llava,
    save_hf_qwen2_vl,
    save_hf_qwen3_vl,
)
from fusion.checkpoint.keys import fusion_to_hf, fusion_to_meta, hf_to_fusion, meta_to_fusion
from fusion.checkpoint.prefix import decoder_state_dict, select_prefix
from fusion.hf.config import read_hf_config
from fusion.hf.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "decoder_state_dict",
    "export_hf",
    "fusion_to_hf",
    "fusion_to_meta",
    "hf_to_fusion",
    "load_hf_idefics3",
    "load_hf_llama",
    "load_hf_llava",
    "load_hf_model",
    "load_hf_vlm",
    "load_state_dict",
    "meta_to_fusion",
    "read_hf_config",
    "save_hf_idefics3",
    "save_hf_llama",
    "save_hf_llava",
    "save_hf_model",
    "save_hf_qwen2_vl",
    "save_hf_qwen3_vl",
    "save_state_dict",
    "select_prefix",
]
