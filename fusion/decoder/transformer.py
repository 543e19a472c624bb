from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import torch
from torch import nn

from fusion._validation import (
    INDEX_DTYPES,
    check_in_range,
    check_token_ids,
    check_values,
    describe,
    host_reads_are_free,
    is_dtensor,
    is_int,
)
from fusion.decoder import masks
from fusion.decoder.attention import MultiHeadAttention
from fusion.decoder.few_rows import tied_projection
from fusion.decoder.gated_deltanet import DeltaNetState, GatedDeltaNet
from fusion.decoder.kv_cache import KVCache, SlidingWindowKVCache
from fusion.decoder.packed import PackedSegments
from fusion.decoder.packed_attention import prepare
from fusion.decoder.transformer_layer import TransformerSelfAttentionLayer


class TransformerDecoder(nn.Module):
    """A decoder-only transformer (Llama 3 layout) whose forward also takes ``input_embeds``.

    ``forward(input_embeds=...)`` skips ``tok_embeddings`` and nothing else, so an early-fusion
    model can feed merged embeddings without replacing any module or renaming any key.

    Args:
        tok_embeddings: token embedding, ids ``[b, s]`` -> ``[b, s, d]``; an ``nn.Embedding``
            here, and any module with that contract after construction (a LoRA or quantized
            wrapper, a sharded module): the decoder only ever calls it.
        layers: the decoder blocks.
        max_seq_len: longest sequence (and highest position + 1) the model accepts.
        norm: final norm.
        output: output projection ``[..., d] -> [..., vocab]``, called as a module; or None to
            tie it to ``tok_embeddings.weight`` (no key of its own, stays tied through
            ``load_state_dict``, ``to()`` and wrapping).
        output_hidden_states: layer indices whose *input* hidden states are returned before the
            logits (index ``len(layers)`` is the input of the final norm), as in torchtune.
        final_logit_softcap: logits ``c * tanh(logits / c)`` for this ``c`` (Gemma's
            ``final_logit_softcapping``); None: the output projection's as they are.

    Attention layers with a ``sliding_window`` (Gemma's sliding-attention layers) get the
    mask of the others with the window applied, in every form the mask takes (see
    :meth:`forward`).
    """

    #: M-RoPE decoders with a KV cache: per sample [b], what is added to 1-D positions (text:
    #: three equal rows) so that they continue after the sample's images, as Hugging Face's
    #: ``rope_deltas``. Set by whoever computed the 3-D positions of the prompt
    #: (``EarlyFusion``); zero after ``setup_caches`` and ``reset_caches``, None without caches.
    mrope_deltas: torch.Tensor | None

    #: Set by this library's own decoding steps (``fusion.generation``) for the duration of a
    #: call whose inputs it built and checked once for the whole generation: generated ids
    #: (an argmax over the vocabulary), positions and cache slots within the capacity it
    #: checked, a step mask that allows no slot after the fill level. The forward then skips
    #: the value checks that would read the host at every step (ids and positions in range,
    #: the cache's room) and cuts the step mask to the filled slots without looking. Shapes,
    #: dtypes and devices are still checked; every other caller gets every check.
    _inputs_checked_by_caller: bool = False

    def __init__(
        self,
        *,
        tok_embeddings: nn.Embedding,
        layers: Sequence[TransformerSelfAttentionLayer],
        max_seq_len: int,
        norm: nn.Module,
        output: nn.Linear | None = None,
        output_hidden_states: Sequence[int] | None = None,
        final_logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.tok_embeddings = tok_embeddings
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.output = output
        self.max_seq_len = max_seq_len
        self.final_logit_softcap = final_logit_softcap
        # Plain ints: wrapping or sharding the embedding later must not change them.
        self.vocab_size: int = tok_embeddings.num_embeddings
        self.embed_dim: int = tok_embeddings.embedding_dim
        self.output_hidden_states = list(output_hidden_states or [])  # checked by the setter
        #: Return the final hidden states [b, s, d] (after ``norm``) instead of logits, e.g. for
        #: chunked or fused losses that apply the output projection themselves.
        self.skip_output_layer = False
        #: When positive, logits come back as a list of this many chunks along the sequence
        #: (torchtune's ``set_num_output_chunks``, for chunked cross-entropy).
        self.num_output_chunks = 0
        self.register_buffer("mrope_deltas", None, persistent=False)
        if not self.attentions():
            raise ValueError(
                "layers: expected at least one attention layer (its rotary embeddings and KV "
                "cache are the decoder's positions and fill level), got none"
            )

    @property
    def output_hidden_states(self) -> list[int]:
        """Layer indices whose input hidden states are returned before the logits: each in
        ``[0, len(layers)]`` (``len(layers)``: the input of the final norm)."""
        return self._output_hidden_states

    @output_hidden_states.setter
    def output_hidden_states(self, value: Sequence[int]) -> None:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ValueError(
                f"output_hidden_states: expected a list of layer indices, got {value!r:.100}"
            )
        last = len(self.layers)
        bad = [i for i in value if not is_int(i, 0, last)]
        if bad:
            raise ValueError(
                f"output_hidden_states: expected layer indices in [0, {last}] (the decoder has "
                f"{last} layers; {last} is the final norm's input), got {bad[:5]}"
            )
        self._output_hidden_states = list(value)

    def set_num_output_chunks(self, num_output_chunks: int) -> None:
        """Return logits as ``num_output_chunks`` chunks along the sequence (0: one tensor)."""
        if (
            isinstance(num_output_chunks, bool)
            or not isinstance(num_output_chunks, int)
            or (num_output_chunks < 0)
        ):
            raise ValueError(
                f"num_output_chunks: expected a non-negative integer, got {num_output_chunks!r}"
            )
        self.num_output_chunks = num_output_chunks

    @property
    def multimodal_rope(self) -> bool:
        """Whether the rotary embeddings are M-RoPE, taking positions ``[3, b, s]``."""
        return self._first_attention().pos_embeddings.is_multimodal

    @property
    def device(self) -> torch.device:
        """Where the decoder computes: the device of its rotary table (a buffer, so it stays
        put when parameters are sharded or offloaded)."""
        return self._first_attention().pos_embeddings.cache.device

    @property
    def decoder_max_cache_seq_len(self) -> int | None:
        """Positions per sequence of the KV cache, None without one (as in torchtune)."""
        cache = self._first_attention().kv_cache
        return None if cache is None else cache.max_seq_len

    # ------------------------------------------------------------------ KV cache

    def setup_caches(
        self,
        batch_size: int,
        dtype: torch.dtype,
        *,
        encoder_max_seq_len: None = None,
        decoder_max_seq_len: int | None = None,
    ) -> None:
        """Allocate a KV cache in every layer, ``decoder_max_seq_len`` (default ``max_seq_len``)
        positions for each of ``batch_size`` sequences, and enable it.

        A layer with a ``sliding_window`` shorter than that keeps only its window: a ring of
        ``sliding_window`` slots (:class:`~fusion.decoder.kv_cache.SlidingWindowKVCache`),
        which takes as many positions and gives the same attention. Gemma 3 4B (29 of its 34
        layers sliding, window 1024, 4 KV heads of 256) in bfloat16 at 8192 positions: 276
        MiB per sequence instead of 1088 MiB.

        ``dtype`` is the cache's. It may differ from the decoder's (e.g. a bfloat16 cache for
        a float32 decoder, to halve its memory): keys and values are converted as they are
        written and the cache as it is read (a copy per step; the decoder's own dtype, or
        autocast to the cache's, costs none).

        ``encoder_max_seq_len`` exists for torchtune's callers; an early-fusion decoder has no
        cross-attention, so only None is accepted."""
        if encoder_max_seq_len is not None:
            raise ValueError(
                "encoder_max_seq_len: expected None (this decoder has no cross-attention), "
                f"got {encoder_max_seq_len!r}"
            )
        max_len = self.max_seq_len if decoder_max_seq_len is None else decoder_max_seq_len
        if not 0 < max_len <= self.max_seq_len:
            raise ValueError(
                f"decoder_max_seq_len: expected 1 to max_seq_len={self.max_seq_len}, got {max_len}"
            )
        if batch_size <= 0:
            raise ValueError(f"batch_size: expected a positive integer, got {batch_size}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
        for attn in self.attentions():
            attn.setup_cache(batch_size, max_len, dtype, self.device)
        for mixer in self.recurrent_mixers():
            mixer.setup_state(batch_size, dtype, self.device)
        if self.multimodal_rope:
            self.mrope_deltas = torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def caches_are_setup(self) -> bool:
        return self._first_attention().kv_cache is not None

    def caches_are_enabled(self) -> bool:
        return self.caches_are_setup() and self._first_attention().cache_enabled

    def reset_caches(self) -> None:
        """Empty the caches (keep them allocated)."""
        self._require_caches("reset_caches")
        for attn in self.attentions():
            cast(KVCache, attn.kv_cache).reset()
        for mixer in self.recurrent_mixers():
            cast(DeltaNetState, mixer.state).reset()
        if self.mrope_deltas is not None:
            self.mrope_deltas.zero_()

    def teardown_caches(self) -> None:
        """Free the caches: back to the state before :meth:`setup_caches`."""
        for attn in self.attentions():
            attn.kv_cache = None
            attn.cache_enabled = False
        for mixer in self.recurrent_mixers():
            mixer.state = None
            mixer.cache_enabled = False
        self.mrope_deltas = None

    @contextmanager
    def caches_disabled(self) -> Iterator[None]:
        """Run plain full-sequence forwards inside the block; the caches are left untouched."""
        self._require_caches("caches_disabled")
        stateful: list[MultiHeadAttention | GatedDeltaNet] = [
            *self.attentions(),
            *self.recurrent_mixers(),
        ]
        previous = [module.cache_enabled for module in stateful]
        for module in stateful:
            module.cache_enabled = False
        try:
            yield
        finally:
            for module, enabled in zip(stateful, previous, strict=True):
                module.cache_enabled = enabled

    def _require_caches(self, method: str) -> None:
        if not self.caches_are_setup():
            raise RuntimeError(f"{method}() needs KV caches: call setup_caches() first")

    def attentions(self) -> list[MultiHeadAttention]:
        """Each attention layer's attention module, typed (``nn.ModuleList`` items are plain
        modules): how code outside the decoder reaches head counts and KV caches. A hybrid
        stack's recurrent layers are :meth:`recurrent_mixers` instead."""
        return [mixer for mixer in self._mixers() if isinstance(mixer, MultiHeadAttention)]

    def recurrent_mixers(self) -> list[GatedDeltaNet]:
        """The token mixers of a hybrid stack's recurrent layers (Qwen3.5's Gated DeltaNet),
        which keep a state per sequence instead of a KV cache; empty for attention-only
        stacks."""
        return [mixer for mixer in self._mixers() if isinstance(mixer, GatedDeltaNet)]

    def _mixers(self) -> Iterator[nn.Module]:
        return (cast(TransformerSelfAttentionLayer, layer).attn for layer in self.layers)

    def _first_attention(self) -> MultiHeadAttention:
        """The first attention layer's attention (its cache's length and fill level are every
        layer's), without building the list of all of them: several calls per decoding
        step."""
        return next(m for m in self._mixers() if isinstance(m, MultiHeadAttention))

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | PackedSegments | None = None,
        input_pos: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,
        embed: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
        after_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        bidirectional: torch.Tensor | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Run the decoder.

        Args:
            tokens: integer ids [b, s]. Exactly one of ``tokens`` and ``input_embeds``.
            mask: boolean, True where a query may attend to a key. Without an enabled cache,
                [b, s, s] or [1, s, s] (None: causal). With one, [b, s, cache_len] or
                [1, s, cache_len] over cache slots (None: causal over the slots filled so far
                plus these). Or, without an enabled cache, the segments of packed rows
                (:class:`~fusion.decoder.packed.PackedSegments` of b rows of s positions, on
                the decoder's device, as ``fusion.data.collate_packed`` makes them): causal
                attention within each sample, with no [b, s, s] mask; its backend is resolved
                here once for the compute dtype (autocast's, else the embeddings') and shared
                by every layer (see :mod:`fusion.decoder.packed_attention`). A layer with a
                ``sliding_window`` gets each of these with the window applied: it attends to
                the ``sliding_window`` latest positions only (by index in the row or the
                cache, itself included), within its sample for packed rows.
            input_pos: positions [b, s], [1, s] or [s] for the rotary embeddings (packed
                samples, left-padded batches, decoding); [b] for a one-token step. None:
                ``0..s-1``, or the cache fill onward. M-RoPE decoders also take
                [3, b, s] or [3, 1, s] (temporal, height, width rows), used as given; 1-D
                positions are text there (three equal rows), to which an enabled cache adds
                ``mrope_deltas``.
            input_embeds: floating [b, s, d], used instead of ``tok_embeddings(tokens)``; passed
                to the first layer as given (under autocast, as the embedding's own output is).
            embed: how to embed ``tokens``: ``embed(tok_embeddings, tokens) -> [b, s, d]``
                instead of ``tok_embeddings(tokens)``, called inside this forward, so after any
                hook on the decoder (e.g. FSDP's unshard when the decoder is its own unit).
                For wrappers such as ``EarlyFusion``; ``tokens`` may then hold ids outside the
                vocabulary (``embed`` checks them).
            after_layer: ``after_layer(i, h) -> h``, called on each layer's output [b, s, d]
                before the next layer (Qwen3-VL's DeepStack rows are added to the first
                layers' outputs at the image placeholders this way); None: nothing between.
            bidirectional: integer block ids [b, s] (Gemma 3's images, from their
                placeholders: :class:`fusion.hooks.ImageBlocks`): the tokens of one block (the
                same id > 0) also attend to the later tokens of their block, in every mask
                form (for packed rows within their sample, per-sample SDPA only); 0: as the
                mask says. A sliding window bounds how far back a query reaches, not forward
                within its block, as transformers' Gemma 3 masks compose the two. With a
                cache, the keys of this call's slots are the blocks' (earlier slots: none).

        Returns:
            float32 logits [b, s, vocab_size] (hidden states [b, s, d] when
            ``skip_output_layer``; a list of chunks along s with ``set_num_output_chunks``),
            preceded by the requested ``output_hidden_states`` as a list.

        With an enabled cache, this call's keys and values go to the slots after the cache's
        fill level (a device tensor, advanced on the device): called step by step under
        ``torch.compile``, the decoder sees the same shapes and constants at every step, so
        it compiles once, and nothing in it synchronises with the host. There every call
        attends to the whole cache; eagerly on CPU, where reading the fill level is free,
        only to its filled slots (unless ``mask`` allows an empty one). A sliding-window
        layer's cache is a ring of its window
        (:class:`~fusion.decoder.kv_cache.SlidingWindowKVCache`); ``mask`` is given over
        positions all the same, and that layer gets it at the positions its ring holds.

        Raises:
            ValueError: bad shapes, dtypes, ids or positions, too long a sequence, or more
                tokens than the cache has free slots, packed segments of another shape or
                device, or with an enabled cache, before any computation (on accelerators
                and while compiling, out-of-range ids or positions and a full cache fail as a
                device-side assertion instead, to avoid a host synchronisation).
            RuntimeError: the cache's batch size differs from the input's.
        """
        batch_size, seq_len, device = self._validate_inputs(tokens, input_embeds, embed)
        if isinstance(mask, PackedSegments):
            self._validate_segments(mask, batch_size, seq_len)
        # The cache slots this call writes, as a device tensor: no host integer that changes
        # from call to call, so compiled decoding steps keep static shapes and constants.
        slots = self._cache_slots(batch_size, seq_len)
        kv_len = seq_len if slots is None else self._first_cache().max_seq_len
        if input_pos is None:
            input_pos = torch.arange(seq_len, device=device) if slots is None else slots
        else:
            self._validate_input_pos(input_pos, batch_size, seq_len)
        if slots is not None and self.mrope_deltas is not None and input_pos.dim() < 3:
            # Text after a cached prompt: continue from where its images left the positions.
            input_pos = input_pos.reshape(-1, seq_len) + self.mrope_deltas[:, None]
        mask = self._call_mask(mask, slots, (batch_size, seq_len, kv_len), device, bidirectional)
        h = self._embed(tokens, input_embeds, embed, batch_size, seq_len)
        layer_masks = self._layer_masks(mask, h, slots, seq_len)
        hidden = []
        for i, layer in enumerate(self.layers):
            if i in self.output_hidden_states:
                hidden.append(h)
            h = layer(h, mask=layer_masks[i], input_pos=input_pos)
            if after_layer is not None:
                h = after_layer(i, h)
        if len(self.layers) in self.output_hidden_states:
            hidden.append(h)
        h = self.norm(h)
        if self.skip_output_layer:
            out = h
        elif self.num_output_chunks:
            out = [self.unembed(chunk) for chunk in h.tensor_split(self.num_output_chunks, dim=1)]
        else:
            out = self.unembed(h)
        return [*hidden, out] if hidden else out

    def _call_mask(
        self,
        mask: torch.Tensor | PackedSegments | None,
        slots: torch.Tensor | None,
        sizes: tuple[int, int, int],
        device: torch.device,
        bidirectional: torch.Tensor | None,
    ) -> torch.Tensor | PackedSegments | None:
        """This call's mask, every head's: a given mask checked and made [b or 1, 1, s, kv_len]
        (packed segments as they are), causal over the cache's slots with a cache and none
        given, cut to the filled slots where reading the fill level is free, with the
        bidirectional blocks added (``sizes``: the batch size, the sequence length and the
        keys' length)."""
        batch_size, seq_len, kv_len = sizes
        if mask is not None and not isinstance(mask, PackedSegments):  # those: checked before
            self._validate_mask(mask, batch_size, seq_len, kv_len)
            mask = mask[:, None]  # [b or 1, 1, s, kv_len]: one mask for every head
        elif mask is None and slots is not None:
            mask = (torch.arange(kv_len, device=device) <= slots[:, None])[None, None]
        if slots is not None and host_reads_are_free(device):
            filled = self._first_cache().size + seq_len  # after this call's writes
            mask = cast(torch.Tensor, mask)
            # A decoding step's mask allows nothing after the fill level: cut it unseen.
            trusted = self._inputs_checked_by_caller and filled <= mask.size(-1)
            mask = mask[..., :filled] if trusted else masks.without_unfilled_slots(mask, filled)
        if bidirectional is not None:
            self._validate_blocks(bidirectional, batch_size, seq_len)
            mask = masks.with_blocks(mask, bidirectional, slots, seq_len)
        return mask

    def _embed(
        self,
        tokens: torch.Tensor | None,
        input_embeds: torch.Tensor | None,
        embed: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None,
        batch_size: int,
        seq_len: int,
    ) -> torch.Tensor:
        """The first layer's input [b, s, d]: ``input_embeds``, ``embed``'s (checked) or the
        token embedding's."""
        if input_embeds is not None:
            return input_embeds
        if embed is None:
            return self.tok_embeddings(tokens)
        h = embed(self.tok_embeddings, cast(torch.Tensor, tokens))  # checked: given
        if not isinstance(h, torch.Tensor) or h.shape != (batch_size, seq_len, self.embed_dim):
            got = describe(h) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ValueError(
                f"embed: expected [{batch_size}, {seq_len}, {self.embed_dim}], got {got}"
            )
        return h

    def _layer_masks(
        self,
        mask: torch.Tensor | PackedSegments | None,
        h: torch.Tensor,
        slots: torch.Tensor | None,
        seq_len: int,
    ) -> list[object]:
        """Each layer's mask, in its mixer's form: recurrent layers read the samples or the
        padding from the mask in their own form; attention layers their window's mask; a
        layer whose cache is a ring (a sliding window's) attends to its columns, which hold
        other positions than a full cache's slots, so its mask is its window's taken at those
        positions (every ring of one window holds the same ones: one mask per window)."""
        mixers = list(self._mixers())
        layout = None
        if any(isinstance(mixer, GatedDeltaNet) for mixer in mixers):
            layout = self.recurrent_mixers()[0].token_layout(mask, slots)
        windows = [getattr(mixer, "sliding_window", None) for mixer in mixers]
        window_masks: dict[int | None, object] = {
            window: self._layer_mask(mask, window, h, slots, seq_len) for window in set(windows)
        }
        ring_masks: dict[int | None, torch.Tensor] = {}
        per_layer: list[object] = []
        for mixer, window in zip(mixers, windows, strict=True):
            cache = getattr(mixer, "kv_cache", None)
            if isinstance(mixer, GatedDeltaNet):
                per_layer.append(layout)
            elif slots is not None and isinstance(cache, SlidingWindowKVCache):
                if window not in ring_masks:
                    over_positions = cast(torch.Tensor, window_masks[window])
                    ring_masks[window] = masks.at_positions(
                        over_positions, cache.key_slots(seq_len)
                    )
                per_layer.append(ring_masks[window])
            else:
                per_layer.append(window_masks[window])
        return per_layer

    def _layer_mask(
        self,
        mask: torch.Tensor | PackedSegments | None,
        window: int | None,
        h: torch.Tensor,
        slots: torch.Tensor | None,
        seq_len: int,
    ) -> torch.Tensor | PackedSegments | None:
        """The mask of the layers attending within ``window`` (None: to all), from the mask
        of this forward: packed segments with the window, resolved for the compute dtype; a
        boolean mask [b or 1, 1, s, kv_len] limited to keys less than ``window`` slots before
        each query (queries at ``slots`` with a cache, at ``0..s-1`` without); for None
        (causal, no cache), the causal band [1, 1, s, s], or None still when the sequence
        fits in the window. Made once per forward and window, on the device, no sync."""
        if isinstance(mask, PackedSegments):
            segments = mask if window is None else mask.with_window(window)
            return prepare(segments, self._compute_dtype(h), dropout=self._dropout())
        return masks.within_window(mask, window, slots, seq_len, h.device)

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """Output projection of normed hidden states [b, s, d] -> float32 logits [b, s, vocab].

        An untied output is called as a module, so its hooks (sharding, adapters) run; the
        builders make it a :class:`~fusion.decoder.FewRowsLinear`, whose forward takes a
        faster product on a decoding step's few rows on the CPU. A tied one reads
        ``tok_embeddings.weight``, which must then be a whole tensor here (a decoding step's
        few rows on the CPU take the same product:
        :func:`~fusion.decoder.few_rows.tied_projection`).
        With ``final_logit_softcap``, the logits are then soft-capped (in float32).

        Raises:
            RuntimeError: tied output whose embedding has no ``weight``, or whose weight is
                sharded (a DTensor) outside the embedding's own forward, e.g. when
                ``tok_embeddings`` is its own FSDP unit.
        """
        logits = self._project(h)
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            logits = self.output(h)
            return logits if logits.dtype == torch.float32 else logits.float()
        weight = getattr(self.tok_embeddings, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise RuntimeError(
                f"tied output: tok_embeddings ({type(self.tok_embeddings).__name__}) has no "
                "weight tensor to project with; give the wrapper a `weight` or untie the output"
            )
        if is_dtensor(weight):
            raise RuntimeError(
                "tied output: tok_embeddings.weight is sharded (a DTensor) outside the "
                "embedding's forward, so the output projection cannot use it. Keep "
                "tok_embeddings in the root FSDP unit (do not fully_shard it on its own) and do "
                "not tensor-parallelise it, or untie the output (tie_word_embeddings=False)"
            )
        logits = tied_projection(h, weight)
        return logits if logits.dtype == torch.float32 else logits.float()

    # ------------------------------------------------------------------ validation

    def _validate_inputs(
        self,
        tokens: torch.Tensor | None,
        input_embeds: torch.Tensor | None,
        embed: Callable | None,
    ) -> tuple[int, int, torch.device]:
        if (tokens is None) == (input_embeds is None):
            given = "both" if tokens is not None else "neither"
            raise ValueError(f"tokens, input_embeds: expected exactly one of them, got {given}")
        if embed is not None and (tokens is None or not callable(embed)):
            raise ValueError(
                "embed: expected a callable, with tokens (it embeds them), got "
                f"{type(embed).__name__} with {'input_embeds' if tokens is None else 'tokens'}"
            )
        if tokens is not None:
            check_token_ids(tokens)
            name, (batch_size, seq_len), device = "tokens", tokens.shape, tokens.device
        else:
            if not isinstance(input_embeds, torch.Tensor):
                raise TypeError(
                    f"input_embeds: expected a tensor, got {type(input_embeds).__name__}"
                )
            if (
                input_embeds.dim() != 3
                or input_embeds.size(-1) != self.embed_dim
                or not input_embeds.is_floating_point()
            ):
                raise ValueError(
                    f"input_embeds: expected floating [b, s, {self.embed_dim}], "
                    f"got {describe(input_embeds)}"
                )
            name, device = "input_embeds", input_embeds.device
            batch_size, seq_len = input_embeds.shape[:2]
        if device != self.device:
            raise ValueError(f"{name}: expected device {self.device} (the decoder's), got {device}")
        if batch_size == 0 or seq_len == 0:
            raise ValueError(
                f"{name}: expected a non-empty batch and sequence, got [{batch_size}, {seq_len}]"
            )
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"{name}: sequence length {seq_len} exceeds max_seq_len={self.max_seq_len}"
            )
        if tokens is not None and embed is None and not self._inputs_checked_by_caller:
            check_in_range(tokens, "tokens", 0, self.vocab_size)
        return batch_size, seq_len, device

    def _cache_slots(self, batch_size: int, seq_len: int) -> torch.Tensor | None:
        """The cache slots [s] this call fills (from the fill level on), checked to fit; None
        without an enabled cache.

        The fit is checked eagerly on the CPU (nothing is written when it fails); on
        accelerators and while compiling, as a device-side assertion, without a host
        synchronisation."""
        if not self.caches_are_enabled():
            return None
        cache = self._first_cache()
        if batch_size != cache.batch_size:
            raise RuntimeError(
                f"tokens: the KV cache was set up for batch size {cache.batch_size}, got a batch "
                f"of {batch_size}; call setup_caches() again"
            )
        if self._inputs_checked_by_caller:  # the caller has checked the room once
            return cache.fill + torch.arange(seq_len, device=cache.fill.device)
        check_values(
            cache.fill <= cache.max_seq_len - seq_len,
            f"tokens: {seq_len} more positions do not fit in the KV cache of "
            f"{cache.max_seq_len}; call reset_caches() or set up a larger cache",
            eager=host_reads_are_free(cache.fill.device),
            details=lambda: f" (it holds {cache.size})",
        )
        return cache.fill + torch.arange(seq_len, device=cache.fill.device)

    def kv_caches(self) -> list[KVCache]:
        """Each layer's KV cache; all share the length (``max_seq_len``, the positions they
        take) and the fill level; a sliding-window layer's holds only its window's slots.

        Raises:
            RuntimeError: no caches are set up.
        """
        self._require_caches("kv_caches")
        return [cast(KVCache, attn.kv_cache) for attn in self.attentions()]

    def _first_cache(self) -> KVCache:
        return cast(KVCache, self._first_attention().kv_cache)

    def _validate_input_pos(self, input_pos: torch.Tensor, batch_size: int, seq_len: int) -> None:
        # torchtune's decode step passes one position per sample: [b] for s == 1.
        decode_step = [(batch_size,)] if seq_len == 1 else []
        three_rows = [(3, batch_size, seq_len), (3, 1, seq_len)] if self.multimodal_rope else []
        shapes = list(
            dict.fromkeys(
                [(batch_size, seq_len), (1, seq_len), (seq_len,), *decode_step, *three_rows]
            )
        )
        if (
            not isinstance(input_pos, torch.Tensor)
            or tuple(input_pos.shape) not in shapes
            or input_pos.dtype not in INDEX_DTYPES
        ):
            accepted = " or ".join(str(list(s)) for s in shapes)
            got = describe(input_pos) if isinstance(input_pos, torch.Tensor) else type(input_pos)
            raise ValueError(f"input_pos: expected int64 or int32 positions {accepted}, got {got}")
        if input_pos.device != self.device:
            raise ValueError(f"input_pos: expected device {self.device}, got {input_pos.device}")
        if not self._inputs_checked_by_caller:
            check_in_range(input_pos, "input_pos", 0, self.max_seq_len)

    def _validate_segments(self, segments: PackedSegments, batch_size: int, seq_len: int) -> None:
        """Packed segments for this call: b rows of s positions on the decoder's device, and
        no enabled cache (they describe whole packed rows, not steps over cache slots)."""
        if self.caches_are_enabled():
            raise ValueError(
                "mask: packed segments are for forwards without a KV cache, and the cache is "
                "enabled; run under caches_disabled(), or give a boolean mask over the cache "
                "slots"
            )
        if (segments.batch_size, segments.seq_len) != (batch_size, seq_len):
            raise ValueError(
                f"mask: expected packed segments of {batch_size} rows of {seq_len} positions, "
                f"got {segments.batch_size} rows of {segments.seq_len}"
            )
        if segments.device != self.device:
            raise ValueError(f"mask: expected device {self.device}, got {segments.device}")

    def _validate_blocks(self, blocks: torch.Tensor, batch_size: int, seq_len: int) -> None:
        if (
            not isinstance(blocks, torch.Tensor)
            or blocks.shape != (batch_size, seq_len)
            or blocks.dtype not in INDEX_DTYPES
        ):
            got = describe(blocks) if isinstance(blocks, torch.Tensor) else type(blocks)
            raise ValueError(
                f"bidirectional: expected int64 or int32 block ids [{batch_size}, {seq_len}], "
                f"got {got}"
            )
        if blocks.device != self.device:
            raise ValueError(f"bidirectional: expected device {self.device}, got {blocks.device}")
        if self.recurrent_mixers():
            raise ValueError(
                "bidirectional: this decoder's recurrent layers read tokens in order only; "
                "blocks attending both ways need an attention-only stack"
            )

    def _compute_dtype(self, h: torch.Tensor) -> torch.dtype:
        """The dtype the layers compute attention in: autocast's on ``h``'s device, else
        ``h``'s."""
        kind = h.device.type
        if kind == "meta":  # autocast knows no meta device (shapes only: h's dtype)
            return h.dtype
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype

    def _dropout(self) -> bool:
        return self.training and any(attn.attn_dropout > 0 for attn in self.attentions())

    def _validate_mask(
        self, mask: torch.Tensor, batch_size: int, seq_len: int, kv_len: int
    ) -> None:
        shapes = ((batch_size, seq_len, kv_len), (1, seq_len, kv_len))
        if (
            not isinstance(mask, torch.Tensor)
            or tuple(mask.shape) not in shapes
            or mask.dtype != torch.bool
        ):
            got = describe(mask) if isinstance(mask, torch.Tensor) else type(mask)
            raise ValueError(
                f"mask: expected a boolean mask [{batch_size}, {seq_len}, {kv_len}] or "
                f"[1, {seq_len}, {kv_len}], got {got}"
            )
        if mask.device != self.device:
            raise ValueError(f"mask: expected device {self.device}, got {mask.device}")
