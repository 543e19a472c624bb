"""Embedding-merge implementations side by side, against the floor of copying the output once.

For every case (tokens, embedding dim, placeholder fraction, forward or forward+backward) and
every contestant (the floor ``copy``, each implementation of :func:`fusion.merge_embeddings`
that runs on the device, ``auto`` (what the default picks for the case), and the baselines
``bool_index`` and ``torchtune``), it reports the median time, the effective bandwidth
(output written once plus its source rows read once: 2 x output bytes, forward only), the
ratio to ``copy`` measured in the same run, the speedup over ``reference``, the peak
transient memory beyond what the call returns, and whether the contestant synchronises with
the host. Apart from the timings it lists each contestant's first call in the run.

    python benchmarks/merge_kernels.py                # the default sweep for the device
    python benchmarks/merge_kernels.py --target       # the CPU/GPU target case only
    python benchmarks/merge_kernels.py --quick        # seconds: checks that the script works

Timing: ``torch.utils.benchmark.Timer`` on CPU, ``triton.testing.do_bench`` (CUDA events) on
GPU; see :func:`measure`. Each contestant reports the median over rounds of its time, and its
ratios (to ``copy``, ``reference`` over it) as the median over rounds of the ratio within the
round, so load on shared cores, which drifts, cancels out as far as it can. On CPU every
output is fresh memory for every contestant (:func:`fix_mmap_threshold`).

Transient memory: on GPU ``torch.cuda.max_memory_allocated`` minus what stays allocated after
the call; on CPU the same quantity from the profiler's allocator events (every allocation
and free of the CPU allocator, ``profile_memory=True``), summed in time order.

Host synchronisation: on GPU, ``torch.cuda.set_sync_debug_mode("error")`` around the call.
On CPU nothing synchronises, so the script records instead, with a dispatch mode, every op
that would synchronise on an accelerator: ops whose output shape or value depends on the data
(``nonzero``, ``masked_select``, ``.item()``, ...) and boolean-mask indexing. For the fusion
implementations this probes the implementation itself, after the shared input validation
(which is sync-free on accelerators and eager on CPU by design).

Output: a table on stdout, ``merge_kernels.json`` (machine, settings, results, targets) and
``merge_kernels.png`` in ``--out``. Needs the ``bench`` extra (matplotlib, tqdm).
"""

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from common import add_out_argument, machine, output_dir
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.benchmark import Timer

from fusion.merge import IMPLEMENTATIONS, default_impl, merge_embeddings
from fusion.merge.fused import fused_supported, merge_fused
from fusion.merge.index import merge_index
from fusion.merge.placement import Placement, resolve_placements
from fusion.merge.reference import merge_reference

BASELINES = ("index_table", "bool_index", "torchtune")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Case:
    tokens: int
    dim: int
    fraction: float
    mode: str  # "fwd" or "fwd+bwd"


@dataclasses.dataclass
class Inputs:
    """One case's tensors; ``placements`` and ``text_ids`` are resolved once for the probes."""

    tokens: torch.Tensor  # [b, s]
    weight: torch.Tensor  # [vocab, d]
    embedding: torch.nn.Embedding  # holds ``weight``: the module the fusion contestants call
    rows: dict[str, torch.Tensor]  # packed, [n_rows, d] per encoder
    encoder_tokens: dict[str, int]
    source: torch.Tensor  # [b, s, d]: what `copy` copies
    grad: torch.Tensor  # [b, s, d]: the output gradient of fwd+bwd
    placements: list[Placement]
    text_ids: torch.Tensor


# ------------------------------------------------------------------ inputs


def placeholder_mask(
    batch: int, seq_len: int, fraction: float, block: int, pattern: str, gen: torch.Generator
) -> torch.Tensor:
    """[b, s] bool: ``round(fraction * s)`` placeholders per sample, in contiguous blocks of at
    most ``block`` tokens spread evenly (``pattern="blocks"``, like images), or at random
    positions (``"scattered"``)."""
    count = round(fraction * seq_len)
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    if pattern == "scattered":
        for i in range(batch):
            mask[i, torch.randperm(seq_len, generator=gen)[:count]] = True
        return mask
    n_blocks = math.ceil(count / block) if count else 0
    gap = (seq_len - count) / (n_blocks + 1)
    start, placed = 0.0, 0
    for _ in range(n_blocks):
        length = min(block, count - placed)
        start += gap
        first = round(start) + placed
        mask[:, first : first + length] = True
        placed += length
    return mask


def make_inputs(case: Case, args: argparse.Namespace, device: torch.device) -> Inputs:
    dtype = DTYPES[args.dtype]
    seq_len = min(case.tokens, args.seq_len)
    batch = max(1, case.tokens // seq_len)
    gen = torch.Generator().manual_seed(args.seed)
    is_placeholder = placeholder_mask(batch, seq_len, case.fraction, args.block, args.pattern, gen)
    # Encoders take the blocks of each sample in turn; placeholder ids lie outside the vocab.
    which = (is_placeholder.cumsum(1) - 1) // args.block % args.encoders
    tokens = torch.randint(0, args.vocab, (batch, seq_len), generator=gen)
    tokens = torch.where(is_placeholder, args.vocab + which, tokens)
    names = [f"enc{e}" for e in range(args.encoders)]
    encoder_tokens = {name: args.vocab + e for e, name in enumerate(names)}
    weight = torch.randn(args.vocab, case.dim, generator=gen).to(dtype)
    rows = {
        name: torch.randn(int((tokens == i).sum()), case.dim, generator=gen).to(dtype)
        for name, i in encoder_tokens.items()
    }
    tokens, weight = tokens.to(device), weight.to(device)
    rows = {name: r.to(device) for name, r in rows.items()}
    source = torch.randn(batch, seq_len, case.dim, generator=gen).to(dtype).to(device)
    grad = torch.randn(batch, seq_len, case.dim, generator=gen).to(dtype).to(device)
    train = case.mode == "fwd+bwd"
    embedding = torch.nn.Embedding(args.vocab, case.dim, _weight=weight, _freeze=not train)
    weight = embedding.weight  # one table for every contestant: the module's own parameter
    if train:
        source.requires_grad_()
        for r in rows.values():
            r.requires_grad_()
    with torch.no_grad():
        placements, text_ids = resolve_placements(
            tokens, rows, encoder_tokens, vocab_size=args.vocab, eager_checks=None
        )
    return Inputs(
        tokens, weight, embedding, rows, encoder_tokens, source, grad, placements, text_ids
    )


# ------------------------------------------------------------------ contestants


def index_table(inp: Inputs) -> torch.Tensor:
    """``merge_embeddings(weight, impl="index")`` as it was before it called the embedding
    module: the same validation, then ``F.embedding`` of the table over flat ids plus one
    spill row, then ``index_copy_``. The module path must cost no more than this."""
    placements, text_ids = resolve_placements(
        inp.tokens, inp.rows, inp.encoder_tokens, vocab_size=inp.weight.size(0), eager_checks=None
    )
    return _index_table_core(text_ids, inp.weight, placements)


def _index_table_core(
    text_ids: torch.Tensor, weight: torch.Tensor, placements: list[Placement]
) -> torch.Tensor:
    batch, seq_len = text_ids.shape
    ids = torch.cat([text_ids.reshape(-1), text_ids.new_zeros(1)])
    out = F.embedding(ids, weight)
    for p in placements:
        out.index_copy_(0, p.destinations(), p.rows)
    return out[: batch * seq_len].view(batch, seq_len, -1)


def bool_index(inp: Inputs) -> torch.Tensor:
    """Embed everything, then boolean-index assignment per encoder (synchronises on CUDA)."""
    masks = {name: inp.tokens == i for name, i in inp.encoder_tokens.items()}
    text_ids = inp.tokens.masked_fill(torch.stack(list(masks.values())).any(0), 0)
    embeds = F.embedding(text_ids, inp.weight)
    for name, mask in masks.items():
        embeds[mask] = inp.rows[name]
    return embeds


def torchtune(inp: Inputs) -> torch.Tensor:
    """torchtune's early-fusion pattern: ``masked_select`` the text tokens, embed them, then
    ``masked_scatter`` the text rows and each encoder's rows into an empty output."""
    batch, seq_len = inp.tokens.shape
    shape = (batch, seq_len, inp.weight.size(1))
    masks = {name: inp.tokens == i for name, i in inp.encoder_tokens.items()}
    is_text = ~torch.stack(list(masks.values())).any(0)
    text_embeds = F.embedding(torch.masked_select(inp.tokens, is_text), inp.weight)
    out = inp.weight.new_empty(shape)
    out = out.masked_scatter(is_text[..., None].expand(shape), text_embeds)
    for name, mask in masks.items():
        out = out.masked_scatter(mask[..., None].expand(shape), inp.rows[name])
    return out


def auto_picks(inp: Inputs) -> str:
    return default_impl(inp.tokens.device, inp.embedding)


def contestants(
    device: torch.device, dtype: torch.dtype, wanted: list[str] | None
) -> dict[str, tuple[Callable[[Inputs], torch.Tensor], Callable[[Inputs], torch.Tensor]]]:
    """name -> (the timed call, the call probed for host synchronisation)."""
    found: dict = {"copy": (lambda inp: inp.source.clone(), lambda inp: inp.source.clone())}
    cores = {
        "reference": lambda inp: merge_reference(inp.text_ids, inp.embedding, inp.placements),
        "index": lambda inp: merge_index(inp.text_ids, inp.embedding, inp.placements),
        "fused": lambda inp: merge_fused(inp.text_ids, inp.weight, inp.placements),
    }
    for name in (*IMPLEMENTATIONS, "auto"):
        if name == "fused" and not fused_supported(device, dtype):
            continue  # Triton runs on CPU only through its interpreter: not worth timing

        def public(inp: Inputs, name: str = name) -> torch.Tensor:
            return merge_embeddings(
                inp.tokens, inp.embedding, inp.rows, inp.encoder_tokens, impl=name
            )

        def core(inp: Inputs, name: str = name) -> torch.Tensor:
            if name == "auto":  # what auto picks for this case
                name = auto_picks(inp)
            return cores[name](inp)

        found[name] = (public, core)
    found["index_table"] = (
        index_table,
        lambda inp: _index_table_core(inp.text_ids, inp.weight, inp.placements),
    )
    found["bool_index"] = (bool_index, bool_index)
    found["torchtune"] = (torchtune, torchtune)
    if wanted:
        unknown = sorted(set(wanted) - set(found))
        if unknown:
            raise SystemExit(f"--impls: unknown or unavailable here: {unknown}; have {list(found)}")
        found = {k: v for k, v in found.items() if k in wanted or k == "copy"}
    return found


# ------------------------------------------------------------------ measurements


def fix_mmap_threshold() -> str:
    """Fix glibc's mmap threshold at its initial 128 KiB (CPU runs), and say what was done.

    glibc raises the threshold (up to 32 MiB) each time a mapped block is freed, and reuses
    freed heap blocks of any size: whether an output is fresh memory, whose every page faults
    on first touch, or warm reused memory then depends on what the previous contestant freed
    (in one run: 9.5% between two calls of the same code, 1.6x between ``index`` and
    ``index_table``). Fixed, every output of 128 KiB or more is fresh memory for every
    contestant, as outputs above 32 MiB always are.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return "allocator as is (not glibc)"
    if mallopt(-3, 128 << 10) != 1:  # -3: M_MMAP_THRESHOLD
        return "allocator as is (mallopt failed)"
    return "glibc M_MMAP_THRESHOLD fixed at 128 KiB: every output is fresh memory"


def measure(calls: dict[str, Callable[[], object]], device: torch.device, args) -> dict:
    """name -> seconds per call, one value per round; contestants interleaved in each round.

    GPU: ``do_bench`` (CUDA events, median of its repetitions). CPU: ``Timer.timeit`` of a
    fixed number of calls (about ``--min-run-time`` seconds), the contestants back to back in
    an order that alternates between rounds, so drift in the shared cores' load hits every
    contestant of a round alike and per-round ratios stay comparable.
    """
    times: dict[str, list[float]] = {name: [] for name in calls}
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:  # CUDA without Triton: torch's Timer, which synchronises
            do_bench = None
        if do_bench is not None:
            for _ in range(args.rounds):
                for name, call in calls.items():
                    ms = do_bench(call, warmup=25, rep=args.rep_ms, return_mode="median")
                    times[name].append(ms / 1e3)
            return times
    threads = torch.get_num_threads()
    timers = {
        name: Timer("call()", globals={"call": call}, num_threads=threads)
        for name, call in calls.items()
    }
    number = {}
    for name, timer in timers.items():
        timer.timeit(1)  # warm-up
        once = timer.timeit(1).median
        number[name] = max(1, round(args.min_run_time / max(once, 1e-9)))
    names = list(timers)
    for i in range(args.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(timers[name].timeit(number[name]).median)
    return times


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The profiler's C++ side prints start/stop lines on file descriptor 2: drop them."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def transient_bytes(call: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated during ``call`` beyond what is still allocated when it returns."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = call()
        torch.cuda.synchronize()
        peak, final = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
        del result
        return peak - final
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()  # kept alive past the profile: its bytes count as the result
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    del result
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak - live


def sync_ops(core: Callable[[Inputs], torch.Tensor], inp: Inputs, call, device) -> list[str]:
    """What synchronises with the host (empty when nothing): on GPU the error of CUDA's sync
    debug mode around ``call``; on CPU the ops of ``core`` that :class:`_SyncProbe` records."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        except RuntimeError as e:
            if "synchroniz" not in str(e):
                raise
            return [str(e).splitlines()[0]]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return []
    probe = _SyncProbe()
    with probe:
        core(inp)
    return sorted(set(probe.found))


class _SyncProbe(TorchDispatchMode):
    """Records every op that synchronises on an accelerator: ops whose output shape or value
    depends on the data (tagged ``dynamic_output_shape`` or ``data_dependent_output``:
    ``nonzero``, ``masked_select``, ``.item()``, ...) and indexing with a boolean mask, which
    runs ``nonzero`` inside the kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tags = set(func.tags)
        indexing = func.overloadpacket in _INDEXING
        bool_index = indexing and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ())
        )
        # Indexing is tagged dynamic_output_shape for its boolean masks only: integer indices
        # give a static shape and read no value on the host.
        if (tags & _DATA_DEPENDENT and not indexing) or bool_index:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


_DATA_DEPENDENT = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
_INDEXING = {torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_}


def check_outputs(found: dict, inp: Inputs) -> None:
    """Every contestant must return the reference's bits before it is timed."""
    with torch.no_grad():
        expected = merge_embeddings(
            inp.tokens, inp.weight, inp.rows, inp.encoder_tokens, impl="reference"
        )
        for name, (fn, _) in found.items():
            if name != "copy" and not torch.equal(fn(inp), expected):
                raise AssertionError(f"{name} differs from reference")


# ------------------------------------------------------------------ the sweep


def cases(args: argparse.Namespace) -> list[Case]:
    grid = [
        Case(t, d, f, mode)
        for mode in args.modes
        for t, d, f in itertools.product(args.tokens, args.dims, args.fractions)
    ]
    if args.target_case:
        t, d, f = args.target_case
        grid += [Case(t, d, f, mode) for mode in args.modes]
    size = DTYPES[args.dtype].itemsize
    grid = [
        c
        for c in grid
        if c.mode == "fwd"
        or args.bwd_max_mib is None
        or c.tokens * c.dim * size <= args.bwd_max_mib * MIB
    ]
    return list(dict.fromkeys(grid))


def run_case(case: Case, args, device: torch.device, found: dict) -> list[dict]:
    inp = make_inputs(case, args, device)
    calls = {}
    for name, (fn, _) in found.items():
        if case.mode == "fwd":
            calls[name] = lambda fn=fn: fn(inp)
        else:  # gradients w.r.t. the table and the rows, returned (never accumulated)
            leaves = [inp.source] if name == "copy" else [inp.weight, *inp.rows.values()]
            calls[name] = lambda fn=fn, leaves=leaves: torch.autograd.grad(
                fn(inp), leaves, inp.grad
            )
    first = {name: first_call_seconds(call, device) for name, call in calls.items()}
    check_outputs(found, inp)
    times = measure(calls, device, args)
    out_bytes = inp.source.numel() * inp.source.element_size()
    medians = {name: statistics.median(t) for name, t in times.items()}
    results = []
    for name, call in calls.items():
        transient = transient_bytes(call, device)
        syncs = sync_ops(found[name][1], inp, call, device)
        seconds = medians[name]
        results.append(
            {
                **dataclasses.asdict(case),
                "impl": name,
                "median_ms": seconds * 1e3,
                # The first call of this contestant in this case (the first in the run
                # includes one-time work, e.g. the fused kernel's compilation).
                "first_call_ms": first[name] * 1e3,
                "auto_picks": auto_picks(inp),
                "round_ms": [t * 1e3 for t in times[name]],
                "min_ms": min(times[name]) * 1e3,
                "ratio_to_copy_of_minimums": min(times[name]) / min(times["copy"]),
                "bandwidth_gbs": 2 * out_bytes / seconds / 1e9 if case.mode == "fwd" else None,
                "ratio_to_copy": paired(times[name], times["copy"]),
                "speedup_over_reference": (
                    paired(times["reference"], times[name]) if "reference" in times else None
                ),
                "output_bytes": out_bytes,
                "transient_bytes": transient,
                "transient_pct_of_output": 100 * transient / out_bytes,
                "synchronises": bool(syncs),
                "sync_ops": syncs,
            }
        )
    return results


def first_call_seconds(call: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def paired(numerator: list[float], denominator: list[float]) -> float:
    """The median over rounds of the ratio within each round."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def evaluate_targets(results: list[dict], device: torch.device, dtype: str) -> list[dict]:
    """The targets (see ``benchmarks/README.md``), where the sweep holds their case: CPU fp32
    16k tokens x 2048 and GPU bf16 32k x 4096, 25% placeholders in image blocks."""

    def pick(tokens, dim, fraction, impl):
        for r in results:
            key = (r["tokens"], r["dim"], r["fraction"], r["mode"], r["impl"])
            if key == (tokens, dim, fraction, "fwd", impl):
                return r
        return None

    targets = []
    if device.type == "cpu" and dtype == "fp32":
        # The default is the `auto` contestant; without it, the implementation auto picks.
        d = pick(16384, 2048, 0.25, "auto") or next(
            (pick(16384, 2048, 0.25, r["auto_picks"]) for r in results), None
        )
        ref, tt = pick(16384, 2048, 0.25, "reference"), pick(16384, 2048, 0.25, "torchtune")
        if d and ref and tt:
            case = f"cpu fp32 16384x2048 25% blocks, default {d['impl']!r} ({d['auto_picks']!r})"
            targets += [
                _target(
                    case,
                    "time / copy",
                    d["ratio_to_copy"],
                    "<=",
                    1.1,
                    d["ratio_to_copy_of_minimums"],
                ),
                _target(
                    case,
                    "reference / default",
                    d["speedup_over_reference"],
                    ">=",
                    2.5,
                    ref["min_ms"] / d["min_ms"],
                ),
                _target(
                    case,
                    "torchtune / default",
                    paired(tt["round_ms"], d["round_ms"]),
                    ">=",
                    4.0,
                    tt["min_ms"] / d["min_ms"],
                ),
                _target(case, "transient % of output", d["transient_pct_of_output"], "<=", 1.0),
            ]
        index, table = pick(16384, 2048, 0.25, "index"), pick(16384, 2048, 0.25, "index_table")
        if index and table:  # the embedding module called vs the table read (same validation)
            targets.append(
                _target(
                    "cpu fp32 16384x2048 25% blocks",
                    "index (module) / index_table",
                    paired(index["round_ms"], table["round_ms"]),
                    "<=",
                    1.05,
                    index["min_ms"] / table["min_ms"],
                )
            )
    targets += _auto_against_index(results)
    if device.type == "cuda" and dtype == "bf16":
        fused, copy = pick(32768, 4096, 0.25, "fused"), pick(32768, 4096, 0.25, "copy")
        if fused and copy:
            ratio = fused["bandwidth_gbs"] / copy["bandwidth_gbs"]
            targets.append(
                _target("cuda bf16 32768x4096 25%", "fused / copy bandwidth", ratio, ">=", 0.8)
            )
    return targets


def _auto_against_index(results: list[dict]) -> list[dict]:
    """``auto`` against ``index`` over every case that timed both, paired: where auto picks
    another implementation it must not be slower (<= 1.0), where it keeps ``index`` at most
    1.02x (the cost of choosing). The worst case of each kind is the value."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in results:
        by_case.setdefault((r["tokens"], r["dim"], r["fraction"], r["mode"]), {})[r["impl"]] = r
    worst: dict[str, tuple[float, tuple]] = {}
    for key, rows in by_case.items():
        if "auto" in rows and "index" in rows:
            kind = "index" if rows["auto"]["auto_picks"] == "index" else "other"
            ratio = paired(rows["auto"]["round_ms"], rows["index"]["round_ms"])
            if kind not in worst or ratio > worst[kind][0]:
                worst[kind] = (ratio, key)
    targets = []
    for kind, bound in (("other", 1.0), ("index", 1.02)):
        if kind in worst:
            ratio, (tokens, dim, fraction, mode) = worst[kind]
            where = "picks another" if kind == "other" else "keeps index"
            targets.append(
                _target(
                    f"every case where auto {where} (worst: {mode} {tokens}x{dim} {fraction:.0%})",
                    "auto / index",
                    ratio,
                    "<=",
                    bound,
                )
            )
    return targets


def _target(
    case: str, what: str, value: float, op: str, bound: float, of_minimums: float | None = None
) -> dict:
    met = value <= bound if op == "<=" else value >= bound
    return {
        "case": case,
        "what": what,
        "value": value,
        "target": f"{op} {bound}",
        "met": met,
        "value_of_minimums": of_minimums,
    }


def table(results: list[dict]) -> str:
    head = (
        f"{'mode':8} {'tokens':>6} {'dim':>5} {'frac':>5} {'impl':10} {'ms':>9} {'GB/s':>6} "
        f"{'x copy':>6} {'x ref':>6} {'transient':>13} {'sync':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        bw = f"{r['bandwidth_gbs']:6.1f}" if r["bandwidth_gbs"] is not None else f"{'-':>6}"
        ref = r["speedup_over_reference"]
        lines.append(
            f"{r['mode']:8} {r['tokens']:>6} {r['dim']:>5} {r['fraction']:>5.2f} {r['impl']:10} "
            f"{r['median_ms']:9.3f} {bw} {r['ratio_to_copy']:6.2f} "
            f"{(f'{ref:6.2f}' if ref else '-'):>6} "
            f"{r['transient_bytes'] / MIB:7.2f} MiB {r['transient_pct_of_output']:3.0f}% "
            f"{'yes' if r['synchronises'] else 'no':>4}"
        )
    return "\n".join(lines)


def first_calls(results: list[dict]) -> str:
    """Apart from the timings: the first call of each contestant in the run (one-time work such
    as compiling the fused kernel) against its median call."""
    lines = ["first call in the run, vs its median:"]
    seen = set()
    for r in results:
        if r["impl"] in seen or r["impl"] == "copy":
            continue
        seen.add(r["impl"])
        lines.append(
            f"  {r['impl']:10} {r['first_call_ms'] / 1e3:8.2f} s  (median {r['median_ms']:.3f} "
            f"ms; {r['mode']} {r['tokens']}x{r['dim']} {r['fraction']:.0%})"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in results}, key=["fwd", "fwd+bwd"].index)
    fractions = sorted({r["fraction"] for r in results})
    impls = list(dict.fromkeys(r["impl"] for r in results))
    fig, axes = plt.subplots(
        len(modes), len(fractions), figsize=(4 * len(fractions), 3.4 * len(modes)), squeeze=False
    )
    for (i, mode), (j, fraction) in itertools.product(enumerate(modes), enumerate(fractions)):
        ax = axes[i][j]
        if not any(r["mode"] == mode and r["fraction"] == fraction for r in results):
            ax.set_visible(False)  # e.g. the target case, timed forward only
            continue
        for impl in impls:
            points = sorted(
                (r["output_bytes"] / MIB, r["ratio_to_copy"])
                for r in results
                if r["mode"] == mode and r["fraction"] == fraction and r["impl"] == impl
            )
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_title(f"{mode}, {fraction:.0%} placeholders", fontsize=9)
        ax.set_xlabel("output MiB")
        ax.set_ylabel("time / copy")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA"
    )
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--dims", type=int, nargs="+", default=None)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.1, 0.5, 0.9])
    p.add_argument("--modes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"])
    p.add_argument("--impls", nargs="+", default=None, help="contestants (copy always runs)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=4096, help="sample length; batch = tokens / it")
    p.add_argument("--block", type=int, default=256, help="placeholder block (image) length")
    p.add_argument("--pattern", choices=["blocks", "scattered"], default="blocks")
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None, help="default: 11 on CPU, 3 on GPU")
    p.add_argument("--min-run-time", type=float, default=0.05, help="CPU: seconds per timing")
    p.add_argument("--rep-ms", type=int, default=100, help="GPU: do_bench repetition time")
    p.add_argument("--bwd-max-mib", type=float, default=None, help="skip larger fwd+bwd cases")
    p.add_argument(
        "--target",
        action="store_true",
        help="only the target case (CPU: fp32 16384 x 2048, GPU: bf16 32768 x 4096, 25%%)",
    )
    p.add_argument("--quick", action="store_true", help="a tiny sweep that checks the script")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_out_argument(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--dynamic-mmap-threshold",
        action="store_true",
        help="CPU: leave glibc's adaptive mmap threshold on (see fix_mmap_threshold)",
    )
    args = p.parse_args(argv)
    args.out = output_dir(args.out, check=args.quick or args.target)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = args.device.type == "cuda"
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    args.rounds = args.rounds or (3 if gpu else 11)
    target = (32768, 4096, 0.25) if gpu else (16384, 2048, 0.25)
    args.target_case = target
    if args.quick:
        args.tokens, args.dims, args.fractions = [256], [64], [0.0, 0.5]
        args.vocab, args.block, args.rounds, args.min_run_time, args.rep_ms = 500, 32, 2, 0.005, 5
        args.target_case = None
    elif args.target:
        args.tokens, args.dims, args.fractions, args.modes = [], [], [], ["fwd"]
    else:
        args.tokens = args.tokens or (
            [1024, 4096, 16384, 32768, 65536] if gpu else [1024, 4096, 16384]
        )
        args.dims = args.dims or ([1024, 2048, 4096, 8192] if gpu else [1024, 2048, 4096])
        if args.bwd_max_mib is None and not gpu:
            args.bwd_max_mib = 32.0  # CPU: the dense [vocab, d] table gradient dominates anyway
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        from tqdm import tqdm
    except ImportError:
        raise SystemExit(
            "the benchmark needs matplotlib and tqdm (the bench extra): pip install matplotlib tqdm"
        ) from None
    device = args.device
    info = machine(device, ("triton",))  # at the start
    info["THP_MEM_ALLOC_ENABLE"] = os.environ.get("THP_MEM_ALLOC_ENABLE")
    if device.type == "cpu" and not args.dynamic_mmap_threshold:
        info["allocator"] = fix_mmap_threshold()
    dtype = DTYPES[args.dtype]
    found = contestants(device, dtype, args.impls)
    todo = cases(args)
    results: list[dict] = []
    for case in tqdm(todo, desc="merge cases", disable=args.no_progress, file=sys.stderr):
        results += run_case(case, args, device, found)
    info["load_average_end"] = os.getloadavg()
    settings = {
        k: (str(v) if isinstance(v, (Path, torch.device)) else v) for k, v in vars(args).items()
    }
    # What auto picks for a plain table on the device; per case in `auto_picks`.
    settings["default_impl"] = default_impl(device, torch.nn.Embedding(1, 1, dtype=dtype))
    targets = evaluate_targets(results, device, args.dtype)
    report = {"machine": info, "settings": settings, "results": results, "targets": targets}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "merge_kernels.json").write_text(json.dumps(report, indent=1))
    where = info.get("gpu") or info["cpu"]
    title = f"{where}, {args.dtype}, {args.pattern}, default {settings['default_impl']!r}"
    plot(results, args.out / "merge_kernels.png", title)
    print(table(results))
    print(first_calls(results))
    for t in targets:
        verdict = "met" if t["met"] else "MISSED"
        of_min = t["value_of_minimums"]
        extra = f" [of per-contestant minimums: {of_min:.3f}]" if of_min is not None else ""
        print(
            f"target {t['case']}: {t['what']} = {t['value']:.3f} ({t['target']}): {verdict}{extra}"
        )
    print(f"wrote {args.out / 'merge_kernels.json'} and {args.out / 'merge_kernels.png'}")
    return report


if __name__ == "__main__":
    main()
