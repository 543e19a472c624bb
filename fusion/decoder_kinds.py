"""The decoders ``EarlyFusion`` wraps, told apart once, from what each offers.

- ``FUSION``: this library's :class:`fusion.TransformerDecoder`. The merge runs inside its
  forward (``embed=``), after its own hooks (FSDP's unshard, say).
- ``TORCHTUNE``: any other module with a ``tok_embeddings`` submodule and a ``forward`` that
  names an ``input_embeds`` parameter (torchtune's protocol). Rows are merged into
  ``decoder.tok_embeddings(tokens)`` and passed as ``decoder(None, input_embeds=...)``.
- ``HUGGING_FACE``: a module with a ``get_input_embeddings()`` method and a ``forward`` that
  names an ``inputs_embeds`` parameter (transformers' causal LMs and base models). Rows are
  merged into ``decoder.get_input_embeddings()(tokens)`` and passed as
  ``decoder(inputs_embeds=...)``.

The kind is read from attributes and ``inspect.signature`` only: nothing is called to find
out, and a forward that takes only ``**kwargs`` does not count (it cannot be shown to accept
the embeddings).
"""

import inspect
from typing import Any

from torch import nn

from fusion._validation import is_dtensor, is_int
from fusion._wrappers import is_wrapper
from fusion.decoder import TransformerDecoder

FUSION, TORCHTUNE, HUGGING_FACE = "fusion", "torchtune", "huggingface"

EXPECTED = (
    "a fusion TransformerDecoder, a module with tok_embeddings and a forward taking "
    "input_embeds (torchtune's protocol), or a Hugging Face model with get_input_embeddings() "
    "and a forward taking inputs_embeds"
)


def decoder_kind(decoder: Any) -> str:
    """``FUSION``, ``TORCHTUNE`` or ``HUGGING_FACE`` (see the module docstring), checked in that
    order.

    Raises:
        TypeError: ``decoder`` is none of them, or a wrapper (``torch.compile``, DDP) around
            one: wrap the ``EarlyFusion`` instead. The message names what was looked for and
            what was missing.
    """
    if isinstance(decoder, TransformerDecoder):
        return FUSION
    name = type(decoder).__name__
    if not isinstance(decoder, nn.Module):
        raise TypeError(f"decoder: expected {EXPECTED}; got {name}")
    if is_wrapper(decoder):
        raise TypeError(
            f"decoder: expected {EXPECTED}; got the wrapper {name} (wrap the EarlyFusion, not "
            "the decoder, in torch.compile or DDP)"
        )
    parameters = _forward_parameters(decoder)
    if callable(getattr(decoder, "get_input_embeddings", None)):
        if "inputs_embeds" in parameters:
            return HUGGING_FACE
        raise TypeError(
            f"decoder: {name} has get_input_embeddings() but its forward takes no inputs_embeds "
            f"(parameters: {sorted(parameters)}), so merged embeddings cannot be passed to it; "
            f"expected {EXPECTED}"
        )
    if isinstance(getattr(decoder, "tok_embeddings", None), nn.Module):
        if "input_embeds" in parameters:
            return TORCHTUNE
        raise TypeError(
            f"decoder: {name} has tok_embeddings but its forward takes no input_embeds "
            f"(parameters: {sorted(parameters)}); expected {EXPECTED}"
        )
    raise TypeError(
        f"decoder: expected {EXPECTED}; {name} has neither tok_embeddings nor "
        "get_input_embeddings()"
    )


def _forward_parameters(decoder: nn.Module) -> set[str]:
    """The names ``decoder.forward`` declares (``**kwargs`` and ``*args`` excluded)."""
    try:
        signature = inspect.signature(decoder.forward)
    except (TypeError, ValueError):
        return set()
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return {n for n, p in signature.parameters.items() if p.kind not in variadic}


def embedding_module(decoder: Any, kind: str) -> nn.Module:
    """The module that embeds the decoder's text ids, looked up at each call (an adapter or a
    sharding plan may have replaced it since construction); never its weight."""
    if kind == HUGGING_FACE:
        embedding = decoder.get_input_embeddings()
        if not isinstance(embedding, nn.Module):
            raise TypeError(
                "decoder: get_input_embeddings() returned "
                f"{type(embedding).__name__}, expected a module"
            )
    else:
        embedding = decoder.tok_embeddings
    return embedding


def check_gathered(embedding: nn.Module) -> None:
    """Refuse an embedding whose weight is still sharded and that nothing will gather: with a
    decoder of another library the merge calls the embedding before the decoder's forward, so
    an FSDP2 unit holding the whole decoder has not been gathered yet. (A unit of its own, or
    a tensor-parallel plan, gathers or redistributes in the embedding's own hooks.)

    Raises:
        RuntimeError: naming the plans that work.
    """
    weight = getattr(embedding, "weight", None)
    hooks = (
        embedding._forward_pre_hooks
        or embedding._forward_hooks
        or nn.modules.module._global_forward_pre_hooks
    )
    if weight is not None and not hooks and is_dtensor(weight):
        raise RuntimeError(
            "decoder: its input embedding's weight is sharded (a DTensor) when EarlyFusion "
            "calls the embedding, before the decoder's own forward: an FSDP2 unit around the "
            "whole decoder is gathered only then. Shard the embedding as a unit of its own "
            "(fully_shard(embedding) before the decoder's unit) or leave it in the "
            "EarlyFusion's root unit (do not fully_shard the decoder as one unit)"
        )


def vocab_size(decoder: Any, kind: str, embedding: nn.Module) -> int | None:
    """The number of text ids: the decoder's own count (fusion: ``vocab_size``; Hugging Face:
    ``config.vocab_size``), else the embedding's ``num_embeddings``; None when unknown (ids are
    then not range-checked before the embedding)."""
    if kind == FUSION:
        return decoder.vocab_size
    count = getattr(embedding, "num_embeddings", None)
    if count is None and kind == HUGGING_FACE:
        count = getattr(getattr(decoder, "config", None), "vocab_size", None)
    if count is None:
        count = getattr(decoder, "vocab_size", None)
    return count if is_int(count) else None
