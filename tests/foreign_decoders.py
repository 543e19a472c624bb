"""Decoders of other libraries for the tests: a torchtune-style decoder and a tiny Hugging Face
Llama, each with the same encoders as :func:`helpers.build_tiny_fusion`."""

import torch
from torch import nn

from fusion import EarlyFusion
from fusion.decoder import TransformerDecoder
from helpers import AUDIO_ID, TinyEncoder, build_tiny_decoder, tiny_hf_llama

IMAGE = 1000  # outside the vocabulary of every decoder here
AUDIO = AUDIO_ID  # inside it: reserved, never embedded as text


class TorchtuneStyleDecoder(nn.Module):
    """torchtune's decoder protocol, not a fusion ``TransformerDecoder``: ``tok_embeddings``,
    ``forward(tokens, *, mask=None, input_pos=None, input_embeds=None)`` returning logits, and
    ``setup_caches`` / ``caches_are_setup`` / ``reset_caches`` / ``decoder_max_cache_seq_len``.

    It owns the tiny decoder's modules under the same names (its state dict is the tiny
    decoder's) and computes with them as the tiny decoder does; the decoder object itself is
    held outside the module tree."""

    def __init__(self, decoder: TransformerDecoder) -> None:
        super().__init__()
        for name, child in decoder.named_children():
            setattr(self, name, child)
        self.__dict__["_math"] = decoder  # not a submodule: no second set of keys

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._math(tokens, mask=mask, input_pos=input_pos, input_embeds=input_embeds)

    @property
    def max_seq_len(self) -> int:
        return self._math.max_seq_len

    @property
    def decoder_max_cache_seq_len(self) -> int | None:
        return self._math.decoder_max_cache_seq_len

    def setup_caches(self, batch_size, dtype, *, decoder_max_seq_len=None, **encoder_lengths):
        self._math.setup_caches(batch_size, dtype, decoder_max_seq_len=decoder_max_seq_len)

    def caches_are_setup(self) -> bool:
        return self._math.caches_are_setup()

    def reset_caches(self) -> None:
        self._math.reset_caches()

    def teardown_caches(self) -> None:
        self._math.teardown_caches()


class CachelessTorchtuneStyleDecoder(nn.Module):
    """torchtune's forward protocol without any cache method."""

    def __init__(self, decoder: TransformerDecoder) -> None:
        super().__init__()
        for name, child in decoder.named_children():
            setattr(self, name, child)
        self.__dict__["_math"] = decoder

    def forward(self, tokens=None, *, mask=None, input_pos=None, input_embeds=None):
        return self._math(tokens, mask=mask, input_pos=input_pos, input_embeds=input_embeds)


def torchtune_style(seed: int = 0, tied: bool = True) -> TorchtuneStyleDecoder:
    return TorchtuneStyleDecoder(build_tiny_decoder(tie_word_embeddings=tied, seed=seed))


def hf_llama(seed: int = 0, tied: bool = False) -> nn.Module:
    """The tiny Hugging Face Llama (vocabulary ``HF_VOCAB``, width 32), with weights large
    enough that greedy decoding does not repeat itself."""
    return tiny_hf_llama(tied=tied, seed=seed, initializer_range=0.3)


def fuse(decoder: nn.Module, seed: int = 0, **kwargs) -> EarlyFusion:
    """An image encoder (placeholder ``IMAGE``, outside the vocabulary) and an audio encoder
    (``AUDIO``, inside it), as in ``build_tiny_fusion``."""
    torch.manual_seed(seed + 1)
    return EarlyFusion(
        decoder,
        {"image": TinyEncoder(), "audio": TinyEncoder()},
        {"image": IMAGE, "audio": AUDIO},
        **kwargs,
    )
