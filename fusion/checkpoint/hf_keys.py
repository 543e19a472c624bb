"""Hugging Face Llama state dicts <-> this library's (torchtune's) layout.

Two differences: the key names, and the order of the rows of ``q_proj`` and ``k_proj``. This
library rotates channel pairs ``(2i, 2i + 1)`` of each head (Meta's interleaved layout);
Hugging Face's ``rotate_half`` pairs channel ``i`` with ``i + head_dim / 2``. Permuting the
rows of the q/k projections per head maps one layout onto the other exactly, so conversion is a
pure relabelling: no arithmetic, bitwise reversible.
"""

import re
from collections.abc import Callable, Mapping

import torch

from fusion.checkpoint._checks import check_positive_int, check_state_dict

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FUSION_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Older Hugging Face checkpoints saved the rotary inverse frequencies, which are a function of
# the config (the decoder recomputes them), not weights.
HF_DERIVED_KEY = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

_TOP_LEVEL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
_PER_LAYER = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
}
_TOP_LEVEL_BACK = {v: k for k, v in _TOP_LEVEL.items()}
_PER_LAYER_BACK = {v: k for k, v in _PER_LAYER.items()}


def hf_key_to_fusion(key: str) -> str:
    """``model.layers.3.self_attn.o_proj.weight`` -> ``layers.3.attn.output_proj.weight``.

    Raises:
        KeyError: not a Hugging Face Llama key.
    """
    if key in _TOP_LEVEL:
        return _TOP_LEVEL[key]
    match = _HF_LAYER.fullmatch(key)
    if match and match.group(2) in _PER_LAYER:
        return f"layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}"
    raise KeyError(key)


def fusion_key_to_hf(key: str) -> str:
    """``layers.3.attn.output_proj.weight`` -> ``model.layers.3.self_attn.o_proj.weight``.

    Raises:
        KeyError: not a key of a ``llama3_2`` decoder.
    """
    if key in _TOP_LEVEL_BACK:
        return _TOP_LEVEL_BACK[key]
    match = _FUSION_LAYER.fullmatch(key)
    if match and match.group(2) in _PER_LAYER_BACK:
        return f"model.layers.{match.group(1)}.{_PER_LAYER_BACK[match.group(2)]}"
    raise KeyError(key)


def needs_rope_permutation(fusion_key: str) -> bool:
    """Whether the rows of this tensor are in a rotary layout (q and k projections)."""
    return fusion_key.endswith(("attn.q_proj.weight", "attn.k_proj.weight"))


def _check_rows(weight: torch.Tensor, num_heads: int, name: str) -> tuple[int, int]:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(weight).__name__}")
    check_positive_int(num_heads, "num_heads")
    if weight.dim() != 2 or weight.size(0) % (2 * num_heads):
        raise ValueError(
            f"{name}: expected a weight [num_heads * head_dim, d] with num_heads={num_heads} and "
            f"an even head_dim, got shape {list(weight.shape)}"
        )
    return weight.size(0) // num_heads, weight.size(1)


def rotate_half_to_interleaved(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection [num_heads * head_dim, d] from Hugging Face's
    rotate-half layout (per head: all first halves, then all second halves) to Meta's
    interleaved pairs. A permutation: the values are the same bits.

    Raises:
        TypeError: ``weight`` not a tensor or ``num_heads`` not an int.
        ValueError: ``num_heads`` not positive, or ``weight`` not [num_heads * head_dim, d]
            with an even ``head_dim``.
    """
    head_dim, d = _check_rows(weight, num_heads, "weight")
    rows = weight.reshape(num_heads, 2, head_dim // 2, d).transpose(1, 2)
    return rows.reshape(num_heads * head_dim, d)


def interleaved_to_rotate_half(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of :func:`rotate_half_to_interleaved` (same errors)."""
    head_dim, d = _check_rows(weight, num_heads, "weight")
    rows = weight.reshape(num_heads, head_dim // 2, 2, d).transpose(1, 2)
    return rows.reshape(num_heads * head_dim, d)


def _heads(fusion_key: str, num_heads: int, num_kv_heads: int) -> int:
    return num_heads if fusion_key.endswith("q_proj.weight") else num_kv_heads


def _check_arguments(state_dict: object, num_heads: object, num_kv_heads: object) -> None:
    check_state_dict(state_dict)
    check_positive_int(num_heads, "num_heads")
    check_positive_int(num_kv_heads, "num_kv_heads")


def _permute(
    permutation: Callable[[torch.Tensor, int], torch.Tensor],
    tensor: torch.Tensor,
    heads: int,
    key: str,
) -> torch.Tensor:
    try:
        return permutation(tensor, heads)
    except ValueError as error:  # name the key, not the helper's argument
        raise ValueError(f"state_dict: {key!r}: {str(error).removeprefix('weight: ')}") from None


def hf_to_fusion(
    state_dict: Mapping[str, torch.Tensor], *, num_heads: int, num_kv_heads: int
) -> dict[str, torch.Tensor]:
    """Convert a Hugging Face ``LlamaForCausalLM`` state dict to this library's layout.

    ``lm_head.weight`` becomes ``output.weight`` whenever present: for a tied model, drop it (or
    check it equals the embedding) before ``load_state_dict``. Rotary ``inv_freq`` buffers are
    skipped (they are derived from the config).

    Args:
        state_dict: Hugging Face key -> tensor.
        num_heads, num_kv_heads: the config's ``num_attention_heads`` and
            ``num_key_value_heads``, which the q/k row permutation needs.

    Returns:
        this library's key -> tensor; tensors other than q/k are the very same objects.

    Raises:
        TypeError: ``state_dict`` not a mapping; ``num_heads``/``num_kv_heads`` not ints.
        ValueError: a non-string key or non-tensor value; a key that is not part of a Hugging
            Face Llama; head counts not positive, or q/k shapes that do not split into them.
    """
    _check_arguments(state_dict, num_heads, num_kv_heads)
    converted = {}
    for key, tensor in state_dict.items():
        if HF_DERIVED_KEY.fullmatch(key):
            continue
        try:
            new_key = hf_key_to_fusion(key)
        except KeyError:
            raise ValueError(f"state_dict: unexpected key {key!r} for a Llama model") from None
        if needs_rope_permutation(new_key):
            heads = _heads(new_key, num_heads, num_kv_heads)
            tensor = _permute(rotate_half_to_interleaved, tensor, heads, key).contiguous()
        converted[new_key] = tensor
    return converted


def fusion_to_hf(
    state_dict: Mapping[str, torch.Tensor], *, num_heads: int, num_kv_heads: int
) -> dict[str, torch.Tensor]:
    """Convert this library's Llama state dict to Hugging Face's ``LlamaForCausalLM`` layout.

    A tied decoder has no ``output.weight``, so the result has no ``lm_head.weight``, as in
    Hugging Face's own tied checkpoints. ``hf_to_fusion(fusion_to_hf(sd)) == sd`` bitwise.

    Raises:
        TypeError: ``state_dict`` not a mapping; ``num_heads``/``num_kv_heads`` not ints.
        ValueError: a non-string key or non-tensor value; a key that is not part of a
            ``llama3_2`` decoder; head counts not positive, or q/k shapes that do not split
            into them.
    """
    _check_arguments(state_dict, num_heads, num_kv_heads)
    converted = {}
    for key, tensor in state_dict.items():
        try:
            new_key = fusion_key_to_hf(key)
        except KeyError:
            raise ValueError(f"state_dict: unexpected key {key!r} for a Llama decoder") from None
        if needs_rope_permutation(key):
            heads = _heads(key, num_heads, num_kv_heads)
            tensor = _permute(interleaved_to_rotate_half, tensor, heads, key).contiguous()
        converted[new_key] = tensor
    return converted
