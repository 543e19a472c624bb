"""Hugging Face Llama ``config.json`` <-> the arguments of :func:`fusion.models.llama3_2`."""

import math
import os
from collections.abc import Mapping
from typing import Any, TypeGuard

import torch

from fusion.checkpoint._checks import as_path, short_repr
from fusion.checkpoint.errors import CheckpointError
from fusion.checkpoint.files import read_json
from fusion.decoder import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    RotaryPositionalEmbeddings,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)

CONFIG_NAME = "config.json"

# Keys without a usable default: Hugging Face's defaults describe a 7B model, so a config that
# omits them is almost certainly not the one meant.
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def read_hf_config(path: str | bytes | os.PathLike) -> dict[str, Any]:
    """Read ``config.json`` (``path`` is the file or its directory).

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: missing, not a regular file, larger than
            :data:`~fusion.checkpoint.files.MAX_JSON_BYTES`, unreadable or not a JSON object.
    """
    path = as_path(path, "path")
    file = path / CONFIG_NAME if path.is_dir() else path
    config = read_json(file, "config")
    if not isinstance(config, dict):
        raise CheckpointError(file, None, "expected a JSON object")
    return config


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
    source = as_path(source, "source")

    def fail(key: str, message: str) -> CheckpointError:
        return CheckpointError(source, key, message)

    def integer(mapping: Mapping[str, Any], key: str, default: int | None = None) -> int:
        value = mapping.get(key.rpartition(".")[2], default)
        if value is None:
            raise fail(key, "missing; expected a positive integer")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
            raise fail(key, f"expected an integer in [1, 2**31), got {short_repr(value)}")
        return value

    def number(
        mapping: Mapping[str, Any],
        key: str,
        default: float,
        low: float,
        *,
        closed: bool = False,
        high: float = math.inf,
    ) -> float:
        """A finite number in (low, high], or in [low, high] with ``closed``."""
        value = mapping.get(key.rpartition(".")[2], default)
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        in_range = is_number and (low <= value <= high if closed else low < value <= high)
        if not in_range or not math.isfinite(value):
            bounds = f"{'>=' if closed else '>'} {low:g}" + (
                f", <= {high:g}" if high < 1e308 else ""
            )
            raise fail(key, f"expected a finite number {bounds}, got {short_repr(value)}")
        return float(value)

    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise fail("model_type", f"expected 'llama', got {short_repr(model_type)}")
    for key in _REQUIRED:
        if key not in config:
            raise fail(key, "missing; a Llama config needs it")
    for key, expected in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if config.get(key, expected) != expected:
            raise fail(key, f"expected {expected!r} (Llama 3), got {short_repr(config[key])}")

    hidden_size = integer(config, "hidden_size")
    num_heads = integer(config, "num_attention_heads")
    num_kv_heads = integer(config, "num_key_value_heads", num_heads)
    if hidden_size % num_heads:
        raise fail(
            "hidden_size",
            f"expected a multiple of num_attention_heads={num_heads}, got {hidden_size}",
        )
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != hidden_size // num_heads:
        raise fail(
            "head_dim",
            f"expected hidden_size / num_attention_heads = {hidden_size // num_heads}, got "
            f"{short_repr(head_dim)}",
        )
    if (hidden_size // num_heads) % 2:
        raise fail(
            "hidden_size",
            f"expected an even head dimension (rotary pairs), got {hidden_size} / {num_heads}",
        )
    if num_heads % num_kv_heads:
        raise fail("num_key_value_heads", f"expected a divisor of {num_heads}, got {num_kv_heads}")
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise fail("tie_word_embeddings", f"expected true or false, got {short_repr(tied)}")

    rope_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(rope_key) or {}
    if not isinstance(rope, Mapping):
        raise fail(rope_key, f"expected an object or null, got {short_repr(rope)}")
    theta = config.get("rope_theta", rope.get("rope_theta", 10_000.0))
    if "rope_theta" in config and "rope_theta" in rope and rope["rope_theta"] != theta:
        raise fail(
            "rope_theta",
            f"{short_repr(theta)} disagrees with {rope_key}' {short_repr(rope['rope_theta'])}",
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    kwargs: dict[str, Any] = {
        "vocab_size": integer(config, "vocab_size"),
        "num_layers": integer(config, "num_hidden_layers"),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "embed_dim": hidden_size,
        "max_seq_len": integer(config, "max_position_embeddings", 2048),
        "attn_dropout": number(config, "attention_dropout", 0.0, 0.0, closed=True, high=1.0),
        "rope_base": number({"rope_theta": theta}, "rope_theta", 10_000.0, 0.0),
        "intermediate_dim": integer(config, "intermediate_size"),
        "norm_eps": number(config, "rms_norm_eps", 1e-6, 0.0, high=1.0),
        "tie_word_embeddings": tied,
        "scale_factor": None,
    }
    if rope_type == "llama3":
        needed = (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        )
        for key in needed:
            if key not in rope:
                raise fail(f"{rope_key}.{key}", "missing; rope type llama3 needs it")
        low = number(rope, f"{rope_key}.low_freq_factor", 0.0, 0.0)
        kwargs |= {
            "scale_factor": number(rope, f"{rope_key}.factor", 0.0, 0.0),
            "rope_low_freq_factor": low,
            "rope_high_freq_factor": number(rope, f"{rope_key}.high_freq_factor", 0.0, low),
            "rope_old_context_len": integer(rope, f"{rope_key}.original_max_position_embeddings"),
        }
    elif rope_type != "default":
        raise fail(
            rope_key, f"rope type {short_repr(rope_type)} unsupported: expected llama3 or none"
        )
    return kwargs


def hf_config_from_decoder(decoder: TransformerDecoder) -> dict[str, Any]:
    """A Hugging Face ``LlamaForCausalLM`` config describing ``decoder``.

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
    attn, rope = first.attn, first.attn.pos_embeddings

    def signature(layer: TransformerSelfAttentionLayer) -> tuple:
        a, r = layer.attn, layer.attn.pos_embeddings
        return (
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            a.attn_dropout,
            layer.mlp.w1.out_features,
            layer.sa_norm.eps,
            layer.mlp_norm.eps,
            (r.dim, r.base, r.scale_factor, r.low_freq_factor, r.high_freq_factor),
            r.old_context_len,
        )

    if len({signature(layer) for layer in layers}) != 1 or first.sa_norm.eps != decoder.norm.eps:
        raise ValueError("decoder: expected all layers configured alike (heads, MLP, norms, rope)")
    if attn.num_heads * attn.head_dim != decoder.embed_dim:
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
