"""KV-cached autoregressive generation for ``TransformerDecoder`` and ``EarlyFusion`` alike."""

import contextlib
import threading
import weakref
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from fusion._arguments import (
    INTEGER_DTYPES,
    as_id,
    as_positive_int,
    same_device,
    show,
)
from fusion._validation import check_values, host_reads_are_free
from fusion._wrappers import unwrap
from fusion.decoder import TransformerDecoder
from fusion.decoder_kinds import FUSION, HUGGING_FACE, embedding_module, vocab_size
from fusion.early_fusion import EarlyFusion
from fusion.generation import foreign
from fusion.generation.sampling import check_generator, draw, sampling_args
from fusion.generation.steps import (
    EAGER,
    Steps,
    bucket,
    compile_options,
    compiled_steps,
    first_cache,
    mark_static,
    settle,
)
from fusion.padding import (
    leading_pad_counts,
    pad_left_to,
    prefill_mask,
    prompt_positions,
)


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
    compile: bool | Mapping[str, Any] = False,
    stop_check_interval: int = 8,
) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` tokens after each prompt of ``tokens``.

    The prompts run once through the model (the prefill, the only time encoders run), filling
    the KV cache; then each step feeds one token per sample. See :func:`generate_stream` for the
    arguments, the cache handling and the errors.

    Returns:
        [b, s + n] int64: the prompts (padding kept) followed by ``n <= max_new_tokens`` new
        tokens; ``n`` is smaller only when every sample has emitted a stop token, and is then
        the step at which the last one did, whatever ``stop_check_interval``. After its stop
        token, a sample's slots hold ``pad_id``.
    """
    plan = _prepare(**locals())  # the arguments, as given
    new = torch.stack(list(_run(plan)), dim=1)
    if plan.stop_tokens:
        # The host looked for the end only every few steps: drop the steps after it (one
        # synchronisation, here at the end).
        stop = torch.tensor(plan.stop_tokens, device=new.device)
        all_done = (torch.isin(new, stop).cumsum(dim=1) > 0).all(dim=0)  # [n], after step j
        if bool(all_done.any()):
            new = new[:, : int(all_done.int().argmax()) + 1]
    return torch.cat([plan.tokens, new], dim=1)


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
    compile: bool | Mapping[str, Any] = False,
    stop_check_interval: int = 8,
) -> Generator[torch.Tensor, None, None]:
    """Like :func:`generate`, but yield each step's new tokens [b] (int64) as they come.

    Every argument is checked when this is called, before anything is allocated; the model
    runs as the iterator advances. Ids may be of any integer dtype or type (Python, NumPy,
    0-dim tensors) and numbers Python or NumPy scalars; bools and floats are never integers.

    Args:
        model: a decoder, or an ``EarlyFusion`` over any decoder it takes (decoding steps
            bypass the merge: generated ids are text). A Hugging Face causal LM runs through a
            ``DynamicCache`` made for the call, passed as ``cache`` (``past_key_values`` in
            older transformers) with a 2-D ``attention_mask`` and ``position_ids``, as
            ``transformers``' ``generate`` does (greedy tokens equal its
            ``generate(inputs_embeds=..., attention_mask=...)``); a torchtune-style decoder
            through its ``setup_caches`` / ``reset_caches`` caches with this library's masks
            and positions (torn down after where it has ``teardown_caches``). Both eager only.
        tokens: prompts [b, s] on the model's device, left-padded with ``pad_id`` (see
            :func:`fusion.generation.left_pad`): leading ``pad_id`` tokens are padding, so no
            prompt may begin with one. Rotary positions start at 0 at each first real token.
        encoder_input: for ``EarlyFusion`` only, as in ``EarlyFusion.forward``; used at prefill.
        max_new_tokens: >= 1.
        temperature, top_k, top_p: see :func:`fusion.generation.sample_next_token`; 0 is greedy.
        stop_tokens: ids that end a sample (kept). Tracked on the device; the host looks whether
            all samples have stopped every ``stop_check_interval`` steps (an integer >= 1; one
            synchronisation each, none without stop tokens), so a stream may yield up to
            ``stop_check_interval - 1`` steps of ``pad_id`` past the last stop.
        pad_id: the padding id, inside the vocabulary and not a placeholder id.
        generator: randomness for sampling, on the model's device.
        compile: False runs eagerly. True compiles the prefill and the decoding step with
            ``torch.compile(fullgraph=True)``: inductor, static shapes, CUDA graphs on CUDA
            (``mode="reduce-overhead"``); a mapping passes ``backend``, ``mode``, ``options``,
            ``dynamic`` or ``recompile_limit``. Prompts are left-padded to a bucket length (a
            power of two from 16 to 256, a multiple of 256 above), and so are caches set up
            here: each new batch size, bucket or dtype compiles once, then steps, calls and
            prompts of the same buckets never recompile. A greedy step is one graph, sampling
            draws outside it; an ``EarlyFusion``'s prefill (encoders, merge) runs eagerly.
            Greedy tokens equal eager ones up to the last bits of fused kernels. On CUDA, set
            the caches up once and reuse them: new caches re-record the CUDA graphs.

    The KV cache: without caches, the model gets one of ``s + max_new_tokens - 1`` slots
    (bucketed when compiled), removed when the iterator ends (exhausted, closed, collected or
    failed); caches set up on the model (this batch size, the model's dtype) are reset and kept.
    From its first ``next()`` to its end a stream holds the model's one cache: another stream on
    it (or on an ``EarlyFusion`` sharing its decoder) raises ``RuntimeError`` before doing
    anything. Gradients are off; the train/eval mode is the caller's (``model.eval()`` first).
    A ``torch.compile`` wrapper is called as it is, or with ``compile`` set, its module is
    compiled instead. Nothing in a step reads a value on the host: the cache slot is the
    cache's fill level (a device tensor), positions and masks are computed on the device.

    Raises:
        TypeError: ``model`` is neither a ``TransformerDecoder`` nor an ``EarlyFusion``.
        RuntimeError: another stream on this model is in progress.
        ValueError: naming the argument: a Hugging Face base model without an output layer; a
            torchtune-style decoder without ``setup_caches``, ``caches_are_setup`` and
            ``reset_caches``; ``compile`` set for either; ``tokens`` not non-empty integer
            [b, s] on the model's device, or (on the CPU) with ids outside the vocabulary that
            are not placeholders of encoders given input; a sample all padding; prompt plus
            ``max_new_tokens`` longer than the cache or ``max_seq_len``; invalid numbers (see
            :func:`fusion.generation.check_sampling_args`); stop tokens or ``pad_id`` not ids
            of the vocabulary, or ``pad_id`` a placeholder; ``generator`` on another device;
            ``encoder_input`` not a mapping, without encoders, or with unknown names; weights
            on the meta device; caches set up for another batch size or dtype, or disabled;
            ``compile`` not a bool or a mapping of these options, or refused by torch.
    """
    return _run(_prepare(**locals()))


class _Plan(NamedTuple):
    """A generation's checked arguments; ``call`` is what generation calls (a
    ``torch.compile`` wrapper stays one), ``inner`` the module it is, whose attributes are read
    and set, ``decoder`` its decoder, of ``kind`` (see :mod:`fusion.decoder_kinds`)."""

    call: nn.Module
    inner: TransformerDecoder | EarlyFusion
    kind: str
    decoder: Any  # a TransformerDecoder, or another library's decoder
    tokens: torch.Tensor  # int64 [b, s]
    pad_counts: torch.Tensor  # [b]
    encoder_input: Mapping[str, Any] | None
    max_new_tokens: int
    sampling: tuple[float, int | None, float | None]  # temperature, top_k, top_p
    stop_tokens: tuple[int, ...]
    pad_id: int
    generator: torch.Generator | None
    steps: Steps
    stop_check_interval: int


def _prepare(
    model: Any,
    tokens: Any,
    encoder_input: Any,
    max_new_tokens: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    stop_tokens: Any,
    pad_id: Any,
    generator: Any,
    compile: Any,
    stop_check_interval: Any,
) -> _Plan:
    """Every argument checked, before anything is allocated or run."""
    call, inner, kind, decoder = _unwrap(model)
    if kind != FUSION:
        foreign.check_decoder(decoder, kind)
    _refuse_if_busy(decoder)
    if _weights(decoder, kind).device.type == "meta":
        raise ValueError(
            "model: its weights are on the meta device (no data); load or materialise them first"
        )
    max_new_tokens = as_positive_int(max_new_tokens, "max_new_tokens")
    stop_check_interval = as_positive_int(stop_check_interval, "stop_check_interval")
    vocab = vocab_size(decoder, kind, embedding_module(decoder, kind))
    if vocab is None:
        raise ValueError(
            f"model: the vocabulary size of its decoder {type(decoder).__name__} is unknown "
            "(no num_embeddings on its embedding, no vocab_size): ids cannot be checked"
        )
    pad_id = as_id(pad_id, "pad_id", vocab)
    stop_tokens = _checked_stop_tokens(stop_tokens, vocab)
    if isinstance(inner, EarlyFusion) and pad_id in inner.encoder_tokens.values():
        raise ValueError(
            f"pad_id: {pad_id} is a placeholder id of the encoders {inner.encoder_tokens}"
        )
    sampling = sampling_args(temperature, top_k, top_p, vocab)
    tokens = _checked_tokens(inner, decoder, kind, tokens, encoder_input, vocab)
    check_generator(generator, tokens.device)
    options = compile_options(compile, tokens.device)
    if kind == FUSION:
        _check_caches(decoder, tokens.size(0), tokens.size(1), max_new_tokens)
    elif options is not None:
        raise ValueError(
            f"compile: compiled generation needs this library's TransformerDecoder; this "
            f"EarlyFusion holds a {kind} decoder ({type(decoder).__name__}): pass compile=False"
        )
    else:
        capacity, what = foreign.capacity(decoder, kind)
        _check_capacity(tokens.size(1), max_new_tokens, capacity, what)
    pad_counts = leading_pad_counts(tokens, pad_id)
    check_values(
        (pad_counts < tokens.size(1)).all(),
        f"tokens: a prompt is all padding (pad_id={pad_id}); each needs a real token",
        eager=host_reads_are_free(pad_counts.device),
    )
    steps = EAGER if options is None else compiled_steps(options)
    return _Plan(
        call, inner, kind, decoder, tokens, pad_counts, encoder_input, max_new_tokens, sampling,
        stop_tokens, pad_id, generator, steps, stop_check_interval,
    )  # fmt: skip


# Decoders with a live stream: their KV caches are in use. One cache per decoder, so at most
# one stream per decoder (an ``EarlyFusion`` counts as its decoder; a Hugging Face decoder gets
# a cache per call and is never held). Weak: a model that is garbage-collected leaves the set
# by itself.
_LIVE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _refuse_if_busy(decoder: nn.Module, *, claim: bool = False) -> None:
    with _LIVE_LOCK:
        if decoder in _LIVE:
            raise RuntimeError(
                "model: another generation on this model is in progress (a generate_stream "
                "iterator that is neither exhausted nor closed): both would use its one KV "
                "cache; finish or close() that iterator first, or use another model instance"
            )
        if claim:
            _LIVE.add(decoder)


def _run(plan: _Plan) -> Generator[torch.Tensor, None, None]:
    """The decoding loop, the same for every kind of decoder (each has its own session)."""
    decoder, kind = plan.decoder, plan.kind
    held = kind != HUGGING_FACE  # a Hugging Face decoder gets a cache per call
    # Claimed when the stream starts (its first next()), not when it is created: a generator
    # that never starts never runs its finally block, so it could never give the model back.
    if held:
        _refuse_if_busy(decoder, claim=True)
    session: _FusionSession | foreign.HuggingFaceSteps | foreign.TorchtuneSteps | None = None
    fused = None  # a fusion decoder's greedy step: one graph when compiled, its choice included
    try:
        extra = {} if plan.encoder_input is None else {"encoder_input": plan.encoder_input}
        if kind == FUSION:
            session = _FusionSession(plan, extra)
            fused = session.greedy_step if plan.sampling[0] == 0 else None
        elif kind == HUGGING_FACE:
            session = foreign.HuggingFaceSteps(
                plan.call, decoder, plan.tokens, plan.pad_counts, extra
            )
        else:
            dtype = _weights(decoder, kind).dtype
            session = foreign.TorchtuneSteps(
                plan.call, decoder, plan.tokens, plan.pad_counts, extra,
                max_new_tokens=plan.max_new_tokens, dtype=dtype,
            )  # fmt: skip
        device = plan.tokens.device
        # Stop ids padded with -1 (never an id) to a multiple of 8: one graph for 0 to 8 ids.
        stop = torch.full((-(-len(plan.stop_tokens) // 8) * 8 or 8,), -1, device=device)
        stop[: len(plan.stop_tokens)] = torch.tensor(plan.stop_tokens, dtype=torch.long)
        done = torch.zeros(len(plan.tokens), dtype=torch.bool, device=device)
        with torch.no_grad():
            logits = session.prefill()
        token, done = settle(_choose(logits, plan), done, stop, plan.pad_id)
        for step in range(plan.max_new_tokens):
            yield token
            if step == plan.max_new_tokens - 1:
                return
            # The only host look of the loop: whether every sample has stopped, every few steps.
            if plan.stop_tokens and (step + 1) % plan.stop_check_interval == 0 and bool(done.all()):
                return
            with torch.no_grad():
                if fused is not None:
                    token, done = fused(token, done, stop)
                else:
                    logits = session.step(token)
                    token, done = settle(_choose(logits, plan), done, stop, plan.pad_id)
    finally:  # also on close(), garbage collection and errors: nothing of ours stays behind
        try:
            if session is not None:
                session.close()
        finally:
            if held:
                with _LIVE_LOCK:
                    _LIVE.discard(decoder)


def _choose(logits: torch.Tensor, plan: _Plan) -> torch.Tensor:
    temperature, top_k, top_p = plan.sampling
    return draw(logits, temperature, top_k, top_p, plan.generator)


class _FusionSession:
    """Prefill and decoding steps through this library's decoder and its KV caches: set up at
    the prefill (bucketed when compiled) and torn down in :meth:`close`, unless the model has
    its own, which are then reset and kept."""

    def __init__(self, plan: _Plan, extra: Mapping[str, Any]) -> None:
        self.plan, self.extra, self.decoder, self.steps = plan, extra, plan.decoder, plan.steps
        decoder_only = isinstance(plan.inner, TransformerDecoder)
        # Compiled: an EarlyFusion's prefill runs eagerly (encoders), a decoder's compiled.
        self.compiled_prefill = self.steps.compiled and decoder_only
        # Decoding steps feed generated ids, always text: an EarlyFusion's merge is bypassed;
        # compiled, the module itself is compiled (not a torch.compile wrapper around it).
        self.step_call = plan.call if decoder_only and not self.steps.compiled else plan.decoder
        self.graphs = self.steps.compiled and plan.tokens.device.type == "cuda"
        self.pad_counts = plan.pad_counts
        self.created = False

    def prefill(self) -> torch.Tensor:
        plan, decoder = self.plan, self.decoder
        batch_size, seq_len = plan.tokens.shape
        max_new = plan.max_new_tokens
        own_caches = decoder.caches_are_setup()
        if own_caches:
            # Checked again: the caches may have changed since generate_stream() was called.
            _check_caches(decoder, batch_size, seq_len, max_new)
        capacity = first_cache(decoder).max_seq_len if own_caches else decoder.max_seq_len
        prompt_len = bucket(seq_len, capacity - max_new + 1) if self.compiled_prefill else seq_len
        if own_caches:
            decoder.reset_caches()
        else:
            self.created = True  # before setup: a setup that fails half-way is torn down too
            needed = prompt_len + max_new - 1  # the last new token is never fed back
            length = bucket(needed, capacity) if self.steps.compiled else needed
            dtype = _weights(decoder, FUSION).dtype
            decoder.setup_caches(batch_size, dtype, decoder_max_seq_len=length)
        if self.graphs:
            mark_static(decoder)
        tokens, self.pad_counts = pad_left_to(plan.tokens, plan.pad_counts, prompt_len, plan.pad_id)
        mask = prefill_mask(self.pad_counts, prompt_len, first_cache(decoder).max_seq_len)
        positions = prompt_positions(self.pad_counts, prompt_len)
        prefill, call = (
            (self.steps.prefill, decoder) if self.compiled_prefill else (EAGER.prefill, plan.call)
        )
        with self._one_call():
            return prefill(call, decoder, tokens, mask, positions, self.extra)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        with self._one_call():
            return self.steps.step_logits(self.step_call, self.decoder, token, self.pad_counts)

    def greedy_step(
        self, token: torch.Tensor, done: torch.Tensor, stop: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with self._one_call():
            token, done = self.steps.greedy_step(
                self.step_call, self.decoder, token, self.pad_counts, done, stop, self.plan.pad_id
            )
        # A CUDA graph's outputs are overwritten by its next replay.
        return (token.clone(), done.clone()) if self.graphs else (token, done)

    @contextlib.contextmanager
    def _one_call(self) -> Iterator[None]:
        """For one call, the decoder returns final hidden states (the caller projects only the
        last slot) and no intermediate ones; its settings are restored after, so that the
        user's own calls between two steps of a stream get what they set. With CUDA graphs,
        the previous replay's outputs may be overwritten (those still needed were cloned)."""
        decoder = self.decoder
        saved = decoder.skip_output_layer, decoder.output_hidden_states
        decoder.skip_output_layer, decoder.output_hidden_states = True, []
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        try:
            yield
        finally:
            decoder.skip_output_layer, decoder.output_hidden_states = saved

    def close(self) -> None:
        if self.created:
            self.decoder.teardown_caches()


def _unwrap(model: Any) -> tuple[nn.Module, TransformerDecoder | EarlyFusion, str, Any]:
    """What to call, the module it is, its decoder's kind and its decoder: a ``torch.compile``
    wrapper (``OptimizedModule``) is looked through but still called."""
    inner = unwrap(model, parallel=False)
    if isinstance(inner, EarlyFusion):
        return model, inner, inner.decoder_kind, inner.decoder
    if isinstance(inner, TransformerDecoder):
        return model, inner, FUSION, inner
    raise TypeError(
        f"model: expected a TransformerDecoder or an EarlyFusion (or one wrapped by "
        f"torch.compile; a Hugging Face or torchtune-style decoder goes inside an EarlyFusion, "
        f"with no encoders if need be), got {type(model).__name__}"
    )


def _weights(decoder: Any, kind: str) -> torch.Tensor:
    """A tensor with the decoder's device and compute dtype: the embedding table (caches are
    set up in its dtype), or a wrapper's first parameter."""
    weight = getattr(embedding_module(decoder, kind), "weight", None)
    return weight if isinstance(weight, torch.Tensor) else next(decoder.parameters())


def _checked_tokens(
    inner: TransformerDecoder | EarlyFusion,
    decoder: Any,
    kind: str,
    tokens: Any,
    encoder_input: Any,
    vocab: int,
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
    device = _weights(decoder, kind).device
    if not same_device(tokens.device, device):
        raise ValueError(
            f"tokens: expected them on the model's device {device}, got {tokens.device}"
        )
    placeholders: Mapping[str, int] = {}
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
        names = sorted(encoder_input, key=str) if isinstance(encoder_input, Mapping) else "?"
        raise ValueError(
            "encoder_input: this model is a plain TransformerDecoder without encoders; "
            f"got input for {names}"
        )
    tokens = tokens.long()
    if tokens.device.type == "cpu":  # on accelerators the model checks ids without a sync
        _check_ids(tokens, vocab, placeholders, set(encoder_input or {}))
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
    if decoder.caches_are_setup():
        cache = first_cache(decoder)
        if not decoder.caches_are_enabled():
            raise ValueError("model: its KV caches are disabled (inside caches_disabled()?)")
        if cache.batch_size != batch_size:
            raise ValueError(
                f"tokens: the model's KV caches are set up for batch size {cache.batch_size}, "
                f"got {batch_size} prompts; set them up again or remove them"
            )
        dtype = _weights(decoder, FUSION).dtype
        if cache.k_cache.dtype != dtype:
            raise ValueError(
                f"model: its KV caches are set up with dtype {cache.k_cache.dtype}, but the "
                f"model computes in {dtype}; set them up again with {dtype} or remove them"
            )
        _check_capacity(seq_len, max_new_tokens, cache.max_seq_len, "the KV cache's length")
    else:
        _check_capacity(seq_len, max_new_tokens, decoder.max_seq_len, "the decoder's max_seq_len")


def _check_capacity(seq_len: int, max_new_tokens: int, capacity: int | None, what: str) -> None:
    """Prompts of ``seq_len`` plus ``max_new_tokens`` fit in ``capacity`` slots (None: no
    limit); the last new token is never fed back."""
    needed = seq_len + max_new_tokens - 1
    if capacity is not None and needed > capacity:
        raise ValueError(
            f"tokens: prompts of length {seq_len} plus max_new_tokens={max_new_tokens} need "
            f"{needed} cache positions, more than {what} ({capacity})"
        )
