"""KV-cached autoregressive generation for ``TransformerDecoder`` and ``EarlyFusion`` alike."""

import contextlib
import threading
import weakref
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fusion._arguments import INTEGER_DTYPES, as_id, as_positive_int, same_device, show
from fusion._validation import check_values, describe, host_reads_are_free
from fusion._wrappers import unwrap
from fusion.decoder import TransformerDecoder
from fusion.decoder_kinds import FUSION, HUGGING_FACE, embedding_module, vocab_size
from fusion.early_fusion import EarlyFusion
from fusion.generation import foreign
from fusion.generation.sampling import check_generator, check_sampling_args, draw
from fusion.generation.steps import (
    EAGER,
    bucket,
    compile_options,
    compiled_steps,
    first_cache,
    mark_static,
    settle,
)
from fusion.padding import leading_pad_counts, pad_left_to, prefill_mask, prompt_positions


def generate(
    model: TransformerDecoder | EarlyFusion, tokens: torch.Tensor, *,
    encoder_input: Mapping[str, Any] | None = None, max_new_tokens: int,
    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
    stop_tokens: Iterable[int] = (), pad_id: int = 0, generator: torch.Generator | None = None,
    compile: bool | Mapping[str, Any] = False, stop_check_interval: int = 8,
) -> torch.Tensor:  # fmt: skip
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
    plan = _Plan(**locals())  # the arguments, as given
    new = torch.stack(list(plan.run()), dim=1)
    if plan.stop_tokens:
        # The host looked for the end only every few steps: drop the steps after it (one
        # synchronisation, here at the end).
        stop = torch.tensor(plan.stop_tokens, device=new.device)
        all_done = (torch.isin(new, stop).cumsum(dim=1) > 0).all(dim=0)  # [n], after step j
        if bool(all_done.any()):
            new = new[:, : int(all_done.int().argmax()) + 1]
    return torch.cat([plan.tokens, new], dim=1)


def generate_stream(
    model: TransformerDecoder | EarlyFusion, tokens: torch.Tensor, *,
    encoder_input: Mapping[str, Any] | None = None, max_new_tokens: int,
    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
    stop_tokens: Iterable[int] = (), pad_id: int = 0, generator: torch.Generator | None = None,
    compile: bool | Mapping[str, Any] = False, stop_check_interval: int = 8,
) -> Generator[torch.Tensor, None, None]:  # fmt: skip
    """Like :func:`generate`, but yield each step's new tokens [b] (int64) as they come.

    Every argument is checked when this is called, before anything is allocated; the model
    runs as the iterator advances. Ids may be of any integer dtype or type (Python, NumPy,
    0-dim tensors) and numbers Python or NumPy scalars; bools and floats are never integers.
    ``docs/generation.md`` tells the rest: other libraries' decoders, compiling, the cache.

    Args:
        model: a decoder, or an ``EarlyFusion`` over any decoder it takes (decoding steps
            bypass the merge: generated ids are text); one over a Hugging Face causal LM or a
            torchtune-style decoder runs through that decoder's own cache, eagerly.
        tokens: prompts [b, s] on the model's device, left-padded with ``pad_id`` (see
            :func:`fusion.generation.left_pad`): leading ``pad_id`` tokens are padding, so no
            prompt may begin with one. Rotary positions start at 0 at each first real token.
        encoder_input: for ``EarlyFusion`` only, as in ``EarlyFusion.forward``; used at prefill.
        max_new_tokens: >= 1.
        temperature, top_k, top_p: see :func:`fusion.generation.sample_next_token`; 0 is greedy.
        stop_tokens: ids that end a sample (kept), tracked on the device; the host looks whether
            all samples stopped every ``stop_check_interval`` steps (an integer >= 1; one
            synchronisation each), so a stream may yield up to ``stop_check_interval - 1``
            steps of ``pad_id`` past the last stop.
        pad_id: the padding id, inside the vocabulary and not a placeholder id.
        generator: randomness for sampling, on the model's device.
        compile: False runs eagerly; True compiles the prefill and the decoding step
            (``torch.compile(fullgraph=True)``, static shapes, bucketed lengths, CUDA graphs on
            CUDA), a mapping with these options (:func:`fusion.generation.steps.compile_options`).

    Without caches, the model gets one of ``s + max_new_tokens - 1`` slots (bucketed when
    compiled), removed when the iterator ends (exhausted, closed, collected or failed); caches
    set up on the model are reset and kept (a torchtune-style decoder's are torn down where it
    has ``teardown_caches``). A stream holds the model's one cache from its first ``next()`` to
    its end. A ``torch.compile`` wrapper is called as it is (with ``compile``, its module is
    compiled). Gradients are off; the train/eval mode is the caller's (``model.eval()`` first).

    Raises:
        TypeError: ``model`` is neither a ``TransformerDecoder`` nor an ``EarlyFusion``.
        RuntimeError: another stream on this model (or its decoder) is in progress.
        ValueError: naming the argument, before anything runs: a decoder generation cannot
            drive; weights on the meta device; ``tokens`` not non-empty integer [b, s] on the
            model's device, a sample all padding, or (on the CPU) ids neither text nor
            placeholders of encoders given input; prompts plus ``max_new_tokens`` longer than
            the cache; caches set up for another batch size or dtype, or disabled; any other
            argument out of range or of the wrong type.
    """
    return _Plan(**locals()).run()


class _Plan:
    """A generation's arguments, all checked when built, before anything is allocated or run;
    :meth:`run` is the decoding loop. ``call`` is what is called (a ``torch.compile`` wrapper
    stays one), ``inner`` the module it is, ``decoder`` its decoder, of ``kind``."""

    def __init__(
        self, model: Any, tokens: Any, encoder_input: Any, max_new_tokens: Any, temperature: Any,
        top_k: Any, top_p: Any, stop_tokens: Any, pad_id: Any, generator: Any, compile: Any,
        stop_check_interval: Any,
    ) -> None:  # fmt: skip
        self.call, self.inner, self.kind, decoder = _unwrap(model)
        self.decoder: Any = decoder  # a TransformerDecoder, or another library's decoder
        if self.kind != FUSION:
            foreign.check_decoder(decoder, self.kind)
        _refuse_if_busy(decoder)
        weights = _weights(decoder, self.kind)
        if weights.device.type == "meta":
            raise ValueError(
                "model: its weights are on the meta device (no data); load or materialise "
                "them first"
            )
        self.dtype = weights.dtype
        self.max_new_tokens = as_positive_int(max_new_tokens, "max_new_tokens")
        self.stop_check_interval = as_positive_int(stop_check_interval, "stop_check_interval")
        vocab = vocab_size(decoder, self.kind, embedding_module(decoder, self.kind))
        if vocab is None:
            raise ValueError(
                f"model: the vocabulary size of its decoder {type(decoder).__name__} is unknown "
                "(no num_embeddings on its embedding, no vocab_size): ids cannot be checked"
            )
        self.pad_id = as_id(pad_id, "pad_id", vocab)
        self.stop_tokens = _checked_stop_tokens(stop_tokens, vocab)
        if self.pad_id in getattr(self.inner, "encoder_tokens", {}).values():  # an EarlyFusion
            raise ValueError(
                f"pad_id: {self.pad_id} is a placeholder id of the encoders "
                f"{self.inner.encoder_tokens}"
            )
        self.sampling = check_sampling_args(temperature, top_k, top_p, vocab)
        self.tokens = _checked_tokens(self.inner, weights.device, tokens, encoder_input, vocab)
        self.extra = {} if encoder_input is None else {"encoder_input": encoder_input}
        check_generator(generator, self.tokens.device)
        self.generator = generator
        options = compile_options(compile, self.tokens.device)
        batch_size, seq_len = self.tokens.shape
        if self.kind == FUSION:
            _check_caches(decoder, batch_size, seq_len, self.max_new_tokens)
        elif options is not None:
            raise ValueError(
                f"compile: compiled generation needs this library's TransformerDecoder; this "
                f"EarlyFusion holds a {self.kind} decoder ({type(decoder).__name__}): pass "
                "compile=False"
            )
        else:
            _check_capacity(seq_len, self.max_new_tokens, *foreign.capacity(decoder, self.kind))
        self.pad_counts = leading_pad_counts(self.tokens, self.pad_id)
        check_values(
            (self.pad_counts < seq_len).all(),
            f"tokens: a prompt is all padding (pad_id={self.pad_id}); each needs a real token",
            eager=host_reads_are_free(self.pad_counts.device),
        )
        self.steps = EAGER if options is None else compiled_steps(options)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        return draw(logits, *self.sampling, self.generator)

    def run(self) -> Generator[torch.Tensor, None, None]:
        """The decoding loop, the same for every kind of decoder (each has its own session,
        which allocates nothing before its prefill)."""
        session = (
            _FusionSession(self)
            if self.kind == FUSION
            else foreign.HuggingFaceSteps(self)
            if self.kind == HUGGING_FACE
            else foreign.TorchtuneSteps(self)
        )
        # A fusion decoder's greedy step: one graph when compiled, its choice included.
        fused = session.greedy_step if isinstance(session, _FusionSession) else None
        fused = fused if self.sampling[0] == 0 else None
        held = self.kind != HUGGING_FACE  # a Hugging Face decoder gets a cache per call
        # Claimed when the stream starts (its first next()), not when it is created: a generator
        # that never starts never runs its finally block, so it could never give the model back.
        if held:
            _refuse_if_busy(self.decoder, claim=True)
        try:
            device, n_stop = self.tokens.device, len(self.stop_tokens)
            # Stop ids padded with -1 (never an id) to a multiple of 8: one graph for 0 to 8 ids.
            stop = torch.full((-(-n_stop // 8) * 8 or 8,), -1, device=device)
            stop[:n_stop] = torch.tensor(self.stop_tokens, dtype=torch.long)
            done = torch.zeros(len(self.tokens), dtype=torch.bool, device=device)
            with torch.no_grad():
                token, done = settle(self.choose(session.prefill()), done, stop, self.pad_id)
            for step in range(self.max_new_tokens):
                yield token
                if step == self.max_new_tokens - 1:
                    return
                # The only host look of the loop: whether all samples stopped, every few steps.
                if n_stop and (step + 1) % self.stop_check_interval == 0 and bool(done.all()):
                    return
                with torch.no_grad():
                    if fused is not None:
                        token, done = fused(token, done, stop)
                    else:
                        logits = session.step(token)
                        token, done = settle(self.choose(logits), done, stop, self.pad_id)
        finally:  # also on close(), garbage collection and errors: nothing of ours stays behind
            try:
                session.close()
            finally:
                if held:
                    with _LIVE_LOCK:
                        _LIVE.discard(self.decoder)


# Decoders with a live stream (one cache each, so one stream each; a Hugging Face decoder gets a
# cache per call and is never held). Weak: a collected model leaves the set by itself.
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


class _FusionSession:
    """Steps through this library's decoder: its KV caches set up at the prefill (bucketed when
    compiled) and torn down in :meth:`close`, unless it has its own, then reset and kept."""

    def __init__(self, plan: _Plan) -> None:
        self.plan, self.decoder, self.steps = plan, plan.decoder, plan.steps
        decoder_only = isinstance(plan.inner, TransformerDecoder)
        # Compiled: an EarlyFusion's prefill runs eagerly (encoders), a decoder's compiled.
        self.compiled_prefill = self.steps.compiled and decoder_only
        # Decoding steps feed generated ids, always text: an EarlyFusion's merge is bypassed;
        # compiled, the module itself is compiled (not a torch.compile wrapper around it).
        self.step_call = plan.call if decoder_only and not self.steps.compiled else plan.decoder
        self.graphs = self.steps.compiled and plan.tokens.device.type == "cuda"
        self.pad_counts, self.extra = plan.pad_counts, plan.extra
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
        with self._one_call(step=True):
            return self.steps.step_logits(self.step_call, self.decoder, token, self.pad_counts)

    def greedy_step(
        self, token: torch.Tensor, done: torch.Tensor, stop: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with self._one_call(step=True):
            token, done = self.steps.greedy_step(
                self.step_call, self.decoder, token, self.pad_counts, done, stop, self.plan.pad_id
            )
        # A CUDA graph's outputs are overwritten by its next replay.
        return (token.clone(), done.clone()) if self.graphs else (token, done)

    @contextlib.contextmanager
    def _one_call(self, *, step: bool = False) -> Iterator[None]:
        """For one call, the decoder returns final hidden states (only the last slot is
        projected) and no intermediate ones; the user's settings are restored after. With CUDA
        graphs, the previous replay's outputs may be overwritten (those needed were cloned).

        A decoding ``step`` feeds what this loop made from inputs checked once, in the plan
        (generated ids, positions and slots within the capacity checked there, the step
        mask): the decoder skips its per-call value checks
        (``TransformerDecoder._inputs_checked_by_caller``), which read the host on the CPU. The
        prefill, which feeds the user's prompts, keeps them all."""
        decoder = self.decoder
        saved = decoder.skip_output_layer, decoder.output_hidden_states
        decoder.skip_output_layer, decoder.output_hidden_states = True, []
        decoder._inputs_checked_by_caller = step
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        try:
            yield
        finally:
            decoder.skip_output_layer, decoder.output_hidden_states = saved
            decoder._inputs_checked_by_caller = False

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
    """The decoder's embedding table (its device and compute dtype), or its first parameter."""
    weight = getattr(embedding_module(decoder, kind), "weight", None)
    return weight if isinstance(weight, torch.Tensor) else next(decoder.parameters())


def _checked_tokens(
    inner: TransformerDecoder | EarlyFusion, device: torch.device, tokens: Any, encoder_input: Any,
    vocab: int,
) -> torch.Tensor:  # fmt: skip
    """``tokens`` as int64 after the checks (any integer dtype is accepted: ids are widened,
    never narrowed); ``encoder_input`` is checked along, since it decides the valid ids."""
    is_tensor = isinstance(tokens, torch.Tensor)
    if (
        not is_tensor
        or tokens.dim() != 2
        or tokens.dtype not in INTEGER_DTYPES
        or not tokens.numel()
    ):
        given = describe(tokens) if is_tensor else type(tokens).__name__
        raise ValueError(f"tokens: expected non-empty integer ids [b, s], got {given}")
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
        inner.check_encoder_names(encoder_input or {})
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
    items = None
    if not isinstance(stop_tokens, str | bytes | Mapping) and not (
        isinstance(stop_tokens, torch.Tensor) and stop_tokens.dim() != 1
    ):
        with contextlib.suppress(TypeError):  # not iterable: a single id, say
            items = tuple(stop_tokens)
    if items is None:
        raise ValueError(f"stop_tokens: expected a sequence of ids, got {show(stop_tokens)}")
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
