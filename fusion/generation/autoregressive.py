"""KV-cached autoregressive generation for ``TransformerDecoder`` and ``EarlyFusion`` alike."""

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion
from fusion.generation.padding import (
    leading_pad_counts,
    prefill_mask,
    prompt_positions,
    step_mask,
)
from fusion.generation.sampling import check_sampling_args, sample_next_token


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
    up for this call and removed afterwards (when the iterator is exhausted or closed). If the
    model has caches set up (for the same batch size), they are reset and used, and left set
    up. Gradients are off while the model runs; the model's train/eval mode is left as it is
    (call ``model.eval()`` first, or dropout applies).

    Raises:
        TypeError: ``model`` is neither a ``TransformerDecoder`` nor an ``EarlyFusion``.
        ValueError: ``tokens`` not integer [b, s] on the model's device; a sample that is all
            padding; the prompt plus ``max_new_tokens`` longer than the cache (or the decoder's
            ``max_seq_len``); ``max_new_tokens <= 0``; ``temperature < 0``; ``top_k <= 0`` or
            above the vocabulary; ``top_p`` outside (0, 1]; stop tokens or ``pad_id`` outside
            the vocabulary; ``pad_id`` a placeholder id; ``encoder_input`` for a model without
            encoders, or with unknown encoder names; caches set up for another batch size, or
            disabled.
    """
    decoder = _decoder_of(model)
    if isinstance(stop_tokens, int | torch.Tensor):
        raise ValueError(f"stop_tokens: expected a sequence of ids, got {stop_tokens!r}")
    stop_tokens = tuple(stop_tokens)
    _check_arguments(model, decoder, tokens, encoder_input, max_new_tokens, stop_tokens, pad_id)
    check_sampling_args(temperature, top_k, top_p, decoder.vocab_size)
    if generator is not None and generator.device.type != tokens.device.type:
        raise ValueError(
            f"generator: expected a generator on {tokens.device}, got one on {generator.device}"
        )
    pad_counts = leading_pad_counts(tokens, pad_id)
    _check_not_all_padding(pad_counts, tokens.size(1), pad_id)
    return _run(
        model,
        decoder,
        tokens,
        pad_counts,
        encoder_input=encoder_input,
        max_new_tokens=max_new_tokens,
        sampling={"temperature": temperature, "top_k": top_k, "top_p": top_p},
        stop_tokens=stop_tokens,
        pad_id=pad_id,
        generator=generator,
    )


def _run(
    model: TransformerDecoder | EarlyFusion,
    decoder: TransformerDecoder,
    tokens: torch.Tensor,
    pad_counts: torch.Tensor,
    *,
    encoder_input: Mapping[str, Any] | None,
    max_new_tokens: int,
    sampling: dict[str, Any],
    stop_tokens: tuple[int, ...],
    pad_id: int,
    generator: torch.Generator | None,
) -> Iterator[torch.Tensor]:
    batch_size, seq_len = tokens.shape
    created = not decoder.caches_are_setup()
    if created:
        dtype = decoder.tok_embeddings.weight.dtype
        decoder.setup_caches(batch_size, dtype, decoder_max_seq_len=seq_len + max_new_tokens - 1)
    else:
        decoder.reset_caches()
    try:
        cache_len = decoder.layers[0].attn.kv_cache.max_seq_len
        extra = {} if encoder_input is None else {"encoder_input": encoder_input}
        logits = _last_logits(
            model,
            tokens,
            mask=prefill_mask(pad_counts, seq_len, cache_len),
            input_pos=prompt_positions(pad_counts, seq_len),
            **extra,
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
                decoder,
                token[:, None],
                mask=step_mask(pad_counts, slot, cache_len),
                input_pos=(slot - pad_counts)[:, None],
            )
    finally:
        if created:
            decoder.teardown_caches()


def _last_logits(model: torch.nn.Module, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """float32 logits [b, vocab] of the last position only: the output projection of the other
    positions (a [b, s, vocab] tensor at prefill) is never computed."""
    saved = model.skip_output_layer, model.output_hidden_states
    model.skip_output_layer, model.output_hidden_states = True, []
    try:
        with torch.no_grad():
            hidden = model(tokens, **kwargs)
            return model.unembed(hidden[:, -1])
    finally:
        model.skip_output_layer, model.output_hidden_states = saved


def _decoder_of(model: Any) -> TransformerDecoder:
    if isinstance(model, EarlyFusion):
        return model.decoder
    if isinstance(model, TransformerDecoder):
        return model
    raise TypeError(
        f"model: expected a TransformerDecoder or an EarlyFusion, got {type(model).__name__}"
    )


def _check_arguments(
    model: TransformerDecoder | EarlyFusion,
    decoder: TransformerDecoder,
    tokens: torch.Tensor,
    encoder_input: Mapping[str, Any] | None,
    max_new_tokens: int,
    stop_tokens: tuple[int, ...],
    pad_id: int,
) -> None:
    vocab = decoder.vocab_size
    device = decoder.tok_embeddings.weight.device
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dim() != 2
        or tokens.dtype.is_floating_point
        or tokens.dtype.is_complex
        or tokens.dtype == torch.bool
        or tokens.numel() == 0
    ):
        given = (
            f"shape {list(tokens.shape)}, dtype {tokens.dtype}"
            if isinstance(tokens, torch.Tensor)
            else type(tokens).__name__
        )
        raise ValueError(f"tokens: expected non-empty integer ids [b, s], got {given}")
    if tokens.device != device:
        raise ValueError(
            f"tokens: expected them on the model's device {device}, got {tokens.device}"
        )
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens <= 0
    ):
        raise ValueError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")
    if not _is_id(pad_id, vocab):
        raise ValueError(f"pad_id: expected an id in [0, {vocab}), got {pad_id!r}")
    bad_stops = [t for t in stop_tokens if not _is_id(t, vocab)]
    if bad_stops:
        raise ValueError(f"stop_tokens: expected ids in [0, {vocab}), got {bad_stops}")
    if isinstance(model, EarlyFusion):
        if pad_id in model.encoder_tokens.values():
            raise ValueError(
                f"pad_id: {pad_id} is a placeholder id of the encoders {model.encoder_tokens}"
            )
        unknown = sorted(set(encoder_input or {}) - set(model.encoders))
        if unknown:
            raise ValueError(
                f"encoder_input: unknown encoder names {unknown}, expected some of "
                f"{sorted(model.encoders)}"
            )
    elif encoder_input is not None:
        raise ValueError(
            "encoder_input: this model is a plain TransformerDecoder without encoders; "
            f"got input for {sorted(encoder_input) if isinstance(encoder_input, Mapping) else '?'}"
        )

    batch_size, seq_len = tokens.shape
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
        capacity, what = cache.max_seq_len, "the KV cache's length"
    else:
        capacity, what = decoder.max_seq_len, "the decoder's max_seq_len"
    if needed > capacity:
        raise ValueError(
            f"tokens: prompts of length {seq_len} plus max_new_tokens={max_new_tokens} need "
            f"{needed} cache positions, more than {what} ({capacity})"
        )


def _is_id(value: Any, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab


def _check_not_all_padding(pad_counts: torch.Tensor, seq_len: int, pad_id: int) -> None:
    message = f"tokens: a prompt is all padding (pad_id={pad_id}); each needs a real token"
    if pad_counts.device.type == "cpu":
        if int(pad_counts.max()) >= seq_len:
            raise ValueError(message)
    else:  # a device-side assertion: no host synchronisation
        torch._assert_async((pad_counts < seq_len).all(), message)
