"""Meta's original Llama checkpoints (``consolidated.00.pth``) <-> this library's layout.

Meta's reference code uses the same interleaved rotary layout as this library (and torchtune),
so only the key names differ: no row is permuted. Read the file with
:func:`fusion.checkpoint.load_state_dict` (``torch.load(weights_only=True)``).
"""

import re
from collections.abc import Mapping

import torch

from fusion.checkpoint._checks import check_state_dict

_TOP_LEVEL = {
    "tok_embeddings.weight": "tok_embeddings.weight",
    "norm.weight": "norm.scale",
    "output.weight": "output.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "attn.q_proj.weight",
    "attention.wk.weight": "attn.k_proj.weight",
    "attention.wv.weight": "attn.v_proj.weight",
    "attention.wo.weight": "attn.output_proj.weight",
    "attention_norm.weight": "sa_norm.scale",
    "ffn_norm.weight": "mlp_norm.scale",
    "feed_forward.w1.weight": "mlp.w1.weight",
    "feed_forward.w2.weight": "mlp.w2.weight",
    "feed_forward.w3.weight": "mlp.w3.weight",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _rename(key: str, top_level: Mapping[str, str], per_layer: Mapping[str, str]) -> str | None:
    if key in top_level:
        return top_level[key]
    match = _LAYER.fullmatch(key)
    if match and match.group(2) in per_layer:
        return f"layers.{match.group(1)}.{per_layer[match.group(2)]}"
    return None


def _convert(
    state_dict: Mapping[str, torch.Tensor],
    top_level: Mapping[str, str],
    per_layer: Mapping[str, str],
    what: str,
) -> dict[str, torch.Tensor]:
    check_state_dict(state_dict)
    converted = {}
    for key, tensor in state_dict.items():
        new_key = _rename(key, top_level, per_layer)
        if new_key is None:
            raise ValueError(f"state_dict: unexpected key {key!r} for {what}")
        converted[new_key] = tensor
    return converted


def meta_to_fusion(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Meta Llama state dict (``layers.0.attention.wq.weight``, ...) to this library's
    keys; the tensors are the same objects.

    Raises:
        TypeError: ``state_dict`` not a mapping.
        ValueError: a non-string key or non-tensor value; a key that is not part of a Meta
            Llama checkpoint.
    """
    return _convert(state_dict, _TOP_LEVEL, _PER_LAYER, "a Meta Llama checkpoint")


def fusion_to_meta(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`meta_to_fusion`.

    Raises:
        TypeError: ``state_dict`` not a mapping.
        ValueError: a non-string key or non-tensor value; a key that is not part of a
            ``llama3_2`` decoder.
    """
    top_level = {v: k for k, v in _TOP_LEVEL.items()}
    per_layer = {v: k for k, v in _PER_LAYER.items()}
    return _convert(state_dict, top_level, per_layer, "a Llama decoder")
