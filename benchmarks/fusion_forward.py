"""What EarlyFusion adds over its decoder: forward and forward+backward, side by side.

``fusion``: ``EarlyFusion(decoder, ...)(tokens, encoder_input={"image": rows})``, with the
encoder's rows precomputed, so only the fusion layer itself (input checks and the merge) is
extra. ``decoder``: the same decoder object fed the same embeddings as ``input_embeds``,
merged once beforehand. ``merge``: ``merge_embeddings`` alone, the cost that fusion adds.

    python benchmarks/fusion_forward.py            # the small Llama shape
    python benchmarks/fusion_forward.py --quick    # seconds: checks that the script works

The decoder is frozen, as ``EarlyFusion`` leaves it by default; forward+backward takes the
gradient w.r.t. the encoder rows (fusion) or ``input_embeds`` (decoder). Each round times
the contestants back to back with ``torch.utils.benchmark`` (alternating their order); the
overhead is the median over rounds of ``fusion / decoder - 1``, and, far less noisy on shared
cores, ``merge / decoder`` from the same rounds. Writes ``fusion_forward.json`` to ``--out``.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
from common import add_out_argument, output_dir
from torch import nn
from torch.utils.benchmark import Timer

from fusion import EarlyFusion, merge_embeddings
from fusion.merge import default_impl
from fusion.models import llama3_2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--fraction", type=float, default=0.25, help="placeholder fraction")
    p.add_argument("--block", type=int, default=128, help="placeholder block (image) length")
    p.add_argument("--rounds", type=int, default=15, help="back-to-back measurements")
    p.add_argument("--min-run-time", type=float, default=0.2, help="seconds per measurement")
    p.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    add_out_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    args.out = output_dir(args.out, check=args.quick)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.vocab, args.layers, args.heads, args.kv_heads, args.dim = 256, 1, 2, 1, 32
        args.batch, args.seq_len, args.block, args.rounds, args.min_run_time = 1, 64, 8, 3, 0.01
    return args


def build(args: argparse.Namespace):
    torch.manual_seed(args.seed)
    decoder = llama3_2(
        vocab_size=args.vocab,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        embed_dim=args.dim,
        max_seq_len=args.seq_len,
    ).eval()
    image_id = args.vocab  # outside the vocabulary
    model = EarlyFusion(decoder, {"image": nn.Identity()}, {"image": image_id})
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    n_blocks = round(args.fraction * args.seq_len / args.block)
    stride = args.seq_len // max(n_blocks, 1)
    for k in range(n_blocks):  # image blocks spread evenly over every sample
        tokens[:, k * stride : k * stride + args.block] = image_id
    rows = torch.randn(int((tokens == image_id).sum()), args.dim)
    weight = decoder.tok_embeddings.weight
    embeds = merge_embeddings(tokens, weight, {"image": rows}, {"image": image_id}).detach()
    return model, decoder, tokens, rows, embeds, image_id


def calls(model, decoder, tokens, rows, embeds, image_id, mode: str) -> dict:
    weight = decoder.tok_embeddings.weight
    if mode == "fwd":
        return {
            "fusion": lambda: model(tokens, encoder_input={"image": rows}),
            "decoder": lambda: decoder(input_embeds=embeds),
            "merge": lambda: merge_embeddings(tokens, weight, {"image": rows}, {"image": image_id}),
        }
    rows_g, embeds_g = rows.clone().requires_grad_(), embeds.clone().requires_grad_()

    def fusion() -> object:
        out = model(tokens, encoder_input={"image": rows_g})
        return torch.autograd.grad(out.sum(), [rows_g])

    def plain() -> object:
        return torch.autograd.grad(decoder(input_embeds=embeds_g).sum(), [embeds_g])

    def merge() -> object:
        out = merge_embeddings(tokens, weight, {"image": rows_g}, {"image": image_id})
        return torch.autograd.grad(out, [rows_g], torch.ones_like(out))

    return {"fusion": fusion, "decoder": plain, "merge": merge}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model, decoder, tokens, rows, embeds, image_id = build(args)
    with torch.no_grad():
        same = torch.equal(
            model(tokens, encoder_input={"image": rows}), decoder(input_embeds=embeds)
        )
    if not same:
        raise AssertionError("EarlyFusion and the decoder fed the merged embeddings disagree")
    threads = torch.get_num_threads()
    results = {}
    for mode in ("fwd", "fwd+bwd"):
        fns = calls(model, decoder, tokens, rows, embeds, image_id, mode)
        timers = {
            name: Timer("fn()", globals={"fn": fn}, num_threads=threads) for name, fn in fns.items()
        }
        for timer in timers.values():  # warm-up, and how many calls make one measurement
            timer.timeit(1)
        number = {
            name: max(1, round(args.min_run_time / timer.timeit(1).median))
            for name, timer in timers.items()
        }
        times: dict[str, list[float]] = {name: [] for name in fns}
        for i in range(args.rounds):
            # Back to back, in alternating order: drift in the machine's load hits both alike.
            for name in list(timers)[:: 1 if i % 2 == 0 else -1]:
                times[name].append(timers[name].timeit(number[name]).median)
        rounds = list(zip(times["fusion"], times["decoder"], times["merge"], strict=True))
        results[mode] = {
            "median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
            "round_ms": {name: [x * 1e3 for x in t] for name, t in times.items()},
            "min_ms": {name: min(t) * 1e3 for name, t in times.items()},
            "overhead_pct": 100 * statistics.median(f / d - 1 for f, d, _ in rounds),
            "overhead_pct_of_minimums": 100 * (min(times["fusion"]) / min(times["decoder"]) - 1),
            "merge_share_pct": 100 * statistics.median(m / d for _, d, m in rounds),
        }
    report = {
        "machine": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "torch_threads": threads,
            "load_average_end": os.getloadavg(),
        },
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "default_impl": default_impl(tokens.device, decoder.tok_embeddings),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fusion_forward.json").write_text(json.dumps(report, indent=1))
    shape = (
        f"vocab {args.vocab}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
        f"dim {args.dim}, batch {args.batch} x {args.seq_len} tokens, "
        f"{args.fraction:.0%} placeholders"
    )
    print(f"EarlyFusion vs decoder(input_embeds=...): {shape}")
    for mode, r in results.items():
        ms = r["median_ms"]
        print(
            f"{mode:8} fusion {ms['fusion']:9.2f} ms  decoder {ms['decoder']:9.2f} ms  "
            f"merge {ms['merge']:7.2f} ms  overhead {r['overhead_pct']:+5.2f}%  "
            f"merge/decoder {r['merge_share_pct']:5.2f}%"
        )
        mins = r["min_ms"]
        print(
            f"{'':8} minimums: fusion {mins['fusion']:9.2f} ms  decoder {mins['decoder']:9.2f} ms  "
            f"merge {mins['merge']:7.2f} ms  overhead {r['overhead_pct_of_minimums']:+5.2f}%"
        )
    print(f"wrote {args.out / 'fusion_forward.json'}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
