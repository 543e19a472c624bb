"""Attention over packed rows: the dense block-causal mask against the mask-free backends of
``fusion.decoder.packed_attention``, forward and forward+backward.

Contestants, on the same q, k, v and rows:

- ``mask``: ``scaled_dot_product_attention`` with the boolean ``[b, 1, s, s]`` block-causal
  mask (``collate_packed(attention="mask")``, the baseline; the mask is made by the collation,
  not timed);
- ``sdpa``: one causal SDPA call per sample (``PackedSegments`` with backend ``"sdpa"``);
- ``flex``: compiled FlexAttention with the document-causal block mask, which is made in every
  timed call (a decoder makes it once per forward for all its layers). On CPU torch 2.13 has
  no FlexAttention backward, so it runs in ``fwd`` only there;
- ``varlen``: ``varlen_attn`` over cumulative lengths (CUDA, bf16 only).

Levels (``--level``): ``op``, the attention call alone at SmolVLM-256M's text shape (9 query
heads, 3 key/value heads, head size 64: SmolLM2-135M), inputs ``[b, s, h, 64]`` as the decoder
passes them; ``decoder``, a 2-layer decoder of that shape (width 576, MLP 1536, vocabulary
4096), its summed logits' backward. Rows: ``s`` in ``--seq-lens`` (1024, 2048, 4096), each
batch 4096 tokens (4096 / s rows), every row packed first-fit from a fixed-seed stream of
LLaVA-Instruct-like samples (as ``finetune.py``'s: 64 image rows and 4 wrapper tokens, a
question of 8-40 tokens, an answer of 10-400: 40% 10-100, 30% 100-250, 30% 250-400; 85 to 513
tokens), the rows' rest padding.

Each contestant runs in a fresh process per round (``--rounds``, alternating order: as given,
then reversed, ...), ``--threads`` threads (2); in it, each case is warmed up (compilation
included) and timed ``--repeats`` times, the median kept. Reported per case and contestant:
the median over rounds and the range, and the ratio to ``mask`` as the median over rounds of
the ratio within each round; also each contestant's largest difference from ``mask`` at the
samples' positions (padding is not compared: the backends leave different finite values there).

    python benchmarks/packed_attention.py                     # CPU, op level, 5 rounds
    python benchmarks/packed_attention.py --level decoder --rounds 3
    python benchmarks/packed_attention.py --quick             # tiny, seconds, a temporary dir

Writes ``packed_attention_<level>.json`` and ``packed_attention_<level>_<device>.txt`` (the
table) to ``--out``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import add_out_argument, machine, output_dir

from fusion.data import pack
from fusion.decoder import PackedSegments
from fusion.decoder.packed_attention import packed_attention, prepare

CONTESTANTS = ("mask", "sdpa", "flex", "varlen")
HEADS, KV_HEADS, HEAD_DIM, WIDTH, MLP, VOCAB = 9, 3, 64, 576, 1536, 4096
TOKENS = 4096  # per batch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--level", choices=("op", "decoder"), default="op")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    p.add_argument("--only", nargs="+", choices=CONTESTANTS, default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny shapes, one round, this process")
    p.add_argument("--worker", choices=CONTESTANTS, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        p.error("--rounds, --repeats: expected at least 1")
    gpu = torch.device(args.device).type == "cuda"
    if args.only is None:
        args.only = [c for c in CONTESTANTS if c != "varlen" or gpu]
    if args.quick:
        args.seq_lens, args.rounds, args.repeats = [128, 256], 1, 1
    args.out = output_dir(args.out, check=args.quick)
    return args


def answer_length(generator: torch.Generator) -> int:
    """10-400 tokens: 40% 10-100, 30% 100-250, 30% 250-400 (as ``finetune.py``)."""
    u = float(torch.rand((), generator=generator))
    low, high = (10, 100) if u < 0.4 else (100, 250) if u < 0.7 else (250, 400)
    return int(torch.randint(low, high + 1, (), generator=generator))


def sample_lengths(count: int, seed: int, quick: bool) -> list[int]:
    """LLaVA-Instruct-like lengths: image rows and wrappers, question, answer, end token."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        question = int(torch.randint(8, 41, (), generator=generator))
        length = 64 + 4 + question + answer_length(generator) + 1
        out.append(max(length // 8, 2) if quick else length)
    return out


def packed_rows(seq_len: int, rows: int, seed: int, quick: bool) -> list[list[int]]:
    """The first ``rows`` rows of a first-fit packing of the sample stream (the rows filled
    first, as a training run's are)."""
    lengths = sample_lengths(64 * rows, seed, quick)
    packed = pack(lengths, seq_len)
    return [[lengths[i] for i in row] for row in packed[:rows]]


def contestant_mask(name: str, segments: PackedSegments) -> PackedSegments | torch.Tensor:
    if name == "mask":
        return segments.dense_mask()
    return segments.with_backend(name)


def attention_call(name: str, q, k, v, mask, dtype: torch.dtype):
    """The timed call: the attention op, with a segment backend's per-forward preparation."""
    if name == "mask":
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None],
            enable_gqa=True,
        )
        return out.transpose(1, 2)
    return packed_attention(q, k, v, prepare(mask, dtype), enable_gqa=True)


def tiny_decoder(device: torch.device, quick: bool, max_seq_len: int):
    from fusion.models import llama3_2

    torch.manual_seed(0)
    if quick:
        return llama3_2(256, num_layers=2, num_heads=3, num_kv_heads=1, embed_dim=48,
                        max_seq_len=max_seq_len, intermediate_dim=64).to(device)  # fmt: skip
    return llama3_2(VOCAB, num_layers=2, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=WIDTH,
                    max_seq_len=max_seq_len, intermediate_dim=MLP).to(device)  # fmt: skip


def run_case(args, name: str, device: torch.device, seq_len: int, mode: str) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens_per_batch = 512 if args.quick else TOKENS
    rows = packed_rows(seq_len, max(tokens_per_batch // seq_len, 1), args.seed, args.quick)
    segments = PackedSegments.from_lengths(rows, seq_len, device=device)
    mask = contestant_mask(name, segments)
    b = len(rows)
    generator = torch.Generator(device="cpu").manual_seed(args.seed + seq_len)
    heads, kv_heads, head_dim = (3, 1, 16) if args.quick else (HEADS, KV_HEADS, HEAD_DIM)
    backward = mode == "fwd+bwd"
    real = segments.segment_ids >= 0  # [b, s]

    if args.level == "op":
        shapes = [(b, seq_len, heads, head_dim), *[(b, seq_len, kv_heads, head_dim)] * 2]
        q, k, v = (
            torch.randn(shape, generator=generator).to(device, dtype).requires_grad_(backward)
            for shape in shapes
        )
        grad = torch.randn(b, seq_len, heads, head_dim, generator=generator).to(device, dtype)

        def call():
            out = attention_call(name, q, k, v, mask, dtype)
            if backward:
                torch.autograd.grad(out, (q, k, v), grad)
            return out

        def output():
            with torch.no_grad():
                return attention_call(name, q, k, v, mask, dtype)[real]

    else:
        model = tiny_decoder(device, args.quick, seq_len)
        tokens = torch.randint(0, model.vocab_size, (b, seq_len), generator=generator).to(device)
        positions = torch.cat(
            [torch.cat([torch.arange(n) for n in row]) for row in segments.lengths]
        ).view(b, seq_len)
        positions = positions.to(device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

        def call():
            with autocast, torch.set_grad_enabled(backward):
                out = model(tokens, mask=mask, input_pos=positions)
                if backward:
                    out.sum().backward()
            return out

        def output():
            with autocast, torch.no_grad():
                return model(tokens, mask=mask, input_pos=positions)[real]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.set_grad_enabled(backward):
        started = time.perf_counter()
        call()
        sync()
        first = time.perf_counter() - started
        call()  # a second warm-up: allocator, autotuning after the first shapes
        sync()
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - started)
    return {
        "seq_len": seq_len,
        "mode": mode,
        "rows": b,
        "samples": sum(len(row) for row in rows),
        "padding": sum(segments.padding),
        "ms": statistics.median(times) * 1e3,
        "repeat_ms": [t * 1e3 for t in times],
        "first_call_ms": first * 1e3,
        "output": output().float().cpu(),
    }


def runs(name: str, device: torch.device, mode: str) -> bool:
    """Whether the contestant runs in this mode here."""
    if name == "flex" and device.type == "cpu" and mode == "fwd+bwd":
        return False  # torch 2.13: no FlexAttention backward on CPU
    return not (name == "varlen" and device.type != "cuda")


def run_worker(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    results = []
    for seq_len in args.seq_lens:
        for mode in args.modes:
            if runs(args.worker, device, mode):
                results.append(run_case(args, args.worker, device, seq_len, mode))
    for r in results:
        r["load_average_start"], r["load_average_end"] = load_start, os.getloadavg()
    return results


def run_contestant(args: argparse.Namespace, name: str, workdir: Path) -> list[dict]:
    """Contestant ``name``'s cases in a fresh process (in this one for ``--quick``)."""
    if args.quick:
        worker = argparse.Namespace(**vars(args))
        worker.worker = name
        return run_worker(worker)
    result = workdir / f"{name}.pt"
    command = [sys.executable, __file__, "--worker", name, "--result", str(result)]
    command += ["--device", args.device, "--level", args.level, "--threads", str(args.threads)]
    command += ["--seed", str(args.seed), "--repeats", str(args.repeats), "--modes", *args.modes]
    command += ["--seq-lens", *map(str, args.seq_lens)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return torch.load(result)


def round_order(names: list[str], round_index: int) -> list[str]:
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def summarise(rounds: dict[str, list[list[dict]]]) -> list[dict]:
    """Per case and contestant: median and range over rounds, the paired ratio to ``mask``
    (``mask_ms / ms`` within each round, the median over rounds), the largest difference from
    ``mask``'s output at the samples' positions."""
    key = lambda r: (r["seq_len"], r["mode"])  # noqa: E731
    by_case: dict = {}
    for name, name_rounds in rounds.items():
        for i, results in enumerate(name_rounds):
            for r in results:
                by_case.setdefault(key(r), {}).setdefault(name, [None] * len(name_rounds))[i] = r
    summary = []
    for (seq_len, mode), contestants in sorted(by_case.items()):
        baseline = contestants.get("mask")
        for name, per_round in contestants.items():
            ms = [r["ms"] for r in per_round]
            row = {
                "seq_len": seq_len,
                "mode": mode,
                "contestant": name,
                "rows": per_round[0]["rows"],
                "samples": per_round[0]["samples"],
                "padding": per_round[0]["padding"],
                "median_ms": statistics.median(ms),
                "min_ms": min(ms),
                "max_ms": max(ms),
                "round_ms": ms,
                "first_call_ms": [r["first_call_ms"] for r in per_round],
                "load_average_rounds": [
                    [r["load_average_start"], r["load_average_end"]] for r in per_round
                ],
            }
            if baseline is not None:
                pairs = zip(per_round, baseline, strict=True)
                row["x_mask"] = statistics.median(b["ms"] / r["ms"] for r, b in pairs)
                diff = (per_round[0]["output"] - baseline[0]["output"]).abs().max()
                row["max_abs_diff_vs_mask"] = float(diff)
            summary.append(row)
    return summary


def format_table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"packed attention, {s['level']} level, {s['device']}, {s['threads']} threads, "
        f"{s['rounds']} rounds (median [range]), {s['tokens_per_batch']} tokens a batch",
        f"{'s':>5} {'mode':8} {'rows':>4} {'samples':>7} {'contestant':10} "
        f"{'ms':>24} {'x mask':>7} {'max |diff|':>10}",
    ]
    for r in report["results"]:
        cell = f"{r['median_ms']:.1f} [{r['min_ms']:.1f}-{r['max_ms']:.1f}]"
        ratio = f"{r['x_mask']:.2f}" if "x_mask" in r else "-"
        diff = f"{r['max_abs_diff_vs_mask']:.1e}" if "max_abs_diff_vs_mask" in r else "-"
        lines.append(
            f"{r['seq_len']:>5} {r['mode']:8} {r['rows']:>4} {r['samples']:>7} "
            f"{r['contestant']:10} {cell:>24} {ratio:>7} {diff:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker is not None:
        torch.save(run_worker(args), args.result)
        return {}
    device = torch.device(args.device)
    info = machine(device)
    workdir = Path(tempfile.mkdtemp(prefix="packed_attention_bench_"))
    rounds: dict[str, list[list[dict]]] = {name: [] for name in args.only}
    for r in range(args.rounds):
        for name in round_order(args.only, r):
            started = time.perf_counter()
            rounds[name].append(run_contestant(args, name, workdir))
            print(f"round {r}: {name} done in {time.perf_counter() - started:.0f} s", flush=True)
    report = {
        "machine": info,
        "settings": {
            "device": args.device,
            "level": args.level,
            "threads": args.threads,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "seq_lens": args.seq_lens,
            "modes": args.modes,
            "contestants": args.only,
            "tokens_per_batch": 512 if args.quick else TOKENS,
            "quick": args.quick,
        },
        "results": summarise(rounds),
    }
    report["machine"]["load_average_end"] = os.getloadavg()
    table = format_table(report)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"packed_attention_{args.level}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{stem}_{device.type}.txt").write_text(table + "\n")
    print(f"wrote {args.out / stem}.json", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
