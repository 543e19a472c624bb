"""Moving state dicts between an ``EarlyFusion`` model and its plain decoder.

``EarlyFusion`` keeps the decoder as ``self.decoder``, so its checkpoint holds the decoder's
keys unchanged under ``decoder.``. Both directions are one line::

    decoder.load_state_dict(select_prefix(fusion_model.state_dict(), "decoder."))
    fusion_model.decoder.load_state_dict(plain_decoder.state_dict())

Behind a wrapper (``torch.compile``: ``_orig_mod.``, DDP: ``module.``, ``nn.Sequential``:
``0.``, ...) the prefix grows; :func:`decoder_state_dict` finds it::

    decoder.load_state_dict(decoder_state_dict(wrapped_model.state_dict()))
"""

from collections.abc import Mapping

import torch
from torch import nn

from fusion.hf.errors import check_state_dict

# A TransformerDecoder's children whose keys identify it in a state dict, whatever modules
# fill them (a LoRA-wrapped or scaled embedding, another norm).
_DECODER_CHILDREN = ("tok_embeddings.", "layers.", "norm.")


def select_prefix(state_dict: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries whose key starts with ``prefix``, with the prefix removed.

    Keys outside ``prefix`` (e.g. the encoders' ``encoders.*``) are not part of the result, by
    design: this selects a sub-model's checkpoint.

    Raises:
        TypeError: ``state_dict`` not a mapping or ``prefix`` not a string.
        ValueError: a key that is not a string; ``prefix`` does not end with ``"."``, or no key
            starts with it.
    """
    check_state_dict(state_dict, tensors=False)
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    if not prefix.endswith("."):
        raise ValueError(f"prefix: expected a module path ending with '.', got {prefix!r}")
    selected = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
    if not selected:
        first = sorted(state_dict)[:3]
        raise ValueError(f"state_dict: no key starts with {prefix!r} (keys begin {first})")
    return selected


def decoder_state_dict(
    source: Mapping[str, torch.Tensor] | nn.Module,
) -> dict[str, torch.Tensor]:
    """The text decoder's entries of a state dict, keyed as a plain decoder's.

    The decoder is found by its keys, at whatever prefix wrappers put it: ``decoder.`` of an
    ``EarlyFusion``, ``_orig_mod.decoder.`` under ``torch.compile``, ``module.`` under DDP,
    ``0.`` in an ``nn.Sequential``, none for a plain decoder; so that
    ``decoder.load_state_dict(decoder_state_dict(wrapped_model.state_dict()))`` loads. A
    decoder is a prefix under which keys of ``tok_embeddings.``, ``layers.`` and ``norm.`` all
    exist (and no other decoder); every key under it is returned, the rest (encoders, heads)
    left out, by design.
    Sharded models (FSDP): pass a full state dict, e.g. from
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict``.

    Args:
        source: a state dict (e.g. from :func:`load_state_dict`), or a module whose
            ``state_dict()`` is taken.

    Raises:
        TypeError: ``source`` neither a mapping nor an ``nn.Module``.
        ValueError: a key that is not a string; no decoder in ``source``; several (e.g. a
            policy and a reference model), listing their prefixes: pick one with
            :func:`select_prefix`.
    """
    state_dict: Mapping[str, torch.Tensor]
    if isinstance(source, nn.Module):
        state_dict = source.state_dict()
    elif isinstance(source, Mapping):
        state_dict = source
    else:
        raise TypeError(
            f"source: expected a state dict (a mapping) or an nn.Module, got "
            f"{type(source).__name__}"
        )
    check_state_dict(state_dict, "source", tensors=False)
    candidates: set[str] = set()
    for key in state_dict:
        parts = key.split(".")
        # Every module boundary at which a ``tok_embeddings`` child starts.
        candidates.update(
            "".join(f"{p}." for p in parts[:i])
            for i, part in enumerate(parts[:-1])
            if part == "tok_embeddings"
        )
    decoders = {
        prefix
        for prefix in candidates
        if all(any(k.startswith(prefix + child) for k in state_dict) for child in _DECODER_CHILDREN)
    }
    # A prefix around other decoders is a container whose children happen to carry these names
    # (e.g. attributes ``tok_embeddings``, ``layers`` and ``norm`` holding three models).
    prefixes = sorted(p for p in decoders if not any(q != p and q.startswith(p) for q in decoders))
    if not prefixes:
        first = sorted(state_dict)[:3]
        raise ValueError(
            "source: expected a decoder's keys (tok_embeddings.*, layers.* and norm.* under one "
            f"prefix), found none among {len(state_dict)} keys (they begin {first})"
        )
    if len(prefixes) > 1:
        raise ValueError(
            f"source: expected one decoder, found {len(prefixes)}, under the prefixes "
            f"{prefixes}: pick one with select_prefix(state_dict, prefix)"
        )
    (prefix,) = prefixes
    return {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
