from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from fusion._validation import check_in_range, check_token_ids, describe
from fusion.decoder.rms_norm import RMSNorm
from fusion.decoder.transformer_layer import TransformerSelfAttentionLayer


class TransformerDecoder(nn.Module):
    """A decoder-only transformer (Llama 3 layout) whose forward also takes ``input_embeds``.

    ``forward(input_embeds=...)`` skips ``tok_embeddings`` and nothing else, so an early-fusion
    model can feed merged embeddings without replacing any module or renaming any key.

    Args:
        tok_embeddings: token embedding table, ``[vocab_size, d]``.
        layers: the decoder blocks.
        max_seq_len: longest sequence (and highest position + 1) the model accepts.
        norm: final norm.
        output: output projection, or None to tie it to ``tok_embeddings`` (no key of its own,
            stays tied through ``load_state_dict``, ``to()`` and wrapping).
        output_hidden_states: layer indices whose *input* hidden states are returned before the
            logits (index ``len(layers)`` is the input of the final norm), as in torchtune.
    """

    def __init__(
        self,
        *,
        tok_embeddings: nn.Embedding,
        layers: Sequence[TransformerSelfAttentionLayer],
        max_seq_len: int,
        norm: RMSNorm,
        output: nn.Linear | None = None,
        output_hidden_states: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.tok_embeddings = tok_embeddings
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.output = output
        self.max_seq_len = max_seq_len
        self.output_hidden_states = list(output_hidden_states or [])
        #: Return the final hidden states [b, s, d] (after ``norm``) instead of logits, e.g. for
        #: chunked or fused losses that apply the output projection themselves.
        self.skip_output_layer = False

    @property
    def vocab_size(self) -> int:
        return self.tok_embeddings.num_embeddings

    @property
    def embed_dim(self) -> int:
        return self.tok_embeddings.embedding_dim

    # ------------------------------------------------------------------ KV cache

    def setup_caches(
        self, batch_size: int, dtype: torch.dtype, *, decoder_max_seq_len: int | None = None
    ) -> None:
        """Allocate a KV cache in every layer, ``decoder_max_seq_len`` (default ``max_seq_len``)
        positions for each of ``batch_size`` sequences, and enable it."""
        max_len = self.max_seq_len if decoder_max_seq_len is None else decoder_max_seq_len
        if not 0 < max_len <= self.max_seq_len:
            raise ValueError(
                f"decoder_max_seq_len: expected 1 to max_seq_len={self.max_seq_len}, got {max_len}"
            )
        if batch_size <= 0:
            raise ValueError(f"batch_size: expected a positive integer, got {batch_size}")
        device = self.tok_embeddings.weight.device
        for layer in self.layers:
            layer.attn.setup_cache(batch_size, max_len, dtype, device)

    def caches_are_setup(self) -> bool:
        return self.layers[0].attn.kv_cache is not None

    def caches_are_enabled(self) -> bool:
        return self.caches_are_setup() and self.layers[0].attn.cache_enabled

    def reset_caches(self) -> None:
        """Empty the caches (keep them allocated)."""
        self._require_caches("reset_caches")
        for layer in self.layers:
            layer.attn.kv_cache.reset()

    def teardown_caches(self) -> None:
        """Free the caches: back to the state before :meth:`setup_caches`."""
        for layer in self.layers:
            layer.attn.kv_cache = None
            layer.attn.cache_enabled = False

    @contextmanager
    def caches_disabled(self) -> Iterator[None]:
        """Run plain full-sequence forwards inside the block; the caches are left untouched."""
        self._require_caches("caches_disabled")
        previous = [layer.attn.cache_enabled for layer in self.layers]
        for layer in self.layers:
            layer.attn.cache_enabled = False
        try:
            yield
        finally:
            for layer, enabled in zip(self.layers, previous, strict=True):
                layer.attn.cache_enabled = enabled

    def _require_caches(self, method: str) -> None:
        if not self.caches_are_setup():
            raise RuntimeError(f"{method}() needs KV caches: call setup_caches() first")

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Run the decoder.

        Args:
            tokens: integer ids [b, s]. Exactly one of ``tokens`` and ``input_embeds``.
            mask: boolean, True where a query may attend to a key. Without an enabled cache,
                [b, s, s] (None: causal). With one, [b, s, cache_len] over cache slots (None:
                causal over the slots filled so far plus these).
            input_pos: positions [b, s] or [s] for the rotary embeddings (packed samples,
                left-padded batches, decoding). None: ``0..s-1``, or the cache fill onward.
            input_embeds: [b, s, d] in the embedding table's dtype; used instead of
                ``tok_embeddings(tokens)``.

        Returns:
            float32 logits [b, s, vocab_size] (hidden states [b, s, d] when
            ``skip_output_layer``), preceded by the requested ``output_hidden_states`` as a list.

        Raises:
            ValueError: bad shapes, dtypes, ids or positions, or too long a sequence, before
                any computation (on accelerators, out-of-range ids or positions fail as a
                device-side assertion instead, to avoid a host synchronisation).
            RuntimeError: the cache's batch size differs from the input's.
        """
        batch_size, seq_len = self._validate_inputs(tokens, input_embeds)
        cache_fill = self._cache_fill(batch_size, seq_len)
        kv_len = seq_len if cache_fill is None else self.layers[0].attn.kv_cache.max_seq_len
        device = self.tok_embeddings.weight.device
        if input_pos is None:
            start = cache_fill or 0
            input_pos = torch.arange(start, start + seq_len, device=device)
        else:
            self._validate_input_pos(input_pos, batch_size, seq_len)
        if mask is not None:
            self._validate_mask(mask, batch_size, seq_len, kv_len)
            mask = mask[:, None]
        elif cache_fill is not None:
            query_slots = torch.arange(cache_fill, cache_fill + seq_len, device=device)
            mask = (torch.arange(kv_len, device=device) <= query_slots[:, None])[None, None]

        h = self.tok_embeddings(tokens) if input_embeds is None else input_embeds
        hidden = []
        for i, layer in enumerate(self.layers):
            if i in self.output_hidden_states:
                hidden.append(h)
            h = layer(h, mask=mask, input_pos=input_pos)
        if len(self.layers) in self.output_hidden_states:
            hidden.append(h)
        h = self.norm(h)
        out = h if self.skip_output_layer else self.unembed(h)
        return [*hidden, out] if hidden else out

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """Output projection of normed hidden states [b, s, d] -> float32 logits [b, s, vocab]."""
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h, weight).float()

    # ------------------------------------------------------------------ validation

    def _validate_inputs(
        self, tokens: torch.Tensor | None, input_embeds: torch.Tensor | None
    ) -> tuple[int, int]:
        if (tokens is None) == (input_embeds is None):
            given = "both" if tokens is not None else "neither"
            raise ValueError(f"tokens, input_embeds: expected exactly one of them, got {given}")
        if tokens is not None:
            check_token_ids(tokens)
            batch_size, seq_len = tokens.shape
        else:
            weight = self.tok_embeddings.weight
            if input_embeds.dim() != 3 or input_embeds.size(-1) != self.embed_dim:
                raise ValueError(
                    f"input_embeds: expected [b, s, {self.embed_dim}], got {describe(input_embeds)}"
                )
            if input_embeds.dtype != weight.dtype:
                raise ValueError(
                    f"input_embeds: expected dtype {weight.dtype} (the embedding table's), "
                    f"got {input_embeds.dtype}"
                )
            batch_size, seq_len = input_embeds.shape[:2]
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"{'tokens' if tokens is not None else 'input_embeds'}: sequence length {seq_len} "
                f"exceeds max_seq_len={self.max_seq_len}"
            )
        if tokens is not None:
            check_in_range(tokens, "tokens", 0, self.vocab_size)
        return batch_size, seq_len

    def _cache_fill(self, batch_size: int, seq_len: int) -> int | None:
        """Slots already filled in an enabled cache (checked to fit ``seq_len`` more), else None."""
        if not self.caches_are_enabled():
            return None
        cache = self.layers[0].attn.kv_cache
        if batch_size != cache.batch_size:
            raise RuntimeError(
                f"tokens: the KV cache was set up for batch size {cache.batch_size}, got a batch "
                f"of {batch_size}; call setup_caches() again"
            )
        if cache.size + seq_len > cache.max_seq_len:
            raise ValueError(
                f"tokens: the KV cache holds {cache.size} of {cache.max_seq_len} positions, so "
                f"{seq_len} more do not fit; call reset_caches() or set up a larger cache"
            )
        return cache.size

    def _validate_input_pos(self, input_pos: torch.Tensor, batch_size: int, seq_len: int) -> None:
        if input_pos.shape not in ((batch_size, seq_len), (seq_len,)) or (
            input_pos.dtype.is_floating_point
        ):
            raise ValueError(
                f"input_pos: expected integer positions [{batch_size}, {seq_len}] or "
                f"[{seq_len}], got {describe(input_pos)}"
            )
        check_in_range(input_pos, "input_pos", 0, self.max_seq_len)

    @staticmethod
    def _validate_mask(mask: torch.Tensor, batch_size: int, seq_len: int, kv_len: int) -> None:
        if mask.shape != (batch_size, seq_len, kv_len) or mask.dtype != torch.bool:
            raise ValueError(
                f"mask: expected a boolean mask [{batch_size}, {seq_len}, {kv_len}], "
                f"got {describe(mask)}"
            )
