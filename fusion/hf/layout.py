"""Where a model's parts sit in a Hugging Face checkpoint (:class:`KeyLayout`): the table that
turns a checkpoint's keys into this library's and back, for any model whose text part is a
Hugging Face Llama."""

import re
from contextlib import suppress
from dataclasses import dataclass

from fusion.hf.keys import HF_DERIVED_KEY, fusion_key_to_hf, hf_key_to_fusion


@dataclass(frozen=True)
class KeyLayout:
    """Where a model's parts sit in a Hugging Face checkpoint.

    ``read``: (pattern, prefix) pairs; a checkpoint key has its start, matched by the first
    pattern that matches, replaced by ``prefix``. ``write``: (our prefix, saved prefix) pairs,
    the layout the savers write. Keys below ``decoder`` are then a Hugging Face Llama's, renamed
    by :mod:`fusion.hf.keys`; those of a vision tower's ``embeddings.position_ids``
    (older checkpoints saved this function of the config) are skipped.
    """

    decoder: str = ""
    read: tuple[tuple[str, str], ...] = (("", ""),)
    write: tuple[tuple[str, str], ...] = ()

    def ours(self, name: str) -> str | None:
        """This library's key for checkpoint key ``name``; None for a derived buffer.

        Raises:
            KeyError: ``name`` belongs to no part.
        """
        for pattern, prefix in self.read:
            if match := re.match(pattern, name):
                key = prefix + name[match.end() :]
                break
        else:
            raise KeyError(name)
        if not key.startswith(self.decoder):
            return None if key.endswith(".embeddings.position_ids") else key
        llama_key = key.removeprefix(self.decoder)
        if HF_DERIVED_KEY.fullmatch(llama_key):
            return None
        return self.decoder + hf_key_to_fusion(llama_key)

    def saved(self, key: str) -> str:
        """The key the savers write for ``key``, whose decoder part is already Hugging Face's."""
        for ours, theirs in self.write:
            if key.startswith(ours):
                return theirs + key.removeprefix(ours)
        return key

    def theirs(self, key: str) -> str:
        """The key the savers write for this library's ``key`` (for errors)."""
        if key.startswith(self.decoder):
            with suppress(KeyError):  # a decoder key without a Hugging Face name stays ours
                key = self.decoder + fusion_key_to_hf(key.removeprefix(self.decoder))
        return self.saved(key)
