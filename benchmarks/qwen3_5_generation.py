"""Greedy decoding of a Qwen3.5-0.8B-wide model cut to 4 layers: ``fusion.generate`` against
transformers' eager ``generate``, on the same weights and prompts.

The model is transformers 5.24's ``Qwen3_5ForConditionalGeneration`` with Qwen3.5-0.8B's text
widths (hidden 1024, MLP 3584, full attention 8/2 heads of 256 with rotary on a quarter, Gated
DeltaNet 16/16 heads of 128 and kernel 4, tied output layer, interleaved M-RoPE 11/11/10,
theta 1e7) and 4 layers, three Gated DeltaNet then one full attention, its vocabulary cut to
``--vocab`` (32768; the 0.8B's 248320-wide output layer alone would cost more than the four
layers), a one-block vision tower (unused: text prompts), random weights as transformers
initialises them. It is saved once as a Hugging Face directory, which each side loads
(``fusion.checkpoint.load_hf_model``, ``from_pretrained``).

Contestants: ``fusion_eager`` (``fusion.generate(model, prompts, temperature=0)``),
``fusion_compiled`` (the same with ``compile=True``; ``--compile``, as it compiles in each
fresh process), ``transformers`` (``generate(do_sample=False)``, its dynamic hybrid cache; the
DeltaNet decoding step is its torch fallback, as nothing else runs on the CPU). Prompts: for
each batch size of ``--batches`` (1 and 4), ``--prompt-len`` (128) random text ids a row;
``--new-tokens`` (64) new tokens, no stop token.

Each contestant runs in a fresh process per round (``--rounds``, alternating order), with
``--threads`` torch threads: per batch size one untimed warm-up call of the full length
(compilation, lazy initialisation), then one timed call, in which each new token's time is
taken as it comes (``generate_stream``; a streamer for transformers). Reported per batch size
and contestant: new tokens/s over the call (prefill included) and decode tokens/s after the
first token, medians over rounds with their range, the process's CPU time, and the ratio to
transformers as the median over rounds of the ratio within a round. Every contestant's tokens
must equal transformers' (checked, reported; the run fails otherwise). Target (issue 37):
decoding at least 1.3x transformers' eager ``generate``, on the CPU.

    python benchmarks/qwen3_5_generation.py                 # 3 rounds, B=1 and 4, ~3 min
    python benchmarks/qwen3_5_generation.py --compile       # with fusion compiled
    python benchmarks/qwen3_5_generation.py --quick         # tiny, seconds, a temporary dir

Writes ``qwen3_5_generation.json`` and ``qwen3_5_generation_cpu.txt`` to ``--out``.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import QWEN3_5_TEXT, add_out_argument, machine, output_dir

CONTESTANTS = ("fusion_eager", "fusion_compiled", "transformers")
BASELINE = "transformers"
TARGET = 1.3  # fusion / transformers, tokens/s
PAD = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--compile", action="store_true", help="also fusion compiled")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny model, seconds")
    p.add_argument("--worker", choices=CONTESTANTS, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 2 or args.prompt_len < 1 or min(args.batches) < 1:
        p.error("--rounds, --prompt-len, --batches: at least 1; --new-tokens: at least 2")
    if args.quick:
        args.vocab, args.prompt_len, args.new_tokens = 256, 16, 4
    args.out = output_dir(args.out, check=args.quick)
    return args


def hf_config(vocab: int, quick: bool) -> dict:
    """``Qwen3_5Config`` fields: Qwen3.5-0.8B's text widths, 4 layers, ``vocab`` ids (its last
    eight the special tokens), a one-block vision tower; tiny widths for ``quick``."""
    text = QWEN3_5_TEXT | {
        "vocab_size": vocab,
        "num_hidden_layers": 4,
        "layer_types": [*["linear_attention"] * 3, "full_attention"],
        "tie_word_embeddings": True,
        "pad_token_id": PAD,
    }
    if quick:
        text |= {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
        text |= {"head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
        text |= {"linear_key_head_dim": 8, "linear_value_head_dim": 8}
        text["rope_parameters"] = text["rope_parameters"] | {"mrope_section": [2, 1, 1]}
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
    }
    return {
        "text_config": text,
        "vision_config": vision,
        "image_token_id": vocab - 4,
        "video_token_id": vocab - 3,
        "vision_start_token_id": vocab - 2,
        "vision_end_token_id": vocab - 1,
        "tie_word_embeddings": True,
    }


def write_model(args: argparse.Namespace, directory: Path) -> dict:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(args.seed)
    config = hf_config(args.vocab, args.quick)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**config)).eval()
    model.save_pretrained(directory)
    return {
        "config": config,
        "parameters": sum(p.numel() for p in model.parameters()),
        "text_parameters": sum(p.numel() for p in model.model.language_model.parameters()),
    }


def prompts(args: argparse.Namespace, batch: int) -> torch.Tensor:
    """Random text ids [batch, prompt_len], never the padding or a special id."""
    gen = torch.Generator().manual_seed(args.seed + batch)
    return torch.randint(1, args.vocab - 8, (batch, args.prompt_len), generator=gen)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Clock:
    """Each new token's time (called directly, or as a transformers streamer) and the
    process's CPU time, from when it was made."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.start, self.cpu_start = time.perf_counter(), cpu_seconds()
        self.times: list[float] = []
        self.tokens: list[list[int]] = []
        self.cpu_end = self.cpu_start

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # transformers passes the prompt first
            self.prompt_seen = True
            return
        self.step(value)

    def step(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.cpu_end = cpu_seconds()
        self.tokens.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass

    def report(self, batch: int) -> dict:
        n = len(self.times)
        first, last = self.times[0] - self.start, self.times[-1] - self.start
        return {
            "batch": batch,
            "new_tokens": n,
            "first_token_s": first,
            "total_s": last,
            "tokens_per_s": batch * n / last,
            "decode_tokens_per_s": batch * (n - 1) / (last - first),
            "total_cpu_s": self.cpu_end - self.cpu_start,
            # [batch, n]: each row's new tokens
            "tokens": [list(row) for row in zip(*self.tokens, strict=True)],
        }


def run_worker(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    if args.worker == BASELINE:
        from transformers import Qwen3_5ForConditionalGeneration
        from transformers.utils import logging

        logging.set_verbosity_error()  # its notes that the torch fallbacks run
        model = Qwen3_5ForConditionalGeneration.from_pretrained(args.model_dir).eval()
        model.generation_config.eos_token_id = None

        def run(tokens: torch.Tensor, n: int, clock: Clock | None) -> None:
            with torch.no_grad():
                model.generate(
                    input_ids=tokens,
                    attention_mask=torch.ones_like(tokens),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=PAD,
                    streamer=clock,
                )

    else:
        from fusion.checkpoint import load_hf_model
        from fusion.generation import generate_stream

        ours = load_hf_model(args.model_dir).eval()
        compiled = args.worker == "fusion_compiled"

        def run(tokens: torch.Tensor, n: int, clock: Clock | None) -> None:
            steps = generate_stream(
                ours, tokens, max_new_tokens=n, temperature=0, pad_id=PAD, compile=compiled
            )
            for step in steps:
                if clock is not None:
                    clock.step(step)

    results = []
    for batch in args.batches:
        tokens = prompts(args, batch)
        started = time.perf_counter()
        run(tokens, args.new_tokens, None)
        warmup = time.perf_counter() - started
        clock = Clock()
        run(tokens, args.new_tokens, clock)
        results.append(clock.report(batch) | {"warmup_s": warmup})
    for r in results:
        r["load_average_start"], r["load_average_end"] = load_start, os.getloadavg()
    return results


def run_contestant(args: argparse.Namespace, name: str, model_dir: Path, workdir: Path):
    """Contestant ``name``'s batch sizes in a fresh process (in this one for ``--quick``)."""
    if args.quick:
        worker = argparse.Namespace(**vars(args))
        worker.worker, worker.model_dir = name, model_dir
        return run_worker(worker)
    result = workdir / f"{name}.json"
    command = [sys.executable, __file__, "--worker", name, "--result", str(result)]
    command += ["--model-dir", str(model_dir), "--threads", str(args.threads)]
    command += ["--seed", str(args.seed), "--vocab", str(args.vocab)]
    command += ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    command += ["--batches", *map(str, args.batches)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def summarise(rounds: dict[str, list[list[dict]]]) -> tuple[list[dict], bool]:
    """Per batch size and contestant: medians and ranges over rounds, the paired ratio to
    transformers; and whether every contestant's tokens equal transformers' in every round."""
    summary, same = [], True
    batches = [r["batch"] for r in next(iter(rounds.values()))[0]]
    for batch in batches:
        per = {
            name: [next(r for r in runs if r["batch"] == batch) for runs in name_rounds]
            for name, name_rounds in rounds.items()
        }
        reference = per[BASELINE][0]["tokens"] if BASELINE in per else None
        for name, runs in per.items():
            row: dict = {"batch": batch, "contestant": name, "new_tokens": runs[0]["new_tokens"]}
            for key in ("tokens_per_s", "decode_tokens_per_s", "first_token_s", "total_cpu_s"):
                values = [r[key] for r in runs]
                row[key] = statistics.median(values)
                row[f"{key}_range"] = [min(values), max(values)]
                row[f"{key}_rounds"] = values
            row["warmup_s"] = [r["warmup_s"] for r in runs]
            row["load_average_rounds"] = [
                [r["load_average_start"], r["load_average_end"]] for r in runs
            ]
            if reference is not None:
                row["tokens_equal"] = all(r["tokens"] == reference for r in runs)
                same &= row["tokens_equal"]
                for key in ("tokens_per_s", "decode_tokens_per_s"):
                    pairs = zip(runs, per[BASELINE], strict=True)
                    ratios = [r[key] / b[key] for r, b in pairs]
                    row[f"x_transformers_{key}"] = statistics.median(ratios)
                    row[f"x_transformers_{key}_rounds"] = ratios
                pairs = zip(runs, per[BASELINE], strict=True)
                row["x_transformers_cpu"] = statistics.median(
                    b["total_cpu_s"] / r["total_cpu_s"] for r, b in pairs
                )
            summary.append(row)
    return summary, same


def format_table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"Qwen3.5-0.8B-wide, 4 layers (3 DeltaNet + 1 full), vocabulary {s['vocab']}, "
        f"{report['model']['parameters'] / 1e6:.1f}M parameters; prompts of {s['prompt_len']}, "
        f"{s['new_tokens']} new tokens, greedy; {s['threads']} threads, {s['rounds']} rounds "
        f"(median [range])",
        f"{'B':>2} {'contestant':16} {'tokens/s':>22} {'x transformers':>14} "
        f"{'decode tokens/s':>22} {'x transformers':>14} {'CPU s':>7} {'same':>5}",
    ]
    for r in report["results"]:
        cells = []
        for key in ("tokens_per_s", "decode_tokens_per_s"):
            low, high = r[f"{key}_range"]
            ratio = r.get(f"x_transformers_{key}")
            cells.append(f"{r[key]:.1f} [{low:.1f}-{high:.1f}]")
            cells.append("-" if ratio is None else f"{ratio:.2f}")
        lines.append(
            f"{r['batch']:>2} {r['contestant']:16} {cells[0]:>22} {cells[1]:>14} "
            f"{cells[2]:>22} {cells[3]:>14} {r['total_cpu_s']:>7.2f} "
            f"{r.get('tokens_equal', '-')!s:>5}"
        )
    for t in report["targets"]:
        met = "met" if t["met"] else "NOT met"
        lines.append(f"target {t['what']} >= {t['target']}: {t['measured']:.2f} ({met})")
    lines.append(
        f"load average {report['machine']['load_average_start']} -> "
        f"{report['machine']['load_average_end']}; same tokens: {report['same_tokens']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker is not None:
        args.result.write_text(json.dumps(run_worker(args)))
        return {}
    torch.set_num_threads(args.threads)
    info = machine(torch.device("cpu"), ("transformers",))
    names = [n for n in CONTESTANTS if n != "fusion_compiled" or args.compile]
    model_dir = Path(tempfile.mkdtemp(prefix="qwen3_5_generation_model_"))
    workdir = Path(tempfile.mkdtemp(prefix="qwen3_5_generation_bench_"))
    try:
        model = write_model(args, model_dir)
        rounds: dict[str, list[list[dict]]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                started = time.perf_counter()
                rounds[name].append(run_contestant(args, name, model_dir, workdir))
                print(
                    f"round {r}: {name} done in {time.perf_counter() - started:.0f} s", flush=True
                )
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    results, same = summarise(rounds)
    report = {
        "machine": info,
        "settings": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("worker", "result", "model_dir")
        },
        "model": model,
        "results": results,
        "same_tokens": same,
        "targets": [
            {
                "what": f"{r['contestant']} / transformers, tokens/s, B={r['batch']}",
                "target": TARGET,
                "measured": r["x_transformers_tokens_per_s"],
                "met": r["x_transformers_tokens_per_s"] >= TARGET,
            }
            for r in results
            if r["contestant"] != BASELINE and "x_transformers_tokens_per_s" in r
        ],
    }
    report["machine"]["load_average_end"] = os.getloadavg()
    table = format_table(report)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qwen3_5_generation.json").write_text(json.dumps(report, indent=1))
    (args.out / "qwen3_5_generation_cpu.txt").write_text(table + "\n")
    print(f"wrote {args.out / 'qwen3_5_generation.json'}", file=sys.stderr)
    if not same:
        raise SystemExit("fusion's tokens differ from transformers' (see the table)")
    return report


if __name__ == "__main__":
    main()
