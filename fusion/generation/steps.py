"""The prefill and the decoding step, as plain functions: run eagerly, or under ``torch.compile``.

A decoding step sees the same shapes and Python constants at every step: the token [b], the
pad counts [b], the done flags [b] and the stop ids are tensors, and the cache slot it writes
is the KV cache's fill level, a device tensor. So a step compiles once (``fullgraph=True``),
never recompiles while decoding, reads nothing on the host, and can be captured in a CUDA
graph (``mode="reduce-overhead"``). Eager and compiled generation run the same functions.
"""

import contextlib
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fusion.decoder import KVCache, TransformerDecoder
from fusion.generation._checks import as_positive_int, show
from fusion.generation.padding import step_mask


def prefill_logits(
    call: nn.Module,
    decoder: TransformerDecoder,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    input_pos: torch.Tensor,
    extra: Mapping[str, Any],
) -> torch.Tensor:
    """Run the prompts [b, s] through ``call`` (the decoder, or a model around it, returning
    hidden states); float32 logits [b, vocab] of the last slot only: the output projection of
    the other slots (a [b, s, vocab] tensor) is never computed."""
    hidden = call(tokens, mask=mask, input_pos=input_pos, **extra)
    return _last_slot_logits(decoder, hidden)


def step_logits(
    call: nn.Module, decoder: TransformerDecoder, token: torch.Tensor, pad_counts: torch.Tensor
) -> torch.Tensor:
    """Feed one token [b] per sample; float32 logits [b, vocab] of the next one.

    The token goes to the cache slot after the fill level; its rotary position is that slot
    minus the sample's pad count, and it attends to the real slots up to its own."""
    cache = first_cache(decoder)
    slot = cache.fill  # a device tensor: no value read on the host, none baked into a graph
    mask = step_mask(pad_counts, slot, cache.max_seq_len)
    with _decoding_ops_as_reductions():
        hidden = call(token[:, None], mask=mask, input_pos=(slot - pad_counts)[:, None])
    return _last_slot_logits(decoder, hidden)


def _last_slot_logits(decoder: TransformerDecoder, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits [b, vocab] of the last slot of ``hidden`` [b, s, d]: a few rows through
    the largest matrix of all, as reductions when compiled, through oneDNN when eager."""
    mode: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if torch.compiler.is_compiling():
        mode = _DecodingOpsAsReductions()
    elif _ONEDNN_LINEAR is not None and hidden.device.type == "cpu":
        mode = _Float32LinearsInOneDNN()
    with mode:
        return decoder.unembed(hidden[:, -1])


FEW_ROWS = 16  # measured, float32: up to here the multiply-and-sum beats BLAS (1.3x at 16 rows)


class _DecodingOpsAsReductions(TorchFunctionMode):
    """Bias-free linear layers of one row (float32: up to ``FEW_ROWS``) and one-query attention
    on CPU, as multiplies and sums (not under autocast, whose casts they would skip).

    For a few rows, a linear layer costs reading its weight. On CPU, BLAS reads a ``[out, in]``
    weight at a fifth to a third of the memory bandwidth for 1 to 8 rows (measured, 32000 x 512
    fp32: 6.5 ms for one row, 11 ms for eight, against 2.0 ms for ``weight.sum()``), while
    inductor compiles the multiply-and-sum into one pass over the weight (2.0 ms for one row,
    4.4 ms for eight). One query's attention is an external call that inductor cannot fuse
    (about 45 us a layer in a decoding step on two cores); as multiplies, a softmax and sums it
    joins the kernels around it. Used only while compiling; the sums' order differs from
    BLAS' and SDPA's in the last bits.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.shape[:-1].numel()
            cpu = x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
            # float32: a few rows; other dtypes: one (bf16 BLAS is faster from 4 rows)
            few = rows == 1 or (1 < rows <= FEW_ROWS and weight.dtype == torch.float32)
            if bias is None and cpu and few:
                flat = x.reshape(rows, -1)
                if rows > 1:
                    # Pin the rows' layout to [rows, in]: left free, inductor may store them as
                    # [in, rows] and reduce each output in a parallel region of its own.
                    flat = flat.contiguous()
                    flat = flat.as_strided(flat.shape, (flat.size(1), 1))
                out = (weight[:, None, :] * flat).sum(-1)  # [out, rows]: weights read once
                return out.t().reshape(*x.shape[:-1], weight.size(0))
        elif func is F.scaled_dot_product_attention:
            out = _one_query_attention(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _one_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """``scaled_dot_product_attention`` of one query per head on CPU ``q`` [b, h, 1, hd] over
    ``k``, ``v`` [b, h_kv, L, hd] with a boolean mask, as plain ops, in float32 (as SDPA
    accumulates); None for any other case (the caller then calls SDPA itself)."""
    if not (
        q.device.type == "cpu"
        and q.dim() == k.dim() == v.dim() == 4
        and q.size(2) == 1
        and isinstance(attn_mask, torch.Tensor)
        and attn_mask.dtype == torch.bool
        and attn_mask.dim() == 4
        and dropout_p == 0.0
        and not is_causal
        and k.size(1) > 0
        and (q.size(1) == k.size(1) or (enable_gqa and q.size(1) % k.size(1) == 0))
    ):
        return None
    b, heads, _, head_dim = q.shape
    kv_heads, length = k.size(1), k.size(2)
    group = heads // kv_heads  # GQA: consecutive query heads share a key/value head
    scale = head_dim**-0.5 if scale is None else scale
    queries = q.float().reshape(b, kv_heads, group, 1, head_dim)
    scores = (queries * k.float()[:, :, None]).sum(-1) * scale  # [b, h_kv, g, L]
    mask = attn_mask.expand(b, heads, 1, length).reshape(b, kv_heads, group, length)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    weights = weights.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # as SDPA: no slot, zeros
    out = (weights[..., None] * v.float()[:, :, None]).sum(-2)  # [b, h_kv, g, hd]
    return out.reshape(b, heads, 1, head_dim).to(q.dtype)


# Private, but what inductor's own CPU linear fusions call; absent from builds without oneDNN.
# x86 with AVX2 or AVX-512 only, where oneDNN has its own kernels (measured on AVX-512).
_ONEDNN_LINEAR: Callable[..., torch.Tensor] | None = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if torch.backends.mkldnn.is_available()
    and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    else None
)


class _Float32LinearsInOneDNN(TorchFunctionMode):
    """Float32 linear layers of plain CPU tensors through oneDNN instead of BLAS, without
    autograd and outside autocast; anything else (other dtypes and devices, tensor subclasses
    such as DTensor, gradients) goes to ``F.linear`` unchanged.

    For the output projection, eager: on the AMD EPYC this was measured on, MKL reads a
    32000 x 512 weight at a third of the memory bandwidth for one row (6.0 ms against 3.0 ms
    through oneDNN), and oneDNN was faster for every output shape and row count tried (1.1x to
    3.7x; 8000 to 32000 x 128 to 512, 1 to 512 rows). Used for that one matrix only: with the
    layers' smaller ones too, whole generations were no faster. bfloat16 keeps ``F.linear``
    (generation 0.85x as fast through this op)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and not torch.is_grad_enabled():
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if not torch.is_autocast_enabled("cpu") and all(
                _plain_cpu_float32(t) for t in (x, weight, bias) if t is not None
            ):
                assert _ONEDNN_LINEAR is not None  # entered only when there is one
                return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
        return func(*args, **kwargs)


def _plain_cpu_float32(tensor: Any) -> bool:
    return (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.device.type == "cpu"
        and tensor.dtype == torch.float32
        and tensor.layout == torch.strided
    )


def _decoding_ops_as_reductions() -> contextlib.AbstractContextManager[object]:
    """:class:`_DecodingOpsAsReductions` while ``torch.compile`` traces; eagerly, nothing (the
    plain ops run one by one would be slower than BLAS and SDPA)."""
    return _DecodingOpsAsReductions() if torch.compiler.is_compiling() else contextlib.nullcontext()


def settle(
    token: torch.Tensor, done: torch.Tensor, stop: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples already done emit ``pad_id``; a sample is done once it has emitted a stop id.
    On the device: whether all are done is looked at by the caller, when it chooses."""
    token = token.masked_fill(done, pad_id)
    return token, done | torch.isin(token, stop)


def greedy_step(
    call: nn.Module,
    decoder: TransformerDecoder,
    token: torch.Tensor,
    pad_counts: torch.Tensor,
    done: torch.Tensor,
    stop: torch.Tensor,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    for eager generation.

    ``True`` means inductor with static shapes (``dynamic=False``) and, on CUDA, CUDA graphs
    (``mode="reduce-overhead"``). A mapping sets any of ``backend``, ``mode``, ``options``,
    ``dynamic`` and ``recompile_limit`` (default 64 per compiled function, where torch takes
    it; else torch's own limit applies); ``fullgraph`` is always True.

    Raises:
        ValueError: not a bool or a mapping; unknown keys; ``mode`` and ``options`` both set;
            values of the wrong type.
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
    for key, kind in (("mode", str), ("options", Mapping)):
        if options.get(key) is not None and not isinstance(options[key], kind):
            raise ValueError(
                f"compile: {key}: expected a {kind.__name__}, got {show(options[key])}"
            )
    if options.get("mode") is not None and options.get("options") is not None:
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
    if (
        backend == "inductor"
        and device.type == "cuda"
        and options.get("mode") is None
        and options.get("options") is None
    ):
        options["mode"] = "reduce-overhead"  # CUDA graphs: a decoding step is launch-bound
    if options.get("options") is not None:
        options["options"] = dict(options["options"])
    return options


def compiled_steps(options: dict[str, Any]) -> Steps:
    """The step functions compiled with ``options`` (from :func:`compile_options`).

    Raises:
        ValueError: ``torch.compile`` refuses the options (an unknown backend or mode).
    """
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
