"""Where a model's parts sit in a Hugging Face checkpoint (:class:`KeyLayout`): the table that
turns a checkpoint's keys into this library's and back, for any model whose text part is a
Hugging Face Llama."""

import re
from contextlib import suppress
from dataclasses import dataclass

from fusion.hf.keys import HF_DERIVED_KEY, Renamed, fusion_key_to_hf, hf_key_to_fusion


@dataclass(frozen=True)
class KeyLayout:
    """Where a model's parts sit in a Hugging Face checkpoint.

    ``read``: (pattern, prefix) pairs; a checkpoint key has its start, matched by the first
    pattern that matches, replaced by ``prefix``. ``write``: (our prefix, saved prefix) pairs,
    the layout the savers write. Keys below ``decoder`` are then a Hugging Face Llama's, renamed
    by :mod:`fusion.hf.keys`; those of a vision tower's ``embeddings.position_ids``
    (older checkpoints saved this function of the config) are skipped, as are checkpoint keys
    matching ``ignored`` (weights of heads the model does not have, e.g. Qwen3.5's
    multi-token prediction ``mtp.*``). ``permute_rope``: the decoder rotates queries and keys
    in Meta's interleaved pairs, so their rows are permuted to and from Hugging Face's
    rotate-half layout; False for decoders that rotate in Hugging Face's layout. ``renamed``:
    the decoder's layer tensors that the family names otherwise than a Llama
    (:data:`fusion.hf.keys.Renamed`: Gemma's four norms per layer).
    """

    decoder: str = ""
    read: tuple[tuple[str, str], ...] = (("", ""),)
    write: tuple[tuple[str, str], ...] = ()
    ignored: str | None = None
    permute_rope: bool = True
    renamed: Renamed = ()

    def is_ignored(self, name: str) -> bool:
        """Whether checkpoint key ``name`` is a weight this model has no place for, by design."""
        return self.ignored is not None and re.match(self.ignored, name) is not None

    def ours(self, name: str) -> str | None:
        """This library's key for checkpoint key ``name``; None for a derived buffer.

        Raises:
            KeyError: ``name`` belongs to no part.
        """
        if self.is_ignored(name):
            return None
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
        return self.decoder + hf_key_to_fusion(llama_key, self.renamed)

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
                key = self.decoder + fusion_key_to_hf(key.removeprefix(self.decoder), self.renamed)
        return self.saved(key)
