"""The GPU checks of the fused merge, in one short script (about a minute on an H200).

    python benchmarks/gpu_check.py                 # CUDA + Triton: the GPU target case
    python benchmarks/gpu_check.py --cpu-smoke     # no GPU: the same code paths, tiny, on
                                                   # Triton's interpreter (timings meaningless)

On the GPU target case (bf16, 32k tokens x 4096, 25% placeholders in image blocks) it checks:

1. bits: ``fused`` and ``index`` equal ``reference``, forward and gradients (table and rows).
2. bandwidth: the fused kernel alone (metadata prepared, output preallocated) and the whole
   ``merge_embeddings(impl="fused")`` call, against a device-to-device copy of the output
   (``copy_`` into a preallocated tensor), all timed with ``triton.testing.do_bench``;
   bytes moved = 2 x output bytes. Target: the kernel at >= 80% of the copy's bandwidth.
   Also ``index`` and ``reference``, and a small sweep of kernel launch configurations.
3. no host synchronisation: each merge under ``torch.cuda.set_sync_debug_mode("error")``.
4. CUDA graphs: the merge captured in a graph, replayed on new tokens and rows written into
   the captured inputs, equal to eager.
5. packed attention (``--packed-only``: this check alone, no Triton needed): the packing
   property on every packed-attention path of ``fusion.decoder.packed_attention`` that runs
   here (CUDA: the dense ``mask``, per-sample ``sdpa``, ``flex``, ``varlen``; ``--cpu-smoke``:
   ``mask`` and ``sdpa``), fp32 and bf16 autocast: a 2-layer decoder of SmolVLM-256M's text
   shape on 2 packed rows of 2048 tokens (LLaVA-Instruct-like samples, as
   ``packed_attention.py``'s), each sample's logits against the sample alone (fp32 within
   1e-4; bf16 within 3% of the largest logit, kernels round differently), in fp32 also the
   batch's gradients against the sum of the samples' (within 1e-4 + 1e-3 of the largest
   gradient of each parameter); the forward+backward time of each path;
   whether a warm forward+backward synchronises (reported, not a failure).
6. Gated DeltaNet on FLA (``--deltanet-only``: this check alone): the packed path of a
   Qwen3.5-0.8B-wide ``GatedDeltaNet`` (1024 wide, 16/16 heads of 128, kernel 4, as
   ``deltanet_layer.py``'s) on 2 packed rows of 2048 tokens with flash-linear-attention's
   varlen kernel (``delta_rule_backend="fla"``) against the pure-torch kernel (``"torch"``),
   fp32 (Triton's products in IEEE fp32, ``TRITON_F32_DEFAULT=ieee`` unless set: tf32 would
   differ by ~1e-3) and bf16 autocast: the output and the gradients of the input and of every
   parameter, each within 1e-4 + 1e-3 of its largest magnitude in fp32, 3% in bf16; the
   gradients reached only through the decay (``A_log``, ``dt_bias``, ``in_proj_a``) within 3%
   in fp32 too (FLA's decay gradient loses precision at strong decays: 0.6% of the largest
   under Triton's interpreter, the torch kernel 1e-4 of it); the forward+backward time of each
   backend; whether a warm forward+backward synchronises (reported). Without FLA: "skipped:
   flash-linear-attention not installed". ``--cpu-smoke``: the tiny layer, the torch kernel
   against itself (FLA needs CUDA).
7. fused loss (issue 40's GPU mode): ``fusion.fused_token_loss`` against
   ``fusion.chunked_token_loss`` on 8192 rows of 2048 into a 151,936-word vocabulary (half
   of them targets), with a tied output (its weight read) and an untied one (an ``nn.Linear``
   called as a module), fp32 and bf16 autocast: the loss and the gradients of the hidden
   states and the output within 1e-5 (fp32) or 2% (bf16) relative to the largest; the
   forward+backward time and the peak memory of each; whether a warm step synchronises
   (reported). ``--cpu-smoke``: 64 rows of 16 into 97 words.

Prints a summary and writes ``gpu_check.json`` to ``--out``; exits 1 when a check fails.
"""

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import merge_kernels as mk  # benchmarks/ is on sys.path when this file runs as a script
import packed_attention as pab
import torch
from common import add_out_argument, output_dir

from fusion import chunked_token_loss, fused_token_loss, masked_token_loss
from fusion.decoder import PackedSegments
from fusion.decoder.packed_attention import resolve_backend

BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CONFIGS = [  # (BLOCK_R, BLOCK_D, num_warps)
    (1, 4096, 8),
    (2, 2048, 4),
    (4, 2048, 4),
    (4, 2048, 8),
    (8, 1024, 4),
    (8, 2048, 8),
    (16, 1024, 8),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--dtype", choices=sorted(mk.DTYPES), default="bf16")
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny, on the interpreter")
    p.add_argument("--packed-only", action="store_true", help="the packed-attention check only")
    p.add_argument("--deltanet-only", action="store_true", help="the Gated DeltaNet check only")
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.packed_only and args.deltanet_only:
        p.error("--packed-only, --deltanet-only: expected one of them at most")
    args.out = output_dir(args.out, check=args.cpu_smoke)
    bench = mk.parse_args(["--quick"] if args.cpu_smoke else [])
    bench.dtype = args.dtype
    if args.cpu_smoke:
        args.tokens, args.dim = 64, 16
        bench.block = 8
    args.bench = bench
    return args


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(BITS[a.element_size()]), b.view(BITS[b.element_size()]))
    )


def merge(inp: mk.Inputs, impl: str, rows: dict | None = None) -> torch.Tensor:
    return mk.merge_embeddings(
        inp.tokens, inp.weight, rows or inp.rows, inp.encoder_tokens, impl=impl
    )


def check_bits(inp: mk.Inputs) -> dict:
    grad = inp.grad
    results = {}

    def run(impl: str):
        weight = inp.weight.detach().clone().requires_grad_()
        rows = {k: v.detach().clone().requires_grad_() for k, v in inp.rows.items()}
        out = mk.merge_embeddings(inp.tokens, weight, rows, inp.encoder_tokens, impl=impl)
        grads = torch.autograd.grad(out, [weight, *rows.values()], grad)
        return [out.detach(), *grads]

    expected = run("reference")
    for impl in ("index", "fused"):
        actual = run(impl)
        results[impl] = all(bitwise_equal(a, e) for a, e in zip(actual, expected, strict=True))
    return results


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median seconds of a call: do_bench (CUDA events, L2 flushed) on GPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
    from torch.utils.benchmark import Timer

    return lambda fn: Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.05).median


def check_bandwidth(inp: mk.Inputs, device: torch.device) -> dict:
    from fusion.merge import fused

    time_of = timer(device)
    with torch.no_grad():
        src = inp.source.detach()
        out = torch.empty_like(src).view(-1, src.size(-1))
        out_bytes = src.numel() * src.element_size()
        # The kernel's inputs, prepared the way merge_fused prepares them.
        n = inp.text_ids.numel()
        source = torch.full((n + 1,), -1, dtype=torch.int64, device=device)
        start, rows = 0, []
        for p in inp.placements:
            dest = p.destinations()
            source.index_copy_(0, dest, torch.arange(start, start + p.rows.size(0), device=device))
            start += p.rows.size(0)
            rows.append(p.rows.detach())
        weight, text_ids = inp.weight.detach(), inp.text_ids.reshape(-1)
        plain = {k: v.detach() for k, v in inp.rows.items()}
        calls = {
            "copy_ (d2d)": lambda: out.copy_(src.view_as(out)),
            "fused kernel": lambda: fused.launch(out, weight, text_ids, source[:n], rows),
            "merge_embeddings fused": lambda: merge(inp, "fused", plain),
            "merge_embeddings index": lambda: merge(inp, "index", plain),
            "merge_embeddings reference": lambda: merge(inp, "reference", plain),
        }
        seconds = {name: time_of(fn) for name, fn in calls.items()}
        fused.launch(out, weight, text_ids, source[:n], rows)
        if not bitwise_equal(out.view_as(src), merge(inp, "reference", plain)):
            raise AssertionError("the fused kernel launched directly differs from reference")
        configs = {}
        for config in CONFIGS if device.type == "cuda" else CONFIGS[:2]:

            def launch(config=config) -> None:
                fused.launch(out, weight, text_ids, source[:n], rows, config)

            configs[str(config)] = 2 * out_bytes / time_of(launch) / 1e9
    bandwidth = {name: 2 * out_bytes / s / 1e9 for name, s in seconds.items()}
    copy = bandwidth["copy_ (d2d)"]
    return {
        "output_bytes": out_bytes,
        "median_us": {name: s * 1e6 for name, s in seconds.items()},
        "bandwidth_gbs": bandwidth,
        "fraction_of_copy": {name: bw / copy for name, bw in bandwidth.items()},
        "default_config": list(fused.launch_config(src.size(-1), src.element_size())),
        "config_sweep_gbs": configs,
        "target_met": bandwidth["fused kernel"] >= 0.8 * copy,
    }


@contextlib.contextmanager
def reported(entry: dict, failures: list[str], check: str) -> Iterator[None]:
    """Run a check's body; an exception is recorded in ``entry`` and ``failures`` (as
    "``check`` raised") with its traceback printed, and the checks go on with the next."""
    try:
        yield
    except Exception as e:  # report, keep checking the others
        entry["error"] = f"{type(e).__name__}: {e}"[:500]
        failures.append(f"{check} raised")
        traceback.print_exc()


def sync_error(fn: Callable[[], object]) -> str | None:
    """Run ``fn`` (warm) with host synchronisation an error: None, or the error's first line."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def check_sync(inp: mk.Inputs) -> dict:
    """None: nothing synchronised; otherwise the error's first line."""
    results = {}
    plain = {k: v.detach() for k, v in inp.rows.items()}
    for impl in ("fused", "index", "reference"):
        merge(inp, impl, plain)  # warm-up: compilation and first-launch work happen here
        results[impl] = sync_error(lambda impl=impl: merge(inp, impl, plain))
    return results


def check_graph(inp: mk.Inputs) -> dict:
    """Capture the merge, write new tokens (placeholders moved) and rows into the captured
    inputs, replay, and compare with eager on the new inputs."""
    results = {}
    for impl in ("fused", "index"):
        try:
            tokens = inp.tokens.clone()
            rows = {k: v.detach().clone() for k, v in inp.rows.items()}
            weight = inp.weight.detach()

            def fn(tokens=tokens, rows=rows, weight=weight, impl=impl):
                return mk.merge_embeddings(tokens, weight, rows, inp.encoder_tokens, impl=impl)

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = fn()
            # Same placeholder count per sample, different positions and values.
            tokens.copy_(tokens.roll(17, dims=1))
            for v in rows.values():
                v.copy_(torch.randn_like(v))
            graph.replay()
            torch.cuda.synchronize()
            expected = mk.merge_embeddings(
                tokens, weight, rows, inp.encoder_tokens, impl="reference"
            )
            results[impl] = {
                "captured": True,
                "replay_equals_eager": bitwise_equal(static_out, expected),
            }
        except Exception as e:  # report, keep checking the others
            results[impl] = {"captured": False, "error": f"{type(e).__name__}: {e}"[:500]}
            traceback.print_exc()
    return results


def packed_model(device: torch.device, smoke: bool, max_seq_len: int) -> torch.nn.Module:
    from fusion.models import llama3_2

    torch.manual_seed(0)
    if smoke:
        model = llama3_2(256, num_layers=2, num_heads=3, num_kv_heads=1, embed_dim=48,
                         max_seq_len=max_seq_len, intermediate_dim=64)  # fmt: skip
    else:
        model = llama3_2(pab.VOCAB, num_layers=2, num_heads=pab.HEADS, num_kv_heads=pab.KV_HEADS,
                         embed_dim=pab.WIDTH, max_seq_len=max_seq_len,
                         intermediate_dim=pab.MLP)  # fmt: skip
    return model.to(device)


def cuda_ms(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Median milliseconds of ``fn`` (CUDA events on GPU, the wall clock on CPU), warmed up."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def check_packed_attention(device: torch.device, smoke: bool) -> dict:
    """The packing property and the time of each packed-attention path (see item 5)."""
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes: shared cores make more threads only slower
    seq_len, rows_per_batch = (128, 2) if smoke else (2048, 2)
    rows = pab.packed_rows(seq_len, rows_per_batch, seed=0, quick=smoke)
    model = packed_model(device, smoke, seq_len)
    segments = PackedSegments.from_lengths(rows, seq_len, device=device)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab_size, (len(rows), seq_len), generator=generator)
    labels = torch.randint(0, model.vocab_size, (len(rows), seq_len), generator=generator)
    labels[segments.segment_ids.cpu() < 0] = -100  # no target in padding
    tokens, labels = tokens.to(device), labels.to(device)
    positions = torch.cat(
        [torch.cat([torch.arange(n) for n in row]) for row in segments.lengths]
    ).view(len(rows), seq_len)
    positions = positions.to(device)
    placed = [  # (row, start, length) of every sample
        (r, sum(row[:k]), row[k])
        for r, row in enumerate(segments.lengths)
        for k in range(len(row) - (segments.padding[r] > 0))
    ]
    backends = ["mask", "sdpa"] if device.type != "cuda" else ["mask", "sdpa", "flex", "varlen"]
    results: dict = {"rows": [list(row) for row in rows], "seq_len": seq_len, "paths": {}}
    failures = []
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype_name == "bf16")
        for backend in backends:
            name = f"{backend} {dtype_name}"
            entry: dict = {}
            results["paths"][name] = entry
            if backend != "mask":
                try:  # raises where the path cannot run (varlen in fp32)
                    entry["backend"] = resolve_backend(backend, device, dtype)
                except ValueError as e:
                    entry["skipped"] = str(e)[:300]
                    continue
            with reported(entry, failures, f"packed attention: {name}"):
                mask = (
                    segments.dense_mask() if backend == "mask" else segments.with_backend(backend)
                )

                def forward(mask=mask, autocast=autocast):
                    with autocast:
                        return model(tokens, mask=mask, input_pos=positions)

                model.zero_grad(set_to_none=True)
                logits = forward()
                loss, _ = masked_token_loss(logits, labels)
                loss.backward()
                batch_grads = [p.grad.detach().clone() for p in model.parameters()]
                model.zero_grad(set_to_none=True)
                worst, scale = 0.0, 1.0
                for r, start, n in placed:
                    with autocast:
                        own = model(tokens[r : r + 1, start : start + n])
                    if dtype_name == "fp32":
                        own_loss, _ = masked_token_loss(own, labels[r : r + 1, start : start + n])
                        own_loss.backward()
                    diff = (logits[r, start : start + n] - own[0]).detach().abs().max()
                    worst = max(worst, float(diff))
                    scale = max(scale, float(own.detach().abs().max()))
                entry["max_abs_diff_vs_alone"] = worst
                entry["finite"] = bool(logits.isfinite().all())
                tolerance = 1e-4 if dtype_name == "fp32" else 3e-2 * scale
                entry["tolerance"] = tolerance
                ok = worst <= tolerance and entry["finite"]
                if dtype_name == "fp32":
                    # Within 1e-4 plus 1e-3 of the largest gradient (sums over many tokens):
                    # the worst parameter's difference as a fraction of its tolerance.
                    share = max(
                        float((a - p.grad).abs().max() / (1e-4 + 1e-3 * p.grad.abs().max()))
                        for a, p in zip(batch_grads, model.parameters(), strict=True)
                    )
                    entry["grad_diff_share_of_tolerance"] = share
                    ok = ok and share <= 1
                model.zero_grad(set_to_none=True)

                def step(forward=forward):
                    loss, _ = masked_token_loss(forward(), labels)
                    loss.backward()

                entry["fwd_bwd_ms"] = cuda_ms(step, device)
                if device.type == "cuda":
                    entry["sync_error"] = sync_error(step)
                model.zero_grad(set_to_none=True)
                entry["ok"] = ok
                if not ok:
                    failures.append(f"packed attention: {name}")
    results["failures"] = failures
    return results


def print_packed(report: dict) -> None:
    packed = report["packed_attention"]
    print(f"packed attention, rows of {packed['seq_len']}: {len(packed['rows'])} rows")
    for name, e in packed["paths"].items():
        if "skipped" in e or "error" in e:
            print(f"  {name:12} {e.get('skipped') or e.get('error')}")
            continue
        grad = e.get("grad_diff_share_of_tolerance")
        print(
            f"  {name:12} {'ok' if e['ok'] else 'FAILED':6} logits |diff| "
            f"{e['max_abs_diff_vs_alone']:.1e} (tol {e['tolerance']:.1e})"
            + (f", grads |diff| {grad:.0%} of tolerance" if grad is not None else "")
            + f", fwd+bwd {e['fwd_bwd_ms']:.2f} ms"
            + (f", sync: {e['sync_error']}" if e.get("sync_error") else "")
        )


#: The Gated DeltaNet parameters whose gradients come only through the decay g (item 6).
DECAY_PARAMETERS = ("A_log", "dt_bias", "in_proj_a.weight")


def check_deltanet(device: torch.device, smoke: bool) -> dict:
    """FLA's packed Gated DeltaNet against the torch kernel's, and their times (item 6)."""
    import deltanet_layer as dnl

    from fusion.decoder import GatedDeltaNet
    from fusion.decoder.delta_rule_fla import fla_installed

    if device.type == "cpu":
        torch.set_num_threads(1)
    # Read when FLA's kernels compile (after this): its fp32 products in fp32, not tf32.
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    seq_len, rows_per_batch = (128, 2) if smoke else (2048, 2)
    rows = pab.packed_rows(seq_len, rows_per_batch, seed=0, quick=smoke)
    w = dnl.WIDTHS["quick" if smoke else "full"]
    torch.manual_seed(0)
    layer = GatedDeltaNet(w["embed_dim"], w["k_heads"], w["v_heads"], w["k_dim"], w["v_dim"],
                          dnl.KERNEL, chunk_size=dnl.CHUNK).to(device)  # fmt: skip
    with torch.no_grad():  # the zero-initialised parts random too, so every path matters
        layer.norm.scale.uniform_(0.5, 1.5)
        layer.conv1d.weight.normal_(0, 0.5)
    segments = PackedSegments.from_lengths(rows, seq_len, device=device)
    generator = torch.Generator().manual_seed(1)
    x, grad = (
        torch.randn(len(rows), seq_len, w["embed_dim"], generator=generator).to(device)
        for _ in range(2)
    )
    names = ["output", "input", *(name for name, _ in layer.named_parameters())]
    # On CUDA FLA's kernel against torch's; on the CPU (FLA needs CUDA) torch's against itself,
    # which runs the comparison.
    contestant = "fla" if device.type == "cuda" else "torch"
    results: dict = {"rows": [list(row) for row in rows], "seq_len": seq_len, "widths": w,
                     "reference": "torch", "contestant": contestant, "paths": {}}  # fmt: skip
    failures = []
    for dtype_name in ("fp32", "bf16"):
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype_name == "bf16")
        entry: dict = {}
        results["paths"][dtype_name] = entry
        if contestant == "fla" and not fla_installed():
            entry["skipped"] = "skipped: flash-linear-attention not installed"
            continue

        def run(backend: str, autocast=autocast) -> list[torch.Tensor]:
            layer.delta_rule_backend = backend
            leaf = x.clone().requires_grad_()
            with autocast:
                out = layer(leaf, mask=layer.token_layout(segments, None))
            grads = torch.autograd.grad(out, [leaf, *layer.parameters()], grad.to(out.dtype))
            return [t.detach().float() for t in (out, *grads)]

        with reported(entry, failures, f"deltanet: {contestant} {dtype_name}"):
            expected, actual = run("torch"), run(contestant)
            rtol, atol = (1e-3, 1e-4) if dtype_name == "fp32" else (3e-2, 0.0)

            def tolerance(name: str, e: torch.Tensor, rtol=rtol, atol=atol) -> float:
                if name in DECAY_PARAMETERS:
                    return 3e-2 * float(e.abs().max())
                return atol + rtol * float(e.abs().max())

            shares = {
                name: float((a - e).abs().max()) / tolerance(name, e)
                for name, a, e in zip(names, actual, expected, strict=True)
            }
            entry["max_abs_diff"] = {
                name: float((a - e).abs().max())
                for name, a, e in zip(names, actual, expected, strict=True)
            }
            entry["tolerance"] = (
                f"{atol:g} + {rtol:g} x the largest |value| of each tensor; 0.03 x for the "
                f"gradients of {', '.join(DECAY_PARAMETERS)}"
            )
            entry["worst"] = max(shares, key=shares.__getitem__)
            entry["worst_share_of_tolerance"] = shares[entry["worst"]]
            entry["finite"] = all(bool(a.isfinite().all()) for a in actual)
            entry["ok"] = entry["worst_share_of_tolerance"] <= 1 and entry["finite"]
            entry["fwd_bwd_ms"] = {}
            entry["sync_error"] = {}
            for backend in dict.fromkeys(["torch", contestant]):
                entry["fwd_bwd_ms"][backend] = cuda_ms(lambda b=backend: run(b), device)
                if device.type == "cuda":
                    entry["sync_error"][backend] = sync_error(lambda b=backend: run(b))
            if not entry["ok"]:
                failures.append(f"deltanet: {contestant} {dtype_name}")
    layer.delta_rule_backend = "auto"
    results["failures"] = failures
    return results


def check_fused_loss(device: torch.device, smoke: bool) -> dict:
    """The fused linear cross-entropy (``fusion.fused_token_loss``) against the checkpointed
    chunks (``fusion.chunked_token_loss``) on a Qwen-sized vocabulary: the loss and the
    gradients of the hidden states and of the output (tied: a weight read; untied: an
    ``nn.Linear`` called as a module), fp32 and bf16 autocast; forward+backward time and peak
    memory of each; whether a warm step synchronises (issue 40, the GPU mode)."""
    rows, dim, vocab = (64, 16, 97) if smoke else (8192, 2048, 151_936)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, rows, dim, generator=generator).to(device)
    labels = torch.randint(0, vocab, (1, rows), generator=generator)
    labels[:, ::2] = -100  # half the rows are targets, as a conversation's answers
    labels = labels.to(device)
    targets = int((labels != -100).sum())
    output = torch.nn.Linear(dim, vocab, bias=False).to(device)
    with torch.no_grad():
        output.weight.normal_(0, dim**-0.5)
    unembeds = {
        "untied": output,
        "tied": lambda h: torch.nn.functional.linear(h, output.weight),  # a tied table's read
    }
    results: dict = {"rows": rows, "dim": dim, "vocab": vocab, "targets": targets, "cases": {}}
    failures = []

    def step(loss: str, unembed, autocast) -> list[torch.Tensor]:
        output.weight.grad = None
        leaf = hidden.clone().requires_grad_()
        with autocast:
            if loss == "fused":
                total, _ = fused_token_loss(
                    leaf, labels, unembed, grad_scale=1 / targets, num_targets=targets
                )
            else:
                total, _ = chunked_token_loss(leaf, labels, unembed, num_targets=targets)
        (total / targets).backward()
        assert leaf.grad is not None and output.weight.grad is not None
        return [total.detach() / targets, leaf.grad, output.weight.grad.clone()]

    for dtype_name in ("fp32", "bf16"):
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype_name == "bf16")
        for tie, unembed in unembeds.items():
            case = f"{dtype_name} {tie}"
            entry: dict = {}
            results["cases"][case] = entry
            with reported(entry, failures, f"fused loss: {case}"):
                expected = step("chunked", unembed, autocast)
                actual = step("fused", unembed, autocast)
                rtol = 1e-5 if dtype_name == "fp32" else 2e-2
                entry["relative_diff"] = {
                    name: float((a - e).abs().max() / e.abs().max().clamp_min(1e-30))
                    for name, a, e in zip(("loss", "hidden", "output"), actual, expected,
                                          strict=True)
                }  # fmt: skip
                entry["ok"] = max(entry["relative_diff"].values()) <= rtol
                entry["tolerance"] = rtol
                entry["fwd_bwd_ms"], entry["peak_mib"], entry["sync_error"] = {}, {}, {}
                for loss in ("chunked", "fused"):
                    run = functools.partial(step, loss, unembed, autocast)
                    entry["fwd_bwd_ms"][loss] = cuda_ms(run, device)
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                        entry["sync_error"][loss] = sync_error(run)
                        entry["peak_mib"][loss] = torch.cuda.max_memory_allocated() / 2**20
                if not entry["ok"]:
                    failures.append(f"fused loss: {case}")
    results["failures"] = failures
    return results


def print_fused_loss(report: dict) -> None:
    r = report["fused_loss"]
    print(
        f"fused loss against the chunked loss, {r['rows']} rows x {r['dim']} -> vocabulary "
        f"{r['vocab']}, {r['targets']} targets:"
    )
    for case, entry in r["cases"].items():
        if "error" in entry:
            print(f"  {case:12} ERROR {entry['error']}")
            continue
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in entry["relative_diff"].items())
        times = ", ".join(f"{k} {v:.2f} ms" for k, v in entry["fwd_bwd_ms"].items())
        peaks = ", ".join(f"{k} {v:.0f} MiB" for k, v in entry["peak_mib"].items())
        print(
            f"  {case:12} {'ok' if entry['ok'] else 'FAILED'} (relative {diffs}; tolerance "
            f"{entry['tolerance']:.0e}); fwd+bwd {times}; peak {peaks or '-'}; sync "
            f"{entry['sync_error'] or '-'}"
        )


def print_deltanet(report: dict) -> None:
    d = report["deltanet"]
    print(
        f"Gated DeltaNet packed, {d['contestant']} vs {d['reference']}, rows of {d['seq_len']}: "
        f"{len(d['rows'])} rows, width {d['widths']['embed_dim']}"
    )
    for name, e in d["paths"].items():
        if "skipped" in e or "error" in e:
            print(f"  {name:5} {e.get('skipped') or e.get('error')}")
            continue
        times = ", ".join(f"{b} {ms:.2f} ms" for b, ms in e["fwd_bwd_ms"].items())
        syncs = {b: s for b, s in e["sync_error"].items() if s}
        print(
            f"  {name:5} {'ok' if e['ok'] else 'FAILED':6} worst |diff| "
            f"{e['worst_share_of_tolerance']:.0%} of tolerance ({e['worst']}, output "
            f"{e['max_abs_diff']['output']:.1e}), fwd+bwd {times}"
            + (f", sync: {syncs}" if syncs else "")
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device (use --cpu-smoke to exercise the script)")
        device = torch.device("cuda")
    if args.packed_only or args.deltanet_only:
        if args.packed_only:
            key, stem, show = "packed_attention", "gpu_check_packed", print_packed
            report = {key: check_packed_attention(device, smoke=args.cpu_smoke)}
        else:
            key, stem, show = "deltanet", "gpu_check_deltanet", print_deltanet
            report = {key: check_deltanet(device, smoke=args.cpu_smoke)}
        report["failures"] = report[key]["failures"]
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / (f"{stem}_cpu_smoke.json" if args.cpu_smoke else f"{stem}.json")
        path.write_text(json.dumps(report, indent=1))
        show(report)
        print(
            "FAILED: " + "; ".join(report["failures"])
            if report["failures"]
            else "all checks passed"
        )
        print(f"wrote {path}", file=sys.stderr)
        return 1 if report["failures"] else 0
    from fusion.merge import default_impl
    from fusion.merge.fused import fused_supported

    if not fused_supported(device, mk.DTYPES[args.dtype]):
        raise SystemExit("gpu_check: impl='fused' cannot run here (is Triton installed?)")
    case = mk.Case(args.tokens, args.dim, args.fraction, "fwd+bwd")
    inp = mk.make_inputs(case, args.bench, device)
    report: dict = {
        "machine": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
        },
        "case": {"tokens": args.tokens, "dim": args.dim, "fraction": args.fraction},
        "dtype": args.dtype,
        "default_impl": default_impl(device, torch.nn.Embedding(1, 1, dtype=mk.DTYPES[args.dtype])),
    }
    try:
        import triton

        report["machine"]["triton"] = triton.__version__
    except ImportError:
        pass
    report["bits_equal_reference"] = check_bits(inp)
    report["bandwidth"] = check_bandwidth(inp, device)
    if device.type == "cuda":
        report["sync_errors"] = check_sync(inp)
        report["cuda_graph"] = check_graph(inp)
    failures = [f"bits: {k}" for k, ok in report["bits_equal_reference"].items() if not ok]
    if device.type == "cuda":
        if not report["bandwidth"]["target_met"]:
            failures.append("bandwidth: fused kernel below 80% of the d2d copy")
        failures += [f"sync: {k}" for k in ("fused", "index") if report["sync_errors"][k]]
        failures += [
            f"graph: {k}"
            for k, r in report["cuda_graph"].items()
            if not (r["captured"] and r["replay_equals_eager"])
        ]
    report["packed_attention"] = check_packed_attention(device, smoke=args.cpu_smoke)
    failures += report["packed_attention"]["failures"]
    report["deltanet"] = check_deltanet(device, smoke=args.cpu_smoke)
    failures += report["deltanet"]["failures"]
    report["fused_loss"] = check_fused_loss(device, smoke=args.cpu_smoke)
    failures += report["fused_loss"]["failures"]
    report["failures"] = failures
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("gpu_check_cpu_smoke.json" if args.cpu_smoke else "gpu_check.json")
    path.write_text(json.dumps(report, indent=1))

    bw = report["bandwidth"]
    print(
        f"{report['machine']['device']}, {args.dtype}, {args.tokens} x {args.dim}, "
        f"{args.fraction:.0%} placeholders, output {bw['output_bytes'] / 2**20:.0f} MiB"
    )
    print(f"default impl: {report['default_impl']}")
    print(f"bits equal reference (fwd + grads): {report['bits_equal_reference']}")
    for name, us in bw["median_us"].items():
        print(
            f"  {name:28} {us:10.1f} us {bw['bandwidth_gbs'][name]:8.1f} GB/s "
            f"{bw['fraction_of_copy'][name]:6.1%} of copy"
        )
    print(f"  kernel configs (GB/s), default {bw['default_config']}: {bw['config_sweep_gbs']}")
    if device.type == "cuda":
        print(f"sync debug mode errors: {report['sync_errors']}")
        print(f"cuda graph: {report['cuda_graph']}")
    print_packed(report)
    print_deltanet(report)
    print_fused_loss(report)
    print("FAILED: " + "; ".join(failures) if failures else "all checks passed")
    print(f"wrote {path}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
