"""Generation throughput: fusion eager and compiled, against transformers and torchtune.

Contestants, all greedy, on the same weights and the same prompts:

- ``fusion_eager``: ``fusion.generate(decoder, prompts, temperature=0)``.
- ``fusion_compiled``: the same with ``compile=True`` (inductor; CUDA graphs on CUDA), on a copy
  of the decoder whose caches are set up once (``setup_caches``), as the README advises.
- ``hf_default``: ``transformers``' ``LlamaForCausalLM.generate`` with its default (dynamic)
  cache, on the decoder saved by ``fusion.checkpoint.save_hf_llama`` and loaded with
  ``from_pretrained``.
- ``hf_static_compiled``: the same with ``cache_implementation="static"`` and a
  ``CompileConfig`` (its automatic compilation of the decoding forward; on the CPU too).
- ``torchtune``: ``torchtune.generation.generate`` (top-1 sampling, i.e. greedy) on torchtune's
  own ``llama3_2`` with the decoder's state dict (the same keys), caches set up; skipped, and
  recorded as such, when torchtune is not installed.

    python benchmarks/generation.py            # CPU: 4-layer 512-wide 32k-vocab Llama; B=1, 8
    python benchmarks/generation.py --target   # the issue's target case: CPU B=1 fp32
    python benchmarks/generation.py --quick    # seconds: a tiny model, checks the script
    python benchmarks/generation.py --device cuda   # a Llama-3.2-1B-shaped random model

Every contestant's tokens are checked against ``fusion_eager``'s before anything is timed (a
mismatch is recorded, with the first step that differs, and fails the run in fp32 unless
``--allow-mismatch``). Timing: one ``generate`` call (prefill and every step) is one
measurement; rounds time every contestant back to back, in an order that alternates between
rounds, together with the copy that measures the bandwidth; every ratio is the median over
rounds of the ratio within a round (as in ``merge_kernels.py``), so load drifting on shared
cores cancels out as far as it can.

The roofline: a call must read every weight once per new token (the prefill reads them once,
each of ``new_tokens - 1`` steps once more; the embedding only by the rows it looks up) and,
at each step, the filled part of the KV cache. Those bytes over the bandwidth of a copy of a
weight-sized tensor on the same device (bytes read plus bytes written, over its time) give the
roofline time of a call; a contestant's fraction of the roofline is that time over its own.

Output: a table on stdout, ``generation.json`` (machine, settings, every round, ratios,
targets), ``generation.txt`` (the table) and ``generation.png`` in ``--out`` (default
``benchmarks/results/``; ``--quick`` writes to a new temporary directory unless ``--out`` is
given, so the committed results are never overwritten by a check). Needs ``transformers`` and
the ``bench`` extra (matplotlib).
"""

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import RESULTS as RESULTS  # where full runs write (tests compare against it)
from common import add_out_argument, machine, output_dir

from fusion import generate
from fusion.checkpoint import save_hf_llama
from fusion.decoder import TransformerDecoder
from fusion.generation import generate_stream
from fusion.generation.steps import bucket
from fusion.models import llama3_2

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONTESTANTS = ("fusion_eager", "fusion_compiled", "hf_default", "hf_static_compiled", "torchtune")
THIRD_PARTY = ("hf_default", "hf_static_compiled", "torchtune")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama shape, as ``fusion.models.llama3_2`` takes it."""

    vocab: int
    layers: int
    heads: int
    kv_heads: int
    dim: int
    hidden: int | None  # None: llama3_2's default MLP width
    tied: bool = True

    def builder_kwargs(self, max_seq_len: int) -> dict:
        """Keyword arguments of ``llama3_2``, ours and torchtune's alike."""
        return dict(
            vocab_size=self.vocab,
            num_layers=self.layers,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            embed_dim=self.dim,
            max_seq_len=max_seq_len,
            intermediate_dim=self.hidden,
            tie_word_embeddings=self.tied,
        )


SHAPES = {
    "cpu": Shape(32_000, 4, 8, 2, 512, None),  # the issue's CPU model
    "llama3.2-1b": Shape(128_256, 16, 32, 8, 2048, 8192),  # Llama-3.2-1B, random weights
    "quick": Shape(256, 2, 4, 2, 64, 128),
}


# ------------------------------------------------------------------ models


def build_decoder(shape: Shape, max_seq_len: int, seed: int) -> TransformerDecoder:
    torch.manual_seed(seed)
    return llama3_2(**shape.builder_kwargs(max_seq_len)).eval()


def load_hf(directory: Path, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def load_torchtune(decoder: TransformerDecoder, shape: Shape, dtype: torch.dtype):
    """torchtune's ``llama3_2`` with the decoder's weights (this library keeps its keys)."""
    from torchtune.models.llama3_2._component_builders import llama3_2 as tt_llama3_2

    model = tt_llama3_2(**shape.builder_kwargs(decoder.max_seq_len))
    model.load_state_dict(decoder.state_dict())
    return model.to(device=decoder.device, dtype=dtype).eval()


# ------------------------------------------------------------------ contestants


def contestants(
    args: argparse.Namespace,
    decoder: TransformerDecoder,
    hf_dir: Path,
    batch: int,
    dtype: torch.dtype,
) -> tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], dict[str, str]]:
    """name -> ``run(prompts) -> [b, s + new]`` tokens; and name -> why it is missing."""
    device, new = args.device, args.new_tokens
    found: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    missing: dict[str, str] = {}
    wanted = set(args.contestants)
    fusion = copy.deepcopy(decoder).to(dtype)
    compile_options: dict | bool = (
        True if args.compile_backend == "inductor" else {"backend": args.compile_backend}
    )
    if "fusion_eager" in wanted:
        found["fusion_eager"] = lambda p: generate(fusion, p, max_new_tokens=new, temperature=0)
    if "fusion_compiled" in wanted:
        compiled = copy.deepcopy(fusion)
        # Set up once: CUDA graphs keep the caches' addresses across calls.
        length = bucket(bucket(args.prompt_len, compiled.max_seq_len) + new - 1, 1 << 30)
        compiled.setup_caches(batch, dtype, decoder_max_seq_len=min(length, compiled.max_seq_len))

        def run_compiled(prompts: torch.Tensor) -> torch.Tensor:
            return generate(
                compiled, prompts, max_new_tokens=new, temperature=0, compile=compile_options
            )

        run_compiled.stream = lambda prompts: generate_stream(  # for the CUDA sync check
            compiled, prompts, max_new_tokens=new, temperature=0, compile=compile_options
        )
        found["fusion_compiled"] = run_compiled
    if wanted & {"hf_default", "hf_static_compiled"}:
        try:
            from transformers import CompileConfig, GenerationConfig

            hf = load_hf(hf_dir, dtype, device)
        except Exception as error:  # not installed, or too old for this script
            for name in ("hf_default", "hf_static_compiled"):
                missing[name] = f"transformers unavailable: {type(error).__name__}: {error}"
        else:
            common = dict(
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                bos_token_id=None,
            )
            default = GenerationConfig(**common)
            static = GenerationConfig(
                **common,
                cache_implementation="static",
                compile_config=_hf_compile_config(CompileConfig, args),
            )

            def run_hf(prompts: torch.Tensor, config=default) -> torch.Tensor:
                with torch.no_grad():
                    return hf.generate(
                        input_ids=prompts,
                        attention_mask=torch.ones_like(prompts),
                        generation_config=config,
                    )

            if "hf_default" in wanted:
                found["hf_default"] = run_hf
            if "hf_static_compiled" in wanted:
                found["hf_static_compiled"] = lambda p: run_hf(p, static)
    if "torchtune" in wanted:
        try:
            from torchtune.generation import generate as tt_generate

            tt = load_torchtune(decoder, args.shape, dtype)
        except ImportError as error:
            missing["torchtune"] = f"not installed ({error})"
        else:
            tt.setup_caches(batch, dtype, decoder_max_seq_len=args.prompt_len + new)

            def run_tt(prompts: torch.Tensor) -> torch.Tensor:
                tt.reset_caches()
                with torch.no_grad():
                    tokens, _ = tt_generate(
                        tt, prompts, max_generated_tokens=new, pad_id=0, temperature=1.0, top_k=1
                    )
                return tokens

            found["torchtune"] = run_tt
    return {k: found[k] for k in CONTESTANTS if k in found}, missing


def _hf_compile_config(compile_config_class, args: argparse.Namespace):
    mode = "reduce-overhead" if args.device.type == "cuda" else "default"
    if args.compile_backend != "inductor":
        mode = None  # modes are inductor's
    config = compile_config_class(fullgraph=False, dynamic=False, backend=args.compile_backend)
    config.mode = mode
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return config


# ------------------------------------------------------------------ measurements


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call: Callable[[], object], device: torch.device) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    result = call()
    sync(device)
    return time.perf_counter() - start, result


def copy_seconds(src: torch.Tensor, dst: torch.Tensor, device: torch.device, repeat: int) -> float:
    """Median time of ``dst.copy_(src)``: the bandwidth floor of reading the weights."""
    times = []
    for _ in range(repeat):
        seconds, _ = timed(lambda: dst.copy_(src), device)
        times.append(seconds)
    return statistics.median(times)


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first new-token step at which two [b, n] outputs differ (None: equal)."""
    if a.shape != b.shape:
        return 0
    differs = (a != b).any(dim=0).nonzero()
    return int(differs[0]) if differs.numel() else None


def paired(numerator: list[float], denominator: list[float]) -> float:
    """The median over rounds of the ratio within each round."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def bytes_per_call(decoder: TransformerDecoder, args, batch: int, dtype: torch.dtype) -> dict:
    """Bytes a call must read: the weights once per new token, the filled KV cache per step."""
    size = dtype.itemsize
    params = sum(p.numel() for p in decoder.parameters())
    table = decoder.tok_embeddings.weight.numel()
    # Untied: the embedding table is only looked up (b rows); tied, it is the output matrix.
    weights = (params - (0 if decoder.output is None else table)) * size
    attn = decoder.layers[0].attn
    per_slot = 2 * len(decoder.layers) * batch * attn.num_kv_heads * attn.head_dim * size
    # Step j (1 .. new - 1) feeds one token that attends to prompt_len + j filled slots.
    kv = sum(per_slot * (args.prompt_len + j) for j in range(1, args.new_tokens))
    return {"weights": weights, "kv_cache": kv, "call": args.new_tokens * weights + kv}


def run_case(args, decoder: TransformerDecoder, hf_dir: Path, batch: int, dtype_name: str):
    device, dtype = args.device, DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(args.seed + batch)
    prompts = torch.randint(1, args.shape.vocab, (batch, args.prompt_len), generator=gen)
    prompts = prompts.to(device)
    found, missing = contestants(args, decoder, hf_dir, batch, dtype)
    new = args.new_tokens
    reference = None
    checks: dict[str, dict] = {}
    for name, run in found.items():
        first, out = timed(lambda run=run: run(prompts), device)
        out = out[:, -new:].cpu()
        if reference is None:
            reference = out
        divergence = first_divergence(out, reference)
        checks[name] = {"first_call_s": first, "tokens_equal": divergence is None}
        checks[name]["first_divergent_step"] = divergence
        if divergence is not None and dtype == torch.float32 and not args.allow_mismatch:
            raise AssertionError(
                f"B={batch} {dtype_name}: {name}'s tokens differ from fusion_eager's from new "
                f"token {divergence} on (--allow-mismatch to time it anyway)"
            )
        for _ in range(args.warmup):  # compiled: CUDA graphs are recorded on later calls
            run(prompts)
    nbytes = bytes_per_call(decoder, args, batch, dtype)
    elements = max(1, nbytes["weights"] // 4)
    src = torch.empty(elements, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    times: dict[str, list[float]] = {name: [] for name in found}
    copies: list[float] = []
    names = list(found)
    for r in range(args.rounds):
        copies.append(copy_seconds(src, dst, device, args.copy_repeat))
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, _ = timed(lambda name=name: found[name](prompts), device)
            times[name].append(seconds)
    del src, dst
    copy_bytes = 2 * elements * 4
    bandwidth = [copy_bytes / t for t in copies]  # per round, bytes per second
    roofline_s = [nbytes["call"] / bw for bw in bandwidth]
    results = []
    for name in found:
        t = times[name]
        results.append(
            {
                "batch": batch,
                "dtype": dtype_name,
                "contestant": name,
                **checks[name],
                "round_s": t,
                "median_s": statistics.median(t),
                "tokens_per_s": batch * new / statistics.median(t),
                "roofline_fraction": paired(roofline_s, t),
                "speedup_over_hf_default": (
                    paired(times["hf_default"], t) if "hf_default" in times else None
                ),
                "speedup_over_fusion_eager": (
                    paired(times["fusion_eager"], t) if "fusion_eager" in times else None
                ),
                "speedup_over_hf_static_compiled": (
                    paired(times["hf_static_compiled"], t)
                    if "hf_static_compiled" in times
                    else None
                ),
            }
        )
    for name, why in missing.items():
        results.append({"batch": batch, "dtype": dtype_name, "contestant": name, "skipped": why})
    case = {
        "batch": batch,
        "dtype": dtype_name,
        "bytes": nbytes,
        "copy_bytes": copy_bytes,
        "copy_round_s": copies,
        "bandwidth_gbs": statistics.median(bandwidth) / 1e9,
        "roofline_tokens_per_s": batch * new / statistics.median(roofline_s),
    }
    if device.type == "cuda" and "fusion_compiled" in found:
        case["fusion_compiled_step_syncs"] = cuda_step_syncs(found["fusion_compiled"], prompts)
    return case, results


def cuda_step_syncs(compiled: Callable, prompts: torch.Tensor) -> str | None:
    """Run the compiled fusion generation's steps under CUDA's sync debug mode ("error"):
    None when nothing synchronised, else the error. The stream's first token (the prefill,
    whose input checks run once before the loop) comes before the mode is set."""
    stream = compiled.stream(prompts)
    try:
        next(stream)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in stream:
                pass
        finally:
            torch.cuda.set_sync_debug_mode("default")
    except RuntimeError as error:
        if "synchroniz" not in str(error):
            raise
        return str(error).splitlines()[0]
    finally:
        stream.close()
    return None


# ------------------------------------------------------------------ report


def evaluate_targets(cases: list[dict], results: list[dict], device: torch.device) -> list[dict]:
    """The issue's targets, where the run holds their case."""

    def pick(batch: int, dtype: str, name: str) -> dict | None:
        for r in results:
            if (r["batch"], r["dtype"], r["contestant"]) == (batch, dtype, name):
                return r if "skipped" not in r else None
        return None

    targets = []
    if device.type == "cpu":
        compiled, eager = pick(1, "fp32", "fusion_compiled"), pick(1, "fp32", "fusion_eager")
        case = "cpu B=1 fp32"
        if compiled and compiled["speedup_over_hf_static_compiled"] is not None:
            ratio = compiled["speedup_over_hf_static_compiled"]
            targets.append(_target(case, "compiled / hf_static_compiled", ratio, 1.3))
        if eager and eager["speedup_over_hf_default"] is not None:
            # Issue 40, item 4: 1.2x (issue 28's was parity).
            targets.append(
                _target(case, "eager / hf_default", eager["speedup_over_hf_default"], 1.2)
            )
    if device.type == "cuda":
        compiled = pick(1, "bf16", "fusion_compiled")
        if compiled:
            targets.append(
                _target(
                    "cuda B=1 bf16",
                    "compiled fraction of roofline",
                    compiled["roofline_fraction"],
                    0.7,
                )
            )
    return targets


def _target(case: str, what: str, value: float, bound: float) -> dict:
    return {
        "case": case,
        "what": what,
        "value": value,
        "target": f">= {bound}",
        "met": value >= bound,
    }


def table(cases: list[dict], results: list[dict]) -> str:
    head = (
        f"{'case':10} {'contestant':19} {'tok/s':>8} {'x hf':>6} {'x static':>8} {'x eager':>7} "
        f"{'roofline':>8} {'tokens':>7} {'1st call':>9}"
    )
    lines = [head, "-" * len(head)]
    for case in cases:
        label = f"B={case['batch']} {case['dtype']}"
        for r in results:
            if (r["batch"], r["dtype"]) != (case["batch"], case["dtype"]):
                continue
            if "skipped" in r:
                lines.append(f"{label:10} {r['contestant']:19} skipped: {r['skipped'][:60]}")
                continue
            hf, eager = r["speedup_over_hf_default"], r["speedup_over_fusion_eager"]
            static = r["speedup_over_hf_static_compiled"]
            tokens = "same" if r["tokens_equal"] else f"@{r['first_divergent_step']}"
            lines.append(
                f"{label:10} {r['contestant']:19} {r['tokens_per_s']:8.1f} "
                f"{(f'{hf:.2f}' if hf else '-'):>6} {(f'{static:.2f}' if static else '-'):>8} "
                f"{(f'{eager:.2f}' if eager else '-'):>7} "
                f"{100 * r['roofline_fraction']:7.1f}% {tokens:>7} {r['first_call_s']:8.1f}s"
            )
        lines.append(
            f"{label:10} {'(roofline)':19} {case['roofline_tokens_per_s']:8.1f}   copy "
            f"{case['bandwidth_gbs']:.1f} GB/s, {case['bytes']['call'] / 2**20:.0f} MiB a call"
        )
    return "\n".join(lines)


def plot(cases: list[dict], results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [
        n for n in CONTESTANTS if any(r["contestant"] == n and "skipped" not in r for r in results)
    ]
    fig, ax = plt.subplots(figsize=(4.5 + 2.2 * len(cases), 4))
    width = 0.8 / max(1, len(names))
    for i, case in enumerate(cases):
        for j, name in enumerate(names):
            for r in results:
                key = (r["batch"], r["dtype"], r["contestant"])
                if key == (case["batch"], case["dtype"], name) and "skipped" not in r:
                    x = i + (j - (len(names) - 1) / 2) * width
                    ax.bar(
                        x, r["tokens_per_s"], width, color=f"C{j}", label=name if i == 0 else None
                    )
        ax.hlines(
            case["roofline_tokens_per_s"],
            i - 0.45,
            i + 0.45,
            colors="k",
            linestyles="--",
            label="roofline" if i == 0 else None,
        )
    ax.set_xticks(range(len(cases)), [f"B={c['batch']} {c['dtype']}" for c in cases])
    ax.set_ylabel("new tokens / s")
    ax.set_yscale("log")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="cpu / llama3.2-1b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=None, help="default: 64 CPU, 256 GPU")
    p.add_argument("--contestants", nargs="+", choices=CONTESTANTS, default=list(CONTESTANTS))
    p.add_argument("--rounds", type=int, default=None, help="default: 7 CPU, 5 GPU")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls after the check")
    p.add_argument("--copy-repeat", type=int, default=5, help="copies per round (median)")
    p.add_argument("--compile-backend", default="inductor", help="fusion's and transformers'")
    p.add_argument("--allow-mismatch", action="store_true", help="time differing tokens too")
    p.add_argument("--target", action="store_true", help="only the issue's target case")
    p.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    add_out_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = args.device.type == "cuda"
    args.shape = SHAPES[args.shape or ("llama3.2-1b" if gpu else "cpu")]
    args.new_tokens = args.new_tokens or (256 if gpu else 64)
    args.rounds = args.rounds or (5 if gpu else 7)
    if args.target:
        args.batches, args.dtypes = [1], ["bf16" if gpu else "fp32"]
    if args.quick:
        args.shape, args.batches, args.dtypes = SHAPES["quick"], [2], ["fp32"]
        args.prompt_len, args.new_tokens, args.rounds, args.warmup = 8, 6, 2, 0
        args.copy_repeat = 2
        if args.compile_backend == "inductor":
            args.compile_backend = "eager"  # dynamo without kernel compilation: seconds
    args.out = output_dir(args.out, check=args.quick)
    for name in ("prompt_len", "new_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    info = machine(args.device, ("transformers", "torchtune"))  # at the start
    # Llama 3.2's rope scaling covers 8192 positions before it: a shorter max_seq_len would
    # only make transformers warn. The rotary table is all max_seq_len costs.
    needed = bucket(bucket(args.prompt_len, 1 << 30) + args.new_tokens, 1 << 30)
    max_seq_len = max(needed, 16_384)
    decoder = build_decoder(args.shape, max_seq_len, args.seed).to(args.device)
    cases, results = [], []
    with tempfile.TemporaryDirectory(prefix="fusion-bench-hf-") as hf_dir:
        save_hf_llama(decoder, hf_dir)  # transformers loads the very same weights
        for dtype_name in args.dtypes:
            for batch in args.batches:
                case, rows = run_case(args, decoder, Path(hf_dir), batch, dtype_name)
                cases.append(case)
                results += rows
                print(table([case], rows), file=sys.stderr, flush=True)
                gc.collect()
                torch._dynamo.reset()  # each case compiles anew: no recompilation limit hit
    info["load_average_end"] = os.getloadavg()
    settings = {
        k: (str(v) if isinstance(v, (Path, torch.device)) else v) for k, v in vars(args).items()
    }
    settings["shape"] = dataclasses.asdict(args.shape)
    targets = evaluate_targets(cases, results, args.device)
    report = {
        "machine": info,
        "settings": settings,
        "cases": cases,
        "results": results,
        "targets": targets,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generation.json").write_text(json.dumps(report, indent=1))
    text = table(cases, results)
    for t in targets:
        verdict = "met" if t["met"] else "MISSED"
        text += f"\ntarget {t['case']}: {t['what']} = {t['value']:.3f} ({t['target']}): {verdict}"
    (args.out / "generation.txt").write_text(text + "\n")
    where = info.get("gpu") or info["cpu"]
    shape = args.shape
    title = (
        f"{where}\nLlama {shape.layers}x{shape.dim}, vocab {shape.vocab}; prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens"
    )
    plot(cases, results, args.out / "generation.png", title)
    print(text)
    print(f"wrote {args.out / 'generation.json'}, generation.txt and generation.png")
    return report


if __name__ == "__main__":
    main()
