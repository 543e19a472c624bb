"""The Llama family's ``config.json`` mapping, both ways: a Llama's config <-> the arguments
of :func:`fusion.models.llama3_2`. The vision-language families' text models are Llamas (or
Qwen's extensions of one) and read and write their ``text_config`` through it too."""

import os
from collections.abc import Mapping
from typing import Any, TypeGuard, cast

import torch

from fusion.decoder import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    RotaryPositionalEmbeddings,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from fusion.hf.config import CONFIG_NAME, ConfigReader
from fusion.hf.errors import as_path, short_repr

# Keys without a usable default: Hugging Face's defaults describe a 7B model, so a config that
# omits them is almost certainly not the one meant.
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def llama3_2_kwargs_from_hf_config(
    config: Mapping[str, Any], *, source: str | bytes | os.PathLike = CONFIG_NAME
) -> dict[str, Any]:
    """Keyword arguments of :func:`fusion.models.llama3_2` for a Hugging Face Llama config.

    Reads both the legacy ``rope_theta`` + ``rope_scaling`` keys and the newer
    ``rope_parameters``; rope types ``default`` and ``llama3`` are supported. Optional keys
    take Hugging Face's ``LlamaConfig`` defaults (``num_key_value_heads = num_attention_heads``,
    ``rms_norm_eps = 1e-6``, ``rope_theta = 10000``, ``tie_word_embeddings = false``,
    ``max_position_embeddings = 2048``).

    Args:
        config: the parsed ``config.json``.
        source: the file it came from, for error messages.

    Raises:
        TypeError: ``config`` is not a mapping or ``source`` not a path.
        CheckpointError: naming ``source``, the key and the value: a missing required key; a
            value of the wrong type; a size that is not an integer in [1, 2**31); a number that
            is not finite or is degenerate (``rope_theta``, ``rms_norm_eps``, the rope scaling
            ``factor`` and ``low_freq_factor`` not positive, ``high_freq_factor`` not above
            ``low_freq_factor``, ``attention_dropout`` outside [0, 1]); head counts that do not
            divide (``hidden_size`` by ``num_attention_heads``, that by
            ``num_key_value_heads``) or an odd head dimension; or a feature ``llama3_2`` cannot
            express (biases, another activation, another rope type,
            ``head_dim != hidden_size / num_attention_heads``, a model type other than
            ``llama``).
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config: expected a mapping, got {type(config).__name__}")
    return llama_kwargs(ConfigReader(config, as_path(source, "source")))


def llama_kwargs(config: ConfigReader, *, own_head_dim: bool = False) -> dict[str, Any]:
    """:func:`llama3_2_kwargs_from_hf_config`, for a config wherever it is found.

    ``own_head_dim``: read ``head_dim`` as a size of its own (Qwen3), which then need not be
    ``hidden_size / num_attention_heads``; it is in the result as ``head_dim``."""
    values = config.values
    model_type = values.get("model_type", "llama")
    if model_type != "llama":
        raise config.fail("model_type", f"expected 'llama', got {short_repr(model_type)}")
    for key in _REQUIRED:
        if key not in values:
            raise config.fail(key, "missing; a Llama config needs it")
    for key, expected in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if values.get(key, expected) != expected:
            raise config.fail(
                key, f"expected {expected!r} (Llama 3), got {short_repr(values[key])}"
            )

    hidden_size = config.integer("hidden_size")
    num_heads = config.integer("num_attention_heads")
    num_kv_heads = config.integer("num_key_value_heads", num_heads)
    head_dim = hidden_size // num_heads
    if own_head_dim:
        head_dim = config.integer("head_dim", None if hidden_size % num_heads else head_dim)
    elif hidden_size % num_heads:
        raise config.fail(
            "hidden_size",
            f"expected a multiple of num_attention_heads={num_heads}, got {hidden_size}",
        )
    if values.get("head_dim") not in (None, head_dim):
        raise config.fail(
            "head_dim",
            f"expected hidden_size / num_attention_heads = {head_dim}, got "
            f"{short_repr(values['head_dim'])}",
        )
    if head_dim % 2:
        raise config.fail(
            "hidden_size",
            "expected an even head dimension (rotary pairs), got "
            + (str(head_dim) if own_head_dim else f"{hidden_size} / {num_heads}"),
        )
    if num_heads % num_kv_heads:
        raise config.fail(
            "num_key_value_heads", f"expected a divisor of {num_heads}, got {num_kv_heads}"
        )

    rope_key = "rope_parameters" if values.get("rope_parameters") else "rope_scaling"
    rope_values = (
        config.get(
            rope_key, None, lambda v: v is None or isinstance(v, Mapping), "an object or null"
        )
        or {}
    )
    rope = ConfigReader(rope_values, config.source, f"{config.prefix}{rope_key}.")
    theta = values.get("rope_theta", rope_values.get("rope_theta", 10_000.0))
    if (
        "rope_theta" in values
        and "rope_theta" in rope_values
        and rope_values["rope_theta"] != theta
    ):
        raise config.fail(
            "rope_theta",
            f"{short_repr(theta)} disagrees with {rope_key}' "
            f"{short_repr(rope_values['rope_theta'])}",
        )
    kwargs: dict[str, Any] = {
        "vocab_size": config.integer("vocab_size"),
        "num_layers": config.integer("num_hidden_layers"),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "embed_dim": hidden_size,
        "max_seq_len": config.integer("max_position_embeddings", 2048),
        "attn_dropout": config.number("attention_dropout", 0.0, 0.0, closed=True, high=1.0),
        "rope_base": config.number("rope_theta", theta, 0.0),
        "intermediate_dim": config.integer("intermediate_size"),
        "norm_eps": config.number("rms_norm_eps", 1e-6, 0.0, high=1.0),
        "tie_word_embeddings": config.flag("tie_word_embeddings"),
        "scale_factor": None,
    }
    if own_head_dim:
        kwargs["head_dim"] = head_dim
    rope_type = rope_values.get("rope_type", rope_values.get("type", "default"))
    if rope_type == "llama3":
        for key in (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ):
            if key not in rope_values:
                raise rope.fail(key, "missing; rope type llama3 needs it")
        low = rope.number("low_freq_factor", None, 0.0)
        kwargs |= {
            "scale_factor": rope.number("factor", None, 0.0),
            "rope_low_freq_factor": low,
            "rope_high_freq_factor": rope.number("high_freq_factor", None, low),
            "rope_old_context_len": rope.integer("original_max_position_embeddings"),
        }
    elif rope_type != "default":
        raise config.fail(
            rope_key, f"rope type {short_repr(rope_type)} unsupported: expected llama3 or none"
        )
    return kwargs


def hf_config_from_decoder(decoder: TransformerDecoder, *, qwen: bool = False) -> dict[str, Any]:
    """A Hugging Face ``LlamaForCausalLM`` config describing ``decoder``.

    ``qwen``: the decoder may also have what Qwen's text stacks add (q/k/v biases, q/k norms,
    M-RoPE, a ``head_dim`` of its own), which the caller writes into its config; without it
    such a decoder is refused, as no Llama config describes it.

    Written in the legacy form (``rope_theta``, ``rope_scaling``) that every version of
    ``transformers`` reads. ``torch_dtype`` is the embedding table's dtype.

    Raises:
        TypeError: ``decoder`` is not a ``TransformerDecoder``.
        ValueError: ``decoder`` is not a homogeneous Llama (as :func:`fusion.models.llama3_2`
            builds): layers of other types or with differing head layouts, norms or rope.
    """
    if not isinstance(decoder, TransformerDecoder):
        raise TypeError(f"decoder: expected a TransformerDecoder, got {type(decoder).__name__}")
    layers = [layer for layer in decoder.layers if _is_llama_layer(layer)]
    if not layers or len(layers) != len(decoder.layers):
        raise ValueError(
            "decoder: expected llama3_2 layers (MultiHeadAttention with RoPE, FeedForward, "
            "RMSNorm), got another structure"
        )
    first = layers[0]
    # _is_llama_layer checked the parts' types; the layer's annotations are any mixer's.
    attn = cast(MultiHeadAttention, first.attn)
    rope = attn.pos_embeddings

    def signature(layer: TransformerSelfAttentionLayer) -> tuple:
        a = cast(MultiHeadAttention, layer.attn)
        r = a.pos_embeddings
        return (
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            a.attn_dropout,
            layer.mlp.w1.out_features,
            cast(RMSNorm, layer.sa_norm).eps,
            cast(RMSNorm, layer.mlp_norm).eps,
            (r.dim, r.base, r.scale_factor, r.low_freq_factor, r.high_freq_factor),
            r.old_context_len,
        )

    if len({signature(layer) for layer in layers}) != 1 or first.sa_norm.eps != decoder.norm.eps:
        raise ValueError("decoder: expected all layers configured alike (heads, MLP, norms, rope)")
    qwen_parts = {
        "q/k/v biases": attn.q_proj.bias is not None,
        "q/k norms": attn.q_norm is not None,
        "M-RoPE": rope.is_multimodal,
    }
    if not qwen and any(qwen_parts.values()):
        found = [name for name, present in qwen_parts.items() if present]
        raise ValueError(f"decoder: has {', '.join(found)}, which a Llama config cannot describe")
    if not qwen and attn.num_heads * attn.head_dim != decoder.embed_dim:
        raise ValueError(
            f"decoder: expected num_heads * head_dim == embed_dim, got {attn.num_heads} * "
            f"{attn.head_dim} != {decoder.embed_dim}"
        )
    rope_scaling = None
    if rope.scale_factor is not None:
        rope_scaling = {
            "factor": float(rope.scale_factor),
            "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": int(rope.old_context_len),
            "rope_type": "llama3",
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": decoder.vocab_size,
        "hidden_size": decoder.embed_dim,
        "intermediate_size": first.mlp.w1.out_features,
        "num_hidden_layers": len(layers),
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": decoder.max_seq_len,
        "rms_norm_eps": first.sa_norm.eps,
        "rope_theta": float(rope.base),
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": float(attn.attn_dropout),
        "mlp_bias": False,
        "tie_word_embeddings": decoder.output is None,
        "torch_dtype": str(decoder.tok_embeddings.weight.dtype).removeprefix("torch."),
    }


def _is_llama_layer(layer: torch.nn.Module) -> TypeGuard[TransformerSelfAttentionLayer]:
    return (
        isinstance(layer, TransformerSelfAttentionLayer)
        and isinstance(layer.attn, MultiHeadAttention)
        and isinstance(layer.attn.pos_embeddings, RotaryPositionalEmbeddings)
        and isinstance(layer.mlp, FeedForward)
        and isinstance(layer.sa_norm, RMSNorm)
        and isinstance(layer.mlp_norm, RMSNorm)
    )


#: The sizes of a text config that this library's text builders take, config key -> the
#: builder's argument (Gemma 3's and Qwen3.5's readers; a family adds its own).
DECODER_SIZES: Mapping[str, str] = {
    "vocab_size": "vocab_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "hidden_size": "embed_dim",
    "intermediate_size": "intermediate_dim",
    "max_position_embeddings": "max_seq_len",
    "head_dim": "head_dim",
}


def read_sizes(text: ConfigReader, keys: Mapping[str, str]) -> dict[str, int]:
    """The integer sizes of ``keys`` (config key -> builder argument) in ``text``, by config
    key; ``num_key_value_heads`` defaults to ``num_attention_heads``, as transformers' configs
    do.

    Raises:
        CheckpointError: naming the file and key of a size missing or not an integer.
    """
    heads = text.values["num_attention_heads"]
    return {key: text.integer(key, heads if key == "num_key_value_heads" else None) for key in keys}
