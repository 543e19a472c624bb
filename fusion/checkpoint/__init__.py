"""Checkpoints in and out: Hugging Face Llama directories, safetensors, safe torch files.

- :func:`load_hf_llama` / :func:`save_hf_llama`: a Hugging Face Llama directory <-> a
  ``llama3_2`` decoder (config, key names and the q/k rotary row permutation).
- :func:`load_hf_llava`, :func:`load_hf_idefics3` (also SmolVLM), :func:`load_hf_vlm` (either)
  and :func:`save_hf_llava` / :func:`save_hf_idefics3`: vision-language directories <-> a ready
  ``EarlyFusion``.
- :func:`hf_to_fusion` / :func:`fusion_to_hf`: the same conversion on state dicts.
- :func:`meta_to_fusion` / :func:`fusion_to_meta`: Meta's original ``consolidated.*.pth`` keys.
  torchtune's own checkpoints already use this library's keys: load them as they are.
- :func:`load_state_dict` / :func:`save_state_dict`: safetensors files, shards + index, and
  ``torch.load(weights_only=True)`` files, in this library's (torchtune's) key layout or any.
- :func:`select_prefix`: an ``EarlyFusion`` checkpoint's ``decoder.`` part as a plain decoder's;
  :func:`decoder_state_dict` finds the decoder's prefix behind any wrapper.
"""

from fusion.checkpoint.errors import CheckpointError
from fusion.checkpoint.files import (
    CheckpointFiles,
    TensorEntry,
    load_state_dict,
    save_state_dict,
)
from fusion.checkpoint.hf_config import (
    hf_config_from_decoder,
    llama3_2_kwargs_from_hf_config,
    read_hf_config,
)
from fusion.checkpoint.hf_keys import (
    fusion_key_to_hf,
    fusion_to_hf,
    hf_key_to_fusion,
    hf_to_fusion,
    interleaved_to_rotate_half,
    rotate_half_to_interleaved,
)
from fusion.checkpoint.hf_llama import load_hf_llama, save_hf_llama
from fusion.checkpoint.hf_vlm import (
    load_hf_idefics3,
    load_hf_llava,
    load_hf_vlm,
    save_hf_idefics3,
    save_hf_llava,
)
from fusion.checkpoint.meta_keys import fusion_to_meta, meta_to_fusion
from fusion.checkpoint.prefix import decoder_state_dict, select_prefix

__all__ = [
    "CheckpointError",
    "CheckpointFiles",
    "TensorEntry",
    "decoder_state_dict",
    "fusion_key_to_hf",
    "fusion_to_hf",
    "fusion_to_meta",
    "hf_config_from_decoder",
    "hf_key_to_fusion",
    "hf_to_fusion",
    "interleaved_to_rotate_half",
    "llama3_2_kwargs_from_hf_config",
    "load_hf_idefics3",
    "load_hf_llama",
    "load_hf_llava",
    "load_hf_vlm",
    "load_state_dict",
    "meta_to_fusion",
    "read_hf_config",
    "rotate_half_to_interleaved",
    "save_hf_idefics3",
    "save_hf_llama",
    "save_hf_llava",
    "save_state_dict",
    "select_prefix",
]
