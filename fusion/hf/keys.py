"""Llama state dicts in Hugging Face's and Meta's layouts <-> this library's (torchtune's).

One table names each tensor in the three layouts. Meta's reference code rotates channel pairs
``(2i, 2i + 1)`` of each head, as this library does, so only the names differ. Hugging Face's
``rotate_half`` pairs channel ``i`` with ``i + head_dim / 2``: the rows of ``q_proj`` and
``k_proj`` are permuted per head on the way to and from it, which maps one layout onto the other
exactly. Conversion is a pure relabelling: no arithmetic, bitwise reversible.
"""

import functools
import re
from collections.abc import Callable, Mapping

import torch

from fusion.hf.errors import check_positive_int, check_state_dict

# Each tensor's name in this library, Hugging Face and Meta. A layer's tensors are named below
# each layout's layer prefix, in which "{}" stands for the layer index.
_LAYER = ("layers.{}.", "model.layers.{}.", "layers.{}.")
_NAMES = (
    ("tok_embeddings.weight", "model.embed_tokens.weight", "tok_embeddings.weight"),
    ("norm.scale", "model.norm.weight", "norm.weight"),
    ("output.weight", "lm_head.weight", "output.weight"),
    *(
        tuple(prefix + name for prefix, name in zip(_LAYER, row, strict=True))
        for row in (
            ("attn.q_proj.weight", "self_attn.q_proj.weight", "attention.wq.weight"),
            ("attn.k_proj.weight", "self_attn.k_proj.weight", "attention.wk.weight"),
            ("attn.v_proj.weight", "self_attn.v_proj.weight", "attention.wv.weight"),
            # Qwen2's projection biases (Meta's Llama has none; named alike for symmetry)
            ("attn.q_proj.bias", "self_attn.q_proj.bias", "attention.wq.bias"),
            ("attn.k_proj.bias", "self_attn.k_proj.bias", "attention.wk.bias"),
            ("attn.v_proj.bias", "self_attn.v_proj.bias", "attention.wv.bias"),
            # Qwen3's per-head query and key norms
            ("attn.q_norm.scale", "self_attn.q_norm.weight", "attention.q_norm.weight"),
            ("attn.k_norm.scale", "self_attn.k_norm.weight", "attention.k_norm.weight"),
            ("attn.output_proj.weight", "self_attn.o_proj.weight", "attention.wo.weight"),
            ("mlp.w1.weight", "mlp.gate_proj.weight", "feed_forward.w1.weight"),
            ("mlp.w2.weight", "mlp.down_proj.weight", "feed_forward.w2.weight"),
            ("mlp.w3.weight", "mlp.up_proj.weight", "feed_forward.w3.weight"),
            ("sa_norm.scale", "input_layernorm.weight", "attention_norm.weight"),
            ("mlp_norm.scale", "post_attention_layernorm.weight", "ffn_norm.weight"),
        )
    ),
    # Qwen3.5's Gated DeltaNet layers (no Meta checkpoint has them: named as Hugging Face's)
    *(
        (
            f"layers.{{}}.attn.{ours}",
            *(f"{p}layers.{{}}.linear_attn.{theirs}" for p in ("model.", "")),
        )
        for ours, theirs in (
            ("in_proj_qkv.weight", "in_proj_qkv.weight"),
            ("in_proj_z.weight", "in_proj_z.weight"),
            ("in_proj_b.weight", "in_proj_b.weight"),
            ("in_proj_a.weight", "in_proj_a.weight"),
            ("conv1d.weight", "conv1d.weight"),
            ("dt_bias", "dt_bias"),
            ("A_log", "A_log"),
            ("norm.scale", "norm.weight"),
            ("out_proj.weight", "out_proj.weight"),
        )
    ),
)
_HF_TO_FUSION = {hf: ours for ours, hf, _ in _NAMES}
_FUSION_TO_HF = {ours: hf for ours, hf, _ in _NAMES}
_META_TO_FUSION = {meta: ours for ours, _, meta in _NAMES}
_FUSION_TO_META = {ours: meta for ours, _, meta in _NAMES}
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")  # a layer index: digits between dots
# Older Hugging Face checkpoints saved the rotary inverse frequencies, which are a function of
# the config (the decoder recomputes them), not weights.
HF_DERIVED_KEY = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_ROPE_ROWS = re.compile(r"layers\.\d+\.attn\.([qk])_(proj\.weight|proj\.bias|norm\.scale)")


#: A family's layer tensors named otherwise than a Llama's: (this library's name, Hugging Face's)
#: below the layer prefix, e.g. Gemma's ``("mlp_norm.scale", "pre_feedforward_layernorm.weight")``.
Renamed = tuple[tuple[str, str], ...]


@functools.cache
def _tables(renamed: Renamed) -> tuple[dict[str, str], dict[str, str]]:
    """(Hugging Face -> ours, ours -> Hugging Face): the Llama table with ``renamed``'s layer
    tensors in place of the rows they name (a bijection still)."""
    to_hf = _FUSION_TO_HF | {_LAYER[0] + ours: _LAYER[1] + hf for ours, hf in renamed}
    return {hf: ours for ours, hf in to_hf.items()}, to_hf


def _rename(key: str, table: Mapping[str, str]) -> str:
    if "{" in key or "}" in key:  # would be taken for the index placeholder
        raise KeyError(key)
    return table[_INDEX.sub("{}", key)].format(*_INDEX.findall(key))


def hf_key_to_fusion(key: str, renamed: Renamed = ()) -> str:
    """``model.layers.3.self_attn.o_proj.weight`` -> ``layers.3.attn.output_proj.weight``
    (``renamed``: a family's layer tensors named otherwise, see :data:`Renamed`).

    Raises:
        KeyError: not a Hugging Face Llama key.
    """
    return _rename(key, _tables(renamed)[0])


def fusion_key_to_hf(key: str, renamed: Renamed = ()) -> str:
    """``layers.3.attn.output_proj.weight`` -> ``model.layers.3.self_attn.o_proj.weight``
    (``renamed`` as :func:`hf_key_to_fusion`'s).

    Raises:
        KeyError: not a key of a ``llama3_2`` decoder.
    """
    return _rename(key, _tables(renamed)[1])


def rope_heads(key: str, num_heads: int, num_kv_heads: int) -> int | None:
    """The head count of the q/k projection this library's ``key`` names (1 for a per-head
    q/k norm, whose channels are one head's), None for another key."""
    match = _ROPE_ROWS.fullmatch(key)
    if match is None:
        return None
    if match.group(2) == "norm.scale":
        return 1
    return num_heads if match.group(1) == "q" else num_kv_heads


def _check_rows(weight: torch.Tensor, num_heads: int) -> int:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight: expected a tensor, got {type(weight).__name__}")
    check_positive_int(num_heads, "num_heads")
    if weight.dim() not in (1, 2) or weight.size(0) % (2 * num_heads):
        raise ValueError(
            f"weight: expected a weight [num_heads * head_dim, d] or a bias "
            f"[num_heads * head_dim] with num_heads={num_heads} and an even head_dim, got "
            f"shape {list(weight.shape)}"
        )
    return weight.size(0) // num_heads


def rotate_half_to_interleaved(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection [num_heads * head_dim, d] (or its bias) from
    Hugging Face's rotate-half layout (per head: all first halves, then all second halves) to
    Meta's interleaved pairs. A permutation: the values are the same bits.

    Raises:
        TypeError: ``weight`` not a tensor or ``num_heads`` not an int.
        ValueError: ``num_heads`` not positive, or ``weight`` not [num_heads * head_dim, d]
            with an even ``head_dim``.
    """
    head_dim = _check_rows(weight, num_heads)
    # [heads, 2 halves, head_dim / 2, (d)] -> [heads, head_dim / 2 pairs, 2, (d)]
    rows = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).transpose(1, 2)
    return rows.reshape(weight.shape)


def interleaved_to_rotate_half(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of :func:`rotate_half_to_interleaved` (same errors)."""
    head_dim = _check_rows(weight, num_heads)
    # [heads, head_dim / 2 pairs, 2, (d)] -> [heads, 2 halves, head_dim / 2, (d)]
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2)
    return rows.reshape(weight.shape)


def _convert(
    state_dict: Mapping[str, torch.Tensor],
    table: Mapping[str, str],
    what: str,
    permute: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    num_heads: object = 1,
    num_kv_heads: object = 1,
    skip: re.Pattern[str] | None = None,
) -> dict[str, torch.Tensor]:
    check_state_dict(state_dict)
    heads = check_positive_int(num_heads, "num_heads")
    kv_heads = check_positive_int(num_kv_heads, "num_kv_heads")
    converted = {}
    for key, tensor in state_dict.items():
        if skip is not None and skip.fullmatch(key):
            continue
        try:
            new_key = _rename(key, table)
        except KeyError:
            raise ValueError(f"state_dict: unexpected key {key!r} for {what}") from None
        # This library's key is the new one or the old one, depending on the direction.
        rows = rope_heads(key, heads, kv_heads) or rope_heads(new_key, heads, kv_heads)
        if permute is not None and rows is not None:
            try:
                tensor = permute(tensor, rows).contiguous()
            except ValueError as error:  # name the key, not the helper's argument
                message = str(error).removeprefix("weight: ")
                raise ValueError(f"state_dict: {key!r}: {message}") from None
        converted[new_key] = tensor
    return converted


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
    return _convert(
        state_dict,
        _HF_TO_FUSION,
        "a Llama model",
        rotate_half_to_interleaved,
        num_heads,
        num_kv_heads,
        skip=HF_DERIVED_KEY,
    )


def fusion_to_hf(
    state_dict: Mapping[str, torch.Tensor],
    *,
    num_heads: int,
    num_kv_heads: int,
    permute_rope: bool = True,
    renamed: Renamed = (),
) -> dict[str, torch.Tensor]:
    """Convert this library's Llama state dict to Hugging Face's ``LlamaForCausalLM`` layout.

    A tied decoder has no ``output.weight``, so the result has no ``lm_head.weight``, as in
    Hugging Face's own tied checkpoints. ``hf_to_fusion(fusion_to_hf(sd)) == sd`` bitwise.
    ``permute_rope=False``: the decoder rotates in Hugging Face's rotate-half layout already
    (Qwen3.5), so only the names change. ``renamed``: a family's layer tensors named
    otherwise (:data:`Renamed`: Gemma's four norms).

    Raises:
        TypeError: ``state_dict`` not a mapping; ``num_heads``/``num_kv_heads`` not ints.
        ValueError: a non-string key or non-tensor value; a key that is not part of a
            ``llama3_2`` decoder; head counts not positive, or q/k shapes that do not split
            into them.
    """
    return _convert(
        state_dict,
        _tables(renamed)[1],
        "a Llama decoder",
        interleaved_to_rotate_half if permute_rope else None,
        num_heads,
        num_kv_heads,
    )


def meta_to_fusion(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Meta Llama state dict (``consolidated.00.pth``: ``layers.0.attention.wq.weight``,
    ...) to this library's keys; the tensors are the same objects. Read the file with
    :func:`fusion.checkpoint.load_state_dict`; torchtune's own checkpoints need no renaming.

    Raises:
        TypeError: ``state_dict`` not a mapping.
        ValueError: a non-string key or non-tensor value; a key that is not part of a Meta
            Llama checkpoint.
    """
    return _convert(state_dict, _META_TO_FUSION, "a Meta Llama checkpoint")


def fusion_to_meta(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`meta_to_fusion`.

    Raises:
        TypeError: ``state_dict`` not a mapping.
        ValueError: a non-string key or non-tensor value; a key that is not part of a
            ``llama3_2`` decoder.
    """
    return _convert(state_dict, _FUSION_TO_META, "a Llama decoder")
