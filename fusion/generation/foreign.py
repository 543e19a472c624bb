"""Generation steps for the decoders of other libraries that an ``EarlyFusion`` holds (eager):
a Hugging Face causal LM through a ``DynamicCache`` made for the call, as transformers'
``generate`` runs it; a torchtune-style decoder through the caches its ``setup_caches`` makes,
with this library's masks and positions (torchtune's protocol). The prefill goes through the
``EarlyFusion`` (encoders, merge); each decoding step feeds the generated ids to the decoder.
"""

import inspect
from typing import Any

import torch
from torch import nn

from fusion.decoder_kinds import HUGGING_FACE
from fusion.padding import prefill_mask, prompt_positions, step_mask

# What a torchtune-style decoder needs to generate, as torchtune's own generation calls it.
CACHE_METHODS = ("setup_caches", "caches_are_setup", "reset_caches")


def check_decoder(decoder: nn.Module, kind: str) -> None:
    """Raise ``ValueError`` unless generation can drive ``decoder`` (a Hugging Face model with
    an output layer, a torchtune-style one with :data:`CACHE_METHODS`), before anything runs."""
    name = type(decoder).__name__
    if kind == HUGGING_FACE:
        output = getattr(decoder, "get_output_embeddings", None)
        if not callable(output) or output() is None:
            raise ValueError(
                f"model: its decoder {name} has no output layer (get_output_embeddings() is "
                "None): generation needs a causal LM that returns logits, e.g. "
                "LlamaForCausalLM rather than LlamaModel"
            )
        return
    missing = [m for m in CACHE_METHODS if not callable(getattr(decoder, m, None))]
    if missing:
        raise ValueError(
            f"model: its torchtune-style decoder {name} has no {', '.join(missing)}: "
            "generation needs a KV cache the decoder sets up itself (torchtune's "
            f"{', '.join(CACHE_METHODS)})"
        )


def capacity(decoder: Any, kind: str) -> tuple[int | None, str]:
    """The most cache positions a generation may use and what sets it, where the decoder
    states one: a torchtune-style decoder's cache length (set up) or its ``max_seq_len``; a
    Hugging Face ``DynamicCache`` grows as needed (None)."""
    if kind == HUGGING_FACE:
        return None, "the cache"
    if decoder.caches_are_setup():
        return _cache_len(decoder), "the KV cache's length"
    length = getattr(decoder, "max_seq_len", None)
    return (length if isinstance(length, int) else None), "the decoder's max_seq_len"


def _cache_len(decoder: nn.Module) -> int:
    length = getattr(decoder, "decoder_max_cache_seq_len", None)
    if not isinstance(length, int):
        raise ValueError(
            f"model: its decoder {type(decoder).__name__} has caches set up but no integer "
            "decoder_max_cache_seq_len to build the masks with; remove the caches and let "
            "generate set them up"
        )
    return length


class _Steps:
    """What both kinds keep of a generation's ``plan``, and the slot the next token goes to."""

    def __init__(self, plan: Any) -> None:
        self.call, self.decoder, self.extra = plan.call, plan.decoder, plan.extra
        self.tokens, self.pad_counts = plan.tokens, plan.pad_counts
        self.slot = self.tokens.size(1)

    def logits(self, output: Any) -> torch.Tensor:
        """Float32 logits [b, vocab] of the last slot of the decoder's output [b, s, vocab]
        (or a ``ModelOutput`` with ``logits``)."""
        logits = getattr(output, "logits", output)
        tensor = isinstance(logits, torch.Tensor)
        if not tensor or logits.dim() != 3:
            got = f"shape {list(logits.shape)}" if tensor else type(logits)
            raise ValueError(
                f"model: its decoder {type(self.decoder).__name__} returned {got}; generation "
                "needs logits [b, s, vocab]"
            )
        return logits[:, -1].float()


class HuggingFaceSteps(_Steps):
    """Steps through a Hugging Face model's own cache: the attention mask is 1 on real slots and
    grows by a column per step; positions start at 0 at each sample's first real token."""

    def __init__(self, plan: Any) -> None:
        super().__init__(plan)
        from transformers import DynamicCache  # the decoder is a transformers model

        slots = torch.arange(self.slot, device=self.tokens.device)
        self.attention = (slots[None, :] >= self.pad_counts[:, None]).long()  # [b, s]
        takes = inspect.signature(self.decoder.forward).parameters
        # transformers 5.x names the cache ``cache`` (``past_key_values`` is deprecated there);
        # earlier versions only ``past_key_values``.
        cache_arg = "cache" if "cache" in takes else "past_key_values"
        self.options: dict[str, Any] = {cache_arg: DynamicCache(config=self.decoder.config)}
        self.options["use_cache"] = True
        # Only the last slot's logits: the output projection of the others is never computed.
        if "logits_to_keep" in takes:
            self.options["logits_to_keep"] = 1

    def prefill(self) -> torch.Tensor:
        positions = prompt_positions(self.pad_counts, self.tokens.size(1))
        return self._logits(self.call, positions, self.tokens, **self.extra)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.attention = torch.cat([self.attention, self.attention.new_ones(len(token), 1)], 1)
        positions = (self.slot - self.pad_counts)[:, None]
        self.slot += 1
        return self._logits(self.decoder, positions, input_ids=token[:, None])

    def _logits(self, call: Any, positions: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        kw |= self.options
        return self.logits(call(*args, attention_mask=self.attention, position_ids=positions, **kw))

    def close(self) -> None:
        self.options.clear()  # the cache


class TorchtuneSteps(_Steps):
    """Steps through a torchtune-style decoder's caches: set up here (torn down in :meth:`close`
    where it has ``teardown_caches``) unless it has them, which are then reset and kept."""

    def __init__(self, plan: Any) -> None:
        super().__init__(plan)
        self.needed = self.slot + plan.max_new_tokens - 1  # the last token is never fed back
        self.dtype, self.created, self.cache_len = plan.dtype, False, 0

    def prefill(self) -> torch.Tensor:
        batch, seq_len = self.tokens.shape
        if self.decoder.caches_are_setup():
            self.cache_len = _cache_len(self.decoder)
            self.decoder.reset_caches()
        else:
            self.created = True  # before setup: one that fails half-way is torn down too
            self.decoder.setup_caches(batch, self.dtype, decoder_max_seq_len=self.needed)
            self.cache_len = self.needed
        mask = prefill_mask(self.pad_counts, seq_len, self.cache_len)
        positions = prompt_positions(self.pad_counts, seq_len)
        return self.logits(self.call(self.tokens, mask=mask, input_pos=positions, **self.extra))

    def step(self, token: torch.Tensor) -> torch.Tensor:
        mask = step_mask(self.pad_counts, self.slot, self.cache_len)
        positions = (self.slot - self.pad_counts)[:, None]
        self.slot += 1
        return self.logits(self.decoder(token[:, None], mask=mask, input_pos=positions))

    def close(self) -> None:
        teardown = getattr(self.decoder, "teardown_caches", None)
        if self.created and callable(teardown):
            teardown()
