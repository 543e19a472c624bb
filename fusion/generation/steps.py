"""The prefill and the decoding step, as plain functions: run eagerly, or under ``torch.compile``.

A decoding step sees the same shapes and Python constants at every step: the token [b], the
pad counts [b], the done flags [b] and the stop ids are tensors, and the cache slot it writes
is the KV cache's fill level, a device tensor. So a step compiles once (``fullgraph=True``),
never recompiles while decoding, reads nothing on the host, and can be captured in a CUDA
graph (``mode="reduce-overhead"``). Eager and compiled generation run the same functions.
"""

import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from fusion._arguments import as_positive_int, show
from fusion.decoder import KVCache, TransformerDecoder
from fusion.padding import step_mask


def prefill_logits(
    call: nn.Module, decoder: TransformerDecoder, tokens: torch.Tensor, mask: torch.Tensor,
    input_pos: torch.Tensor, extra: Mapping[str, Any],
) -> torch.Tensor:  # fmt: skip
    """Run the prompts [b, s] through ``call`` (the decoder, or a model around it, returning
    hidden states); float32 logits [b, vocab] of the last slot only: the output projection of
    the other slots (a [b, s, vocab] tensor) is never computed."""
    hidden = call(tokens, mask=mask, input_pos=input_pos, **extra)
    return last_slot_logits(decoder, hidden)


def step_logits(
    call: nn.Module, decoder: TransformerDecoder, token: torch.Tensor, pad_counts: torch.Tensor
) -> torch.Tensor:
    """Feed one token [b] per sample; float32 logits [b, vocab] of the next one.

    The token goes to the cache slot after the fill level; its rotary position is that slot
    minus the sample's pad count, and it attends to the real slots up to its own."""
    cache = first_cache(decoder)
    slot = cache.fill  # a device tensor: no value read on the host, none baked into a graph
    mask = step_mask(pad_counts, slot, cache.max_seq_len)
    hidden = call(token[:, None], mask=mask, input_pos=(slot - pad_counts)[:, None])
    return last_slot_logits(decoder, hidden)


def last_slot_logits(decoder: TransformerDecoder, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits [b, vocab] of the last slot of ``hidden`` [b, s, d]: ``decoder.unembed``,
    except for one sample through a tied output on the CPU under ``torch.compile``, where the
    product is written as a multiply and a sum, which inductor compiles into one pass over the
    table (products of float32 or upcast values, summed in float32).

    Measured (2026-12-01, the 32000 x 512 float32 table of ``benchmarks/generation.py``, one
    thread): BLAS reads the ``[vocab, d]`` table at about half the memory bandwidth for one
    row: 5.5-6.4 ms against 3.6 ms for the compiled sum and 3.0 ms for ``weight.sum()``; whole
    compiled generations (B=1, 32 + 64 tokens) 1.26x as fast, same tokens.
    """
    last = hidden[:, -1]
    weight = getattr(decoder.tok_embeddings, "weight", None) if decoder.output is None else None
    if (
        torch.compiler.is_compiling()
        and isinstance(weight, torch.Tensor)
        and last.size(0) == 1
        and last.device.type == "cpu"
    ):
        return (weight.float() * last.float()).sum(-1)[None]
    return decoder.unembed(last)


def settle(
    token: torch.Tensor, done: torch.Tensor, stop: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples already done emit ``pad_id``; a sample is done once it has emitted a stop id.
    On the device: whether all are done is looked at by the caller, when it chooses."""
    token = token.masked_fill(done, pad_id)
    return token, done | torch.isin(token, stop)


def greedy_step(
    call: nn.Module, decoder: TransformerDecoder, token: torch.Tensor, pad_counts: torch.Tensor,
    done: torch.Tensor, stop: torch.Tensor, pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A whole greedy step: the next token [b] and the done flags [b] (one graph when
    compiled: nothing of the step runs outside it)."""
    return settle(step_logits(call, decoder, token, pad_counts).argmax(-1), done, stop, pad_id)


def first_cache(decoder: TransformerDecoder) -> KVCache:
    """The first layer's KV cache: its length and fill level are every layer's."""
    return decoder.kv_caches()[0]


class Steps(NamedTuple):
    """The functions a generation runs, eager or compiled."""

    prefill: Callable[..., torch.Tensor]
    step_logits: Callable[..., torch.Tensor]
    greedy_step: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    compiled: bool


EAGER = Steps(prefill_logits, step_logits, greedy_step, compiled=False)

COMPILE_KEYS = ("backend", "mode", "options", "dynamic", "recompile_limit")
# torch.compile takes a per-call recompile_limit only in recent versions.
_TAKES_RECOMPILE_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters

# One set of compiled functions per set of options: torch.compile wrappers are reused, so
# that a second generation with the same shapes runs the graphs the first one compiled.
_COMPILED: dict[tuple, Steps] = {}
_COMPILED_LOCK = threading.Lock()


def compile_options(value: Any, device: torch.device) -> dict[str, Any] | None:
    """The ``compile`` argument of ``generate`` as ``torch.compile`` keyword arguments, or None
    for eager generation (``ValueError`` naming what is wrong otherwise; torch.compile refuses
    other bad values: :func:`compiled_steps`).

    ``True`` means inductor with static shapes (``dynamic=False``) and, on CUDA, CUDA graphs
    (``mode="reduce-overhead"``). A mapping sets any of ``backend``, ``mode``, ``options``,
    ``dynamic`` and ``recompile_limit`` (default 64 per compiled function, where torch takes
    it; else torch's own limit applies); ``fullgraph`` is always True.
    """
    if value is False:
        return None
    if value is True:
        options: dict[str, Any] = {}
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - set(COMPILE_KEYS), key=str)
        if unknown:
            raise ValueError(
                f"compile: unknown torch.compile options {unknown}, expected some of "
                f"{list(COMPILE_KEYS)} (fullgraph is always True)"
            )
        options = dict(value)
    else:
        raise ValueError(
            "compile: expected True, False or a mapping of torch.compile options "
            f"{list(COMPILE_KEYS)}, got {show(value)}"
        )
    backend = options.setdefault("backend", "inductor")
    if not (isinstance(backend, str) or callable(backend)):
        raise ValueError(f"compile: backend: expected a name or a callable, got {show(backend)}")
    tuned = [key for key in ("mode", "options") if options.get(key) is not None]
    if len(tuned) == 2:
        raise ValueError("compile: expected mode or options, not both (torch.compile takes one)")
    dynamic = options.setdefault("dynamic", False)
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ValueError(f"compile: dynamic: expected True, False or None, got {show(dynamic)}")
    limit = as_positive_int(options.get("recompile_limit", 64), "compile: recompile_limit")
    if _TAKES_RECOMPILE_LIMIT:
        options["recompile_limit"] = limit
    elif "recompile_limit" in options:
        raise ValueError(
            "compile: recompile_limit needs a torch whose torch.compile takes it "
            f"(this is {torch.__version__}); set torch._dynamo.config.recompile_limit instead"
        )
    if backend == "inductor" and device.type == "cuda" and not tuned:
        options["mode"] = "reduce-overhead"  # CUDA graphs: a decoding step is launch-bound
    if isinstance(options.get("options"), Mapping):
        options["options"] = dict(options["options"])
    return options


def compiled_steps(options: dict[str, Any]) -> Steps:
    """The step functions compiled with ``options`` (from :func:`compile_options`);
    ``ValueError`` when ``torch.compile`` refuses them (an unknown backend or mode)."""
    key = _freeze(options)
    with _COMPILED_LOCK:
        steps = _COMPILED.get(key)
        if steps is None:
            try:
                steps = Steps(
                    torch.compile(prefill_logits, fullgraph=True, **options),
                    torch.compile(step_logits, fullgraph=True, **options),
                    torch.compile(greedy_step, fullgraph=True, **options),
                    compiled=True,
                )
            except Exception as error:  # torch raises several kinds for bad options
                reason = " ".join(str(error).split())
                raise ValueError(f"compile: torch.compile refused {options}: {reason}") from error
            _COMPILED[key] = steps
    return steps


def _freeze(value: Any) -> Any:
    """A hashable key for a value of the options (a mapping, a callable backend, ...)."""
    if isinstance(value, Mapping):
        return tuple(sorted(((str(k), _freeze(v)) for k, v in value.items()), key=repr))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def bucket(length: int, most: int) -> int:
    """``length`` rounded up, so that nearby lengths share a compiled graph: to a power of two
    from 16 to 256, to a multiple of 256 above; at most ``most``, never below ``length``."""
    size = 16
    while size < length and size < 256:
        size *= 2
    if size < length:
        size = -(-length // 256) * 256
    return max(length, min(size, most))


def mark_static(decoder: TransformerDecoder) -> None:
    """Tell CUDA graphs that the KV caches keep their address (no copy into the graph's own
    buffers at each replay). Unguarded: caches set up anew re-record the graph, never
    recompile it."""
    for cache in decoder.kv_caches():
        for tensor in (cache.k_cache, cache.v_cache, cache.fill):
            torch._dynamo.mark_static_address(tensor, guard=False)
