"""KV-cached autoregressive generation for ``TransformerDecoder`` and ``EarlyFusion`` alike."""

import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion
from fusion.generation._checks import (
    INTEGER_DTYPES,
    as_id,
    as_positive_int,
    same_device,
    show,
)
from fusion.generation.padding import (
    leading_pad_counts,
    prefill_mask,
    prompt_positions,
    step_mask,
)
from fusion.generation.sampling import check_generator, sample_next_token, sampling_args


def generate(
    model: TransformerDecoder | EarlyFusion,
    tokens: torch.Tensor,
    *,
    encoder_input: Mapping[str, Any] | None = None,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Iterable[int] = (),
    pad_id: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` tokens after each prompt of ``tokens``.

    The prompts run once through the model (the prefill, the only time encoders run), filling
    the KV cache; then each step feeds one token per sample. See :func:`generate_stream` for the
    arguments, the cache handling and the errors.

    Returns:
        [b, s + n] int64: the prompts (padding kept) followed by ``n <= max_new_tokens`` new
        tokens; ``n`` is smaller only when every sample has emitted a stop token. After its stop
        token, a sample's slots hold ``pad_id``.
    """
    steps = list(
        generate_stream(
            model,
            tokens,
            encoder_input=encoder_input,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_tokens=stop_tokens,
            pad_id=pad_id,
            generator=generator,
        )
    )
    return torch.cat([tokens.long(), torch.stack(steps, dim=1)], dim=1)


def generate_stream(
    model: TransformerDecoder | EarlyFusion,
    tokens: torch.Tensor,
    *,
    encoder_input: Mapping[str, Any] | None = None,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Iterable[int] = (),
    pad_id: int = 0,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Like :func:`generate`, but yield each step's new tokens [b] (int64) as they come.

    All arguments are checked when this is called; the model runs as the iterator advances.

    Args:
        model: a decoder, or an ``EarlyFusion`` (whose decoding steps bypass the merge: a
            generated id is always embedded as text).
        tokens: prompts [b, s], integer ids, on the model's device, left-padded with
            ``pad_id``: a sample's leading ``pad_id`` tokens are padding (see
            :func:`fusion.generation.left_pad`), so no prompt may begin with ``pad_id``.
            Each sample gets rotary positions from 0 at its first real token.
        encoder_input: for ``EarlyFusion`` only, as in ``EarlyFusion.forward``; used at prefill.
        max_new_tokens: >= 1.
        temperature, top_k, top_p: see :func:`fusion.generation.sample_next_token`;
            ``temperature=0`` is greedy.
        stop_tokens: ids that end a sample (the stop token is kept). Checking whether all
            samples have stopped synchronises with the host once per step; without stop tokens
            nothing does.
        pad_id: the padding id, inside the vocabulary and not a placeholder id.
        generator: randomness for sampling, on the model's device.

    The KV cache: if the model has none, one of exactly ``s + max_new_tokens - 1`` slots is set
    up for this call and removed when the iterator ends: exhausted, closed, garbage-collected
    or stopped by an error. If the model has caches set up (for the same batch size and the
    model's dtype), they are reset and used, and left set up. A model has one cache, so it
    runs one stream at a time: from its first ``next()`` until it ends, the stream holds the
    model, and another ``generate``/``generate_stream`` on it (or on an ``EarlyFusion`` sharing
    its decoder) raises ``RuntimeError`` before doing anything. Gradients are off while the
    model runs; the model's train/eval mode is left as it is (call ``model.eval()`` first, or
    dropout applies). A ``torch.compile`` wrapper of a model is called as it is.

    Ids (``tokens``, ``stop_tokens``, ``pad_id``) may be of any integer dtype or type (Python,
    NumPy, 0-dim tensors); numbers may be Python or NumPy scalars. Bools and floats are never
    taken for integers.

    Raises:
        TypeError: ``model`` is neither a ``TransformerDecoder`` nor an ``EarlyFusion``.
        RuntimeError: another stream on this model is in progress.
        ValueError: ``tokens`` not non-empty integer [b, s] on the model's device, or (on the
            CPU) holding ids outside the vocabulary that are not placeholders of encoders given
            input; a sample that is all padding; the prompt plus ``max_new_tokens`` longer than
            the cache (or the decoder's ``max_seq_len``); ``max_new_tokens`` not an integer
            >= 1; ``temperature``, ``top_k``, ``top_p`` invalid (see
            :func:`fusion.generation.check_sampling_args`); stop tokens or ``pad_id`` not ids
            of the vocabulary; ``pad_id`` a placeholder id; ``generator`` not a generator on
            the model's device; ``encoder_input`` not a mapping, given to a model without
            encoders, or with unknown encoder names; a model on the meta device; caches set
            up for another batch size or dtype, or disabled.
    """
    model, decoder = _unwrap(model)
    _refuse_if_busy(decoder)
    _check_model(decoder)
    max_new_tokens = as_positive_int(max_new_tokens, "max_new_tokens")
    vocab = decoder.vocab_size
    pad_id = as_id(pad_id, "pad_id", vocab)
    stop_tokens = _checked_stop_tokens(stop_tokens, vocab)
    if isinstance(model.inner, EarlyFusion) and pad_id in model.inner.encoder_tokens.values():
        raise ValueError(
            f"pad_id: {pad_id} is a placeholder id of the encoders {model.inner.encoder_tokens}"
        )
    temperature, top_k, top_p = sampling_args(temperature, top_k, top_p, vocab)
    tokens = _checked_tokens(model, decoder, tokens, encoder_input)
    check_generator(generator, tokens.device)
    needed = tokens.size(1) + max_new_tokens - 1  # the last new token is never fed back
    _check_caches(decoder, tokens.size(0), tokens.size(1), max_new_tokens)
    pad_counts = leading_pad_counts(tokens, pad_id)
    _check_not_all_padding(pad_counts, tokens.size(1), pad_id)
    return _run(
        model,
        decoder,
        tokens,
        pad_counts,
        encoder_input=encoder_input,
        max_new_tokens=max_new_tokens,
        needed=needed,
        sampling={"temperature": temperature, "top_k": top_k, "top_p": top_p},
        stop_tokens=stop_tokens,
        pad_id=pad_id,
        generator=generator,
    )


class _Model(NamedTuple):
    """What generation calls (``call``: a ``torch.compile`` wrapper stays one) and the module it
    wraps (``inner``), whose attributes are read and set."""

    call: nn.Module
    inner: TransformerDecoder | EarlyFusion


# Decoders with a live stream: their KV caches are in use. One cache per decoder, so at most
# one stream per decoder (an ``EarlyFusion`` counts as its decoder). Weak: a model that is
# garbage-collected leaves the set by itself.
_LIVE: "weakref.WeakSet[TransformerDecoder]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


_BUSY = (
    "model: another generation on this model is in progress (a generate_stream iterator "
    "that is neither exhausted nor closed): both would use its one KV cache; finish or "
    "close() that iterator first, or use another model instance"
)


def _refuse_if_busy(decoder: TransformerDecoder) -> None:
    with _LIVE_LOCK:
        if decoder in _LIVE:
            raise RuntimeError(_BUSY)


def _claim(decoder: TransformerDecoder) -> None:
    with _LIVE_LOCK:
        if decoder in _LIVE:
            raise RuntimeError(_BUSY)
        _LIVE.add(decoder)


def _release(decoder: TransformerDecoder) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(decoder)


def _run(
    model: _Model,
    decoder: TransformerDecoder,
    tokens: torch.Tensor,
    pad_counts: torch.Tensor,
    *,
    encoder_input: Mapping[str, Any] | None,
    max_new_tokens: int,
    needed: int,
    sampling: dict[str, Any],
    stop_tokens: tuple[int, ...],
    pad_id: int,
    generator: torch.Generator | None,
) -> Iterator[torch.Tensor]:
    batch_size, seq_len = tokens.shape
    # Claimed when the stream starts (its first next()), not when it is created: a generator
    # that never starts never runs its finally block, so it could never give the model back.
    _claim(decoder)
    created = False
    try:
        if decoder.caches_are_setup():
            # Checked again: the caches may have changed since generate_stream() was called.
            _check_caches(decoder, batch_size, seq_len, max_new_tokens)
            decoder.reset_caches()
        else:
            created = True  # before setup: a setup that fails half-way is torn down too
            decoder.setup_caches(batch_size, _weights(decoder).dtype, decoder_max_seq_len=needed)
        cache_len = decoder.layers[0].attn.kv_cache.max_seq_len
        extra = {} if encoder_input is None else {"encoder_input": encoder_input}
        logits = _last_logits(
            model,
            tokens,
            mask=prefill_mask(pad_counts, seq_len, cache_len),
            input_pos=prompt_positions(pad_counts, seq_len),
            **extra,
        )
        # Decoding steps feed generated ids, always text: an EarlyFusion's merge is bypassed.
        step_model = (
            model if isinstance(model.inner, TransformerDecoder) else _Model(decoder, decoder)
        )
        done = torch.zeros(batch_size, dtype=torch.bool, device=tokens.device)
        stop = torch.tensor(stop_tokens, dtype=torch.long, device=tokens.device)
        for step in range(max_new_tokens):
            token = sample_next_token(logits, generator=generator, **sampling)
            token = token.masked_fill(done, pad_id)
            done = done | torch.isin(token, stop)
            yield token
            if step == max_new_tokens - 1 or (stop_tokens and bool(done.all())):
                return
            slot = seq_len + step  # where this token goes in the cache
            logits = _last_logits(
                step_model,
                token[:, None],
                mask=step_mask(pad_counts, slot, cache_len),
                input_pos=(slot - pad_counts)[:, None],
            )
    finally:  # also on close(), garbage collection and errors: nothing of ours stays behind
        try:
            if created:
                decoder.teardown_caches()
        finally:
            _release(decoder)


def _last_logits(model: _Model, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """float32 logits [b, vocab] of the last position only: the output projection of the other
    positions (a [b, s, vocab] tensor at prefill) is never computed."""
    inner = model.inner
    saved = inner.skip_output_layer, inner.output_hidden_states
    inner.skip_output_layer, inner.output_hidden_states = True, []
    try:
        with torch.no_grad():
            hidden = model.call(tokens, **kwargs)
            return inner.unembed(hidden[:, -1])
    finally:
        inner.skip_output_layer, inner.output_hidden_states = saved


def _unwrap(model: Any) -> tuple[_Model, TransformerDecoder]:
    """The model to call, the module it is, and its decoder; a ``torch.compile`` wrapper
    (``OptimizedModule``) is looked through but still called."""
    inner = model
    # No instance can exist unless torch._dynamo was imported: do not import it here.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled = getattr(eval_frame, "OptimizedModule", None)
    if compiled is not None and isinstance(model, compiled):
        inner = model._orig_mod
    if isinstance(inner, EarlyFusion):
        return _Model(model, inner), inner.decoder
    if isinstance(inner, TransformerDecoder):
        return _Model(model, inner), inner
    raise TypeError(
        f"model: expected a TransformerDecoder or an EarlyFusion (or one wrapped by "
        f"torch.compile), got {type(model).__name__}"
    )


def _weights(decoder: TransformerDecoder) -> torch.Tensor:
    """A tensor with the decoder's device and compute dtype: the embedding table (caches are
    set up in its dtype), or a wrapper's first parameter."""
    weight = getattr(decoder.tok_embeddings, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else next(decoder.parameters())


def _check_model(decoder: TransformerDecoder) -> None:
    if _weights(decoder).device.type == "meta":
        raise ValueError(
            "model: its weights are on the meta device (no data); load or materialise them first"
        )


def _checked_tokens(
    model: _Model,
    decoder: TransformerDecoder,
    tokens: Any,
    encoder_input: Mapping[str, Any] | None,
) -> torch.Tensor:
    """``tokens`` as int64 after the checks (any integer dtype is accepted: ids are widened,
    never narrowed); ``encoder_input`` is checked along, since it decides the valid ids."""
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dim() != 2
        or tokens.dtype not in INTEGER_DTYPES
        or tokens.numel() == 0
    ):
        given = (
            f"shape {list(tokens.shape)}, dtype {tokens.dtype}"
            if isinstance(tokens, torch.Tensor)
            else type(tokens).__name__
        )
        raise ValueError(f"tokens: expected non-empty integer ids [b, s], got {given}")
    device = _weights(decoder).device
    if not same_device(tokens.device, device):
        raise ValueError(
            f"tokens: expected them on the model's device {device}, got {tokens.device}"
        )
    inner = model.inner
    placeholders: dict[str, int] = {}
    if isinstance(inner, EarlyFusion):
        if encoder_input is not None and not isinstance(encoder_input, Mapping):
            raise ValueError(
                "encoder_input: expected a mapping of encoder names to their input, got "
                f"{type(encoder_input).__name__}"
            )
        unknown = sorted(set(encoder_input or {}) - set(inner.encoders), key=str)
        if unknown:
            raise ValueError(
                f"encoder_input: unknown encoder names {unknown}, expected some of "
                f"{sorted(inner.encoders)}"
            )
        placeholders = inner.encoder_tokens
    elif encoder_input is not None:
        given = sorted(encoder_input, key=str) if isinstance(encoder_input, Mapping) else "?"
        raise ValueError(
            "encoder_input: this model is a plain TransformerDecoder without encoders; "
            f"got input for {given}"
        )
    tokens = tokens.long()
    if tokens.device.type == "cpu":  # on accelerators the model checks ids without a sync
        _check_ids(tokens, decoder.vocab_size, placeholders, set(encoder_input or {}))
    return tokens


def _check_ids(
    tokens: torch.Tensor, vocab: int, placeholders: Mapping[str, int], with_input: set[str]
) -> None:
    """Every id is text (in ``[0, vocab)``) or the placeholder of an encoder given input; the
    placeholders of encoders without input must not appear (they would have no rows)."""
    for name, placeholder in placeholders.items():
        if name not in with_input and bool((tokens == placeholder).any()):
            raise ValueError(
                f"tokens: placeholder id {placeholder} of encoder {name!r} appears, but "
                f"encoder_input has no input for {name!r}"
            )
    valid = (tokens >= 0) & (tokens < vocab)
    allowed = [placeholders[name] for name in with_input]
    if allowed:
        valid |= torch.isin(tokens, torch.tensor(allowed, dtype=torch.long))
    if not bool(valid.all()):
        bad = tokens[~valid].unique()[:5].tolist()
        what = f"[0, {vocab})" + (f" or placeholder ids {sorted(allowed)}" if allowed else "")
        raise ValueError(f"tokens: expected ids in {what}, got {bad}")


def _checked_stop_tokens(stop_tokens: Any, vocab: int) -> tuple[int, ...]:
    if isinstance(stop_tokens, str | bytes | Mapping) or (
        isinstance(stop_tokens, torch.Tensor) and stop_tokens.dim() != 1
    ):
        raise ValueError(f"stop_tokens: expected a sequence of ids, got {show(stop_tokens)}")
    try:
        items = tuple(stop_tokens)
    except TypeError:  # not iterable: a single id, say
        raise ValueError(
            f"stop_tokens: expected a sequence of ids, got {show(stop_tokens)}"
        ) from None
    return tuple(as_id(token, "stop_tokens", vocab) for token in items)


def _check_caches(
    decoder: TransformerDecoder, batch_size: int, seq_len: int, max_new_tokens: int
) -> None:
    """The model's own caches, if set up, can hold this call; else the decoder can."""
    needed = seq_len + max_new_tokens - 1  # the last new token is never fed back
    if decoder.caches_are_setup():
        cache = decoder.layers[0].attn.kv_cache
        if not decoder.caches_are_enabled():
            raise ValueError("model: its KV caches are disabled (inside caches_disabled()?)")
        if cache.batch_size != batch_size:
            raise ValueError(
                f"tokens: the model's KV caches are set up for batch size {cache.batch_size}, "
                f"got {batch_size} prompts; set them up again or remove them"
            )
        dtype = _weights(decoder).dtype
        if cache.k_cache.dtype != dtype:
            raise ValueError(
                f"model: its KV caches are set up with dtype {cache.k_cache.dtype}, but the "
                f"model computes in {dtype}; set them up again with {dtype} or remove them"
            )
        capacity, what = cache.max_seq_len, "the KV cache's length"
    else:
        capacity, what = decoder.max_seq_len, "the decoder's max_seq_len"
    if needed > capacity:
        raise ValueError(
            f"tokens: prompts of length {seq_len} plus max_new_tokens={max_new_tokens} need "
            f"{needed} cache positions, more than {what} ({capacity})"
        )


def _check_not_all_padding(pad_counts: torch.Tensor, seq_len: int, pad_id: int) -> None:
    message = f"tokens: a prompt is all padding (pad_id={pad_id}); each needs a real token"
    if pad_counts.device.type == "cpu":
        if int(pad_counts.max()) >= seq_len:
            raise ValueError(message)
    else:  # a device-side assertion: no host synchronisation
        torch._assert_async((pad_counts < seq_len).all(), message)
