"""One Gated DeltaNet layer (Qwen3.5's linear attention): fusion packed and padded against
transformers' ``Qwen3_5GatedDeltaNet`` on a padded batch, forward and forward+backward.

Contestants, on the same weights and the same tokens (the samples' hidden states):

- ``fusion_packed``: ``fusion.decoder.GatedDeltaNet`` on rows packed first-fit from the
  samples (``--row-len`` tokens a row), its ``mask`` the rows' ``SampleRegions`` (made from
  ``PackedSegments`` in every timed call, as a decoder makes it once per forward);
- ``fusion_padded``: the same layer on the padded batch (one sample a row, right-padded to the
  longest), its ``mask`` the real tokens ``[b, s]``;
- ``transformers_padded``: transformers 5.24's ``Qwen3_5GatedDeltaNet`` on the padded batch
  with its 2-D ``attention_mask``: its pure-torch kernels (``torch_chunk_gated_delta_rule``,
  ``causal_conv1d_fn``; flash-linear-attention and causal-conv1d are not installed, and on the
  CPU it cannot pack: its torch kernels refuse ``cu_seq_lens``).

Widths: Qwen3.5-0.8B's (hidden 1024, 16 key and 16 value heads of 128, kernel 4, chunk 64).
Samples: ``--samples`` (8) of the LLaVA-Instruct-like length mix of ``packed_attention.py``
(64 image rows and 4 wrapper tokens, a question of 8-40 tokens, an answer of 10-400: 85 to 513
tokens), fixed seed; random hidden states, and for forward+backward a random output gradient
on the real tokens (zero at padding), with the gradients of the input and every parameter
taken by ``torch.autograd.grad`` (never accumulated). Transformers' weights are ours, loaded
by name (``norm.scale`` is its ``norm.weight``).

Before any timing (once, in this process) the three are checked to compute the same thing:
the outputs at real tokens and the input gradients there agree within ``--tolerance`` (1e-4,
absolute), the parameter gradients (sums over every token) within it relative to each one's
largest entry; the run fails otherwise. Timing: each contestant runs in a fresh
process per round (``--rounds``, alternating order: as given, then reversed, ...) with
``--threads`` torch threads; in it each mode is warmed up once and timed ``--repeats`` times,
the median kept, with the process's CPU time (user and system, all threads). Then, untimed,
the peak transient memory of one call (the profiler's allocator events: peak bytes allocated
during the call beyond what is still allocated when it returns; for forward+backward the
gradients are what is left).

Reported per mode and contestant: non-padding tokens/s (median over rounds and range), tokens
per CPU-second, and the ratio to transformers padded as the median over rounds of the ratio
within a round. Target (issue 37): fusion packed at least 1.5x transformers padded, on the CPU.

    python benchmarks/deltanet_layer.py                # 3 rounds, ~5 min on 2 cores
    python benchmarks/deltanet_layer.py --quick        # tiny, seconds, a temporary directory
    python benchmarks/deltanet_layer.py --profile      # also a torch.profiler table of fusion's

Writes ``deltanet_layer.json`` and ``deltanet_layer_<device>.txt`` (the table) to ``--out``.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from common import add_out_argument, machine, output_dir
from merge_kernels import transient_bytes
from packed_attention import sample_lengths

from fusion.data import pack
from fusion.decoder import GatedDeltaNet, PackedSegments

CONTESTANTS = ("fusion_packed", "fusion_padded", "transformers_padded")
BASELINE = "transformers_padded"
TARGET = 1.5  # fusion packed / transformers padded, tokens/s
#: Qwen3.5-0.8B's Gated DeltaNet, and a tiny one for ``--quick``.
WIDTHS = {
    "full": {"embed_dim": 1024, "k_heads": 16, "v_heads": 16, "k_dim": 128, "v_dim": 128},
    "quick": {"embed_dim": 32, "k_heads": 2, "v_heads": 4, "k_dim": 8, "v_dim": 8},
}
KERNEL, CHUNK = 4, 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--row-len", type=int, default=2048, help="packed rows' length")
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    p.add_argument("--only", nargs="+", choices=CONTESTANTS, default=list(CONTESTANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--no-memory", action="store_true", help="skip the (untimed) memory probe")
    p.add_argument("--profile", action="store_true", help="profile fusion's calls once")
    p.add_argument("--quick", action="store_true", help="tiny widths and samples, seconds")
    p.add_argument("--worker", choices=CONTESTANTS, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1 or args.samples < 1:
        p.error("--rounds, --repeats, --samples: expected at least 1")
    if args.quick:
        args.row_len, args.repeats = 256, 1
    args.out = output_dir(args.out, check=args.quick)
    return args


# ------------------------------------------------------------------ the work


class Work:
    """The samples, their packed rows and padded batch, and the layers' weights."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.widths = WIDTHS["quick" if args.quick else "full"]
        self.lengths = sample_lengths(args.samples, args.seed, args.quick)
        if max(self.lengths) > args.row_len:
            raise ValueError(f"--row-len {args.row_len}: a sample has {max(self.lengths)} tokens")
        self.tokens = sum(self.lengths)
        gen = torch.Generator().manual_seed(args.seed)
        d = self.widths["embed_dim"]
        self.xs = [torch.randn(n, d, generator=gen) for n in self.lengths]
        self.grads = [torch.randn(n, d, generator=gen) for n in self.lengths]
        # Packed: first-fit rows, each right-padded to --row-len.
        self.rows = pack(self.lengths, args.row_len)
        self.row_lengths = [[self.lengths[i] for i in row] for row in self.rows]
        self.packed_x = torch.zeros(len(self.rows), args.row_len, d)
        self.packed_grad = torch.zeros_like(self.packed_x)
        where: dict[int, tuple[int, int]] = {}
        for r, row in enumerate(self.rows):
            at = 0
            for i in row:
                n = self.lengths[i]
                self.packed_x[r, at : at + n] = self.xs[i]
                self.packed_grad[r, at : at + n] = self.grads[i]
                where[i] = (r, at)
                at += n
        self.packed_where = [where[i] for i in range(len(self.lengths))]
        # Padded: one sample a row, right-padded to the longest.
        s = max(self.lengths)
        b = len(self.lengths)
        self.padded_x = torch.zeros(b, s, d)
        self.padded_grad = torch.zeros_like(self.padded_x)
        self.real = torch.zeros(b, s, dtype=torch.bool)
        for i, n in enumerate(self.lengths):
            self.padded_x[i, :n], self.padded_grad[i, :n], self.real[i, :n] = (
                self.xs[i],
                self.grads[i],
                True,
            )
        torch.manual_seed(args.seed)
        w = self.widths
        self.ours = GatedDeltaNet(
            d, w["k_heads"], w["v_heads"], w["k_dim"], w["v_dim"], KERNEL, chunk_size=CHUNK
        )
        with torch.no_grad():  # the zero-initialised parts random too, so every path matters
            self.ours.norm.scale.uniform_(0.5, 1.5)
            self.ours.conv1d.weight.normal_(0, 0.5)

    @property
    def positions(self) -> dict[str, int]:
        return {
            "packed": self.packed_x.shape[0] * self.packed_x.shape[1],
            "padded": self.padded_x.shape[0] * self.padded_x.shape[1],
        }

    def transformers_layer(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers import Qwen3_5TextConfig
            from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
        w = self.widths
        config = Qwen3_5TextConfig(
            hidden_size=w["embed_dim"],
            linear_num_key_heads=w["k_heads"],
            linear_num_value_heads=w["v_heads"],
            linear_key_head_dim=w["k_dim"],
            linear_value_head_dim=w["v_dim"],
            linear_conv_kernel_dim=KERNEL,
            num_hidden_layers=4,
        )
        layer = Qwen3_5GatedDeltaNet(config, 0)
        state = {
            ("norm.weight" if k == "norm.scale" else k): v
            for k, v in self.ours.state_dict().items()
        }
        layer.load_state_dict(state)
        return layer


def contestant_call(name: str, work: Work, backward: bool):
    """The timed call of ``name`` (its input made to require grad for ``fwd+bwd``), and what it
    computed at the samples' tokens: per sample its output, its input gradient, then the
    parameter gradients by our names."""
    if name == BASELINE:
        layer = work.transformers_layer()
        x, grad = work.padded_x.clone(), work.padded_grad
        attention_mask = work.real.long()

        def forward(x):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return layer(x, attention_mask=attention_mask)

    else:
        layer = work.ours
        if name == "fusion_packed":
            x, grad = work.packed_x.clone(), work.packed_grad
            segments = PackedSegments.from_lengths(work.row_lengths, x.shape[1])

            def forward(x):
                return layer(x, mask=layer.token_layout(segments, None))

        else:
            x, grad = work.padded_x.clone(), work.padded_grad

            def forward(x):
                return layer(x, mask=work.real)

    params = [p for _, p in layer.named_parameters()]
    names = [n.replace("norm.weight", "norm.scale") for n, _ in layer.named_parameters()]
    x.requires_grad_(backward)

    def call():
        with torch.set_grad_enabled(backward):
            out = forward(x)
            if backward:
                return out, torch.autograd.grad(out, [x, *params], grad)
            return out, None

    def samples(out: torch.Tensor, grads) -> dict[str, torch.Tensor]:
        found = {}
        for i, n in enumerate(work.lengths):
            r, at = work.packed_where[i] if name == "fusion_packed" else (i, 0)
            found[f"out{i}"] = out[r, at : at + n].detach()
            if grads is not None:
                found[f"grad_x{i}"] = grads[0][r, at : at + n]
        if grads is not None:
            found |= {f"grad.{n}": g for n, g in zip(names, grads[1:], strict=True)}
        return found

    return call, samples


def check_agreement(args: argparse.Namespace, work: Work) -> dict:
    """Every contestant's outputs and input gradients at the samples' tokens against
    transformers padded's, the largest absolute difference of each; its parameter gradients'
    largest difference relative to the largest entry of each (raises above the tolerance)."""
    found = {}
    for name in CONTESTANTS:
        call, samples = contestant_call(name, work, backward=True)
        found[name] = samples(*call())
    report: dict = {}
    for name in CONTESTANTS:
        diffs: dict[str, float] = {}
        for key, value in found[name].items():
            kind = "out" if key.startswith("out") else "grad_x" if key.startswith("grad_x") else key
            reference = found[BASELINE][key]
            diff = float((value - reference).abs().max())
            if kind.startswith("grad."):  # a sum over every token: relative to its largest
                diff /= max(float(reference.abs().max()), 1e-30)
            diffs[kind] = max(diffs.get(kind, 0.0), diff)
        report[name] = {
            "max_abs_diff_out": diffs.pop("out"),
            "max_abs_diff_grad_x": diffs.pop("grad_x"),
            "max_rel_diff_grad_params": max(diffs.values()),
        }
        worst = max(report[name].values())
        if worst > args.tolerance:
            raise AssertionError(
                f"{name} differs from transformers by {worst:.2e} (> {args.tolerance}): "
                f"{report[name]}"
            )
    return report


# ------------------------------------------------------------------ measurements


def quiet_transformers() -> None:
    """Silence transformers' notes that its torch fallbacks run (they are the contestant)."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_worker(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    quiet_transformers()
    load_start = os.getloadavg()
    work = Work(args)
    results = []
    for mode in args.modes:
        call, _ = contestant_call(args.worker, work, backward=mode == "fwd+bwd")
        started = time.perf_counter()
        call()
        first = time.perf_counter() - started
        times, cpu = [], []
        for _ in range(args.repeats):
            started, cpu_started = time.perf_counter(), cpu_seconds()
            call()
            times.append(time.perf_counter() - started)
            cpu.append(cpu_seconds() - cpu_started)
        results.append(
            {
                "mode": mode,
                "ms": statistics.median(times) * 1e3,
                "repeat_ms": [t * 1e3 for t in times],
                "cpu_ms": statistics.median(cpu) * 1e3,
                "first_call_ms": first * 1e3,
                "transient_bytes": None
                if args.no_memory
                else transient_bytes(call, torch.device("cpu")),
            }
        )
    for r in results:
        r["load_average_start"], r["load_average_end"] = load_start, os.getloadavg()
    return results


def run_contestant(args: argparse.Namespace, name: str, workdir: Path) -> list[dict]:
    """Contestant ``name``'s modes in a fresh process (in this one for ``--quick``)."""
    if args.quick:
        worker = argparse.Namespace(**vars(args))
        worker.worker = name
        return run_worker(worker)
    result = workdir / f"{name}.json"
    command = [sys.executable, __file__, "--worker", name, "--result", str(result)]
    command += ["--threads", str(args.threads), "--seed", str(args.seed)]
    command += ["--repeats", str(args.repeats), "--samples", str(args.samples)]
    command += ["--row-len", str(args.row_len), "--modes", *args.modes]
    command += ["--no-memory"] * args.no_memory
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def round_order(names: list[str], round_index: int) -> list[str]:
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def summarise(rounds: dict[str, list[list[dict]]], work: Work) -> list[dict]:
    """Per mode and contestant: tokens/s (non-padding) median and range over rounds, per
    CPU-second, the paired ratio to transformers padded, the transient memory."""
    summary = []
    for mode in dict.fromkeys(r["mode"] for runs in rounds.values() for r in runs[0]):
        per = {
            name: [next(r for r in runs if r["mode"] == mode) for runs in name_rounds]
            for name, name_rounds in rounds.items()
        }
        for name, runs in per.items():
            tps = [work.tokens / (r["ms"] / 1e3) for r in runs]
            cpu_tps = [work.tokens / (r["cpu_ms"] / 1e3) for r in runs]
            row = {
                "mode": mode,
                "contestant": name,
                "tokens": work.tokens,
                "positions": work.positions["packed" if name == "fusion_packed" else "padded"],
                "tokens_per_s": statistics.median(tps),
                "tokens_per_s_range": [min(tps), max(tps)],
                "tokens_per_s_rounds": tps,
                "tokens_per_cpu_s": statistics.median(cpu_tps),
                "median_ms": statistics.median(r["ms"] for r in runs),
                "round_ms": [r["ms"] for r in runs],
                "round_cpu_ms": [r["cpu_ms"] for r in runs],
                "first_call_ms": [r["first_call_ms"] for r in runs],
                "transient_bytes": runs[0]["transient_bytes"],
                "load_average_rounds": [
                    [r["load_average_start"], r["load_average_end"]] for r in runs
                ],
            }
            if BASELINE in per:
                pairs = zip(runs, per[BASELINE], strict=True)
                ratios = [b["ms"] / r["ms"] for r, b in pairs]
                row["x_transformers"] = statistics.median(ratios)
                row["x_transformers_rounds"] = ratios
                cpu_pairs = zip(runs, per[BASELINE], strict=True)
                row["x_transformers_cpu"] = statistics.median(
                    b["cpu_ms"] / r["cpu_ms"] for r, b in cpu_pairs
                )
            summary.append(row)
    return summary


def targets(results: list[dict]) -> list[dict]:
    out = []
    for r in results:
        if r["contestant"] == "fusion_packed" and "x_transformers" in r:
            out.append(
                {
                    "what": f"fusion packed / transformers padded, tokens/s, {r['mode']}",
                    "target": TARGET,
                    "measured": r["x_transformers"],
                    "met": r["x_transformers"] >= TARGET,
                }
            )
    return out


def profile_fusion(args: argparse.Namespace, work: Work) -> str:
    """torch.profiler's table (self CPU time) of fusion packed, one call per mode, untimed."""
    from torch.profiler import ProfilerActivity, profile

    tables = []
    for mode in args.modes:
        call, _ = contestant_call("fusion_packed", work, backward=mode == "fwd+bwd")
        call()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        tables.append(f"fusion_packed {mode}\n{table}")
    return "\n".join(tables)


def format_table(report: dict) -> str:
    s, w = report["settings"], report["work"]
    lines = [
        f"Gated DeltaNet layer (width {w['widths']['embed_dim']}, {w['widths']['k_heads']}/"
        f"{w['widths']['v_heads']} heads of {w['widths']['k_dim']}), {w['samples']} samples, "
        f"{w['tokens']} tokens; packed {w['packed_rows']} x {s['row_len']}, padded "
        f"{w['samples']} x {w['padded_len']}; {s['threads']} threads, {s['rounds']} rounds "
        f"(median [range])",
        f"{'mode':8} {'contestant':20} {'tokens/s':>26} {'x transformers':>14} "
        f"{'per CPU-s':>10} {'transient MiB':>13}",
    ]
    for r in report["results"]:
        low, high = r["tokens_per_s_range"]
        cell = f"{r['tokens_per_s']:.0f} [{low:.0f}-{high:.0f}]"
        ratio = r.get("x_transformers")
        mem = r["transient_bytes"]
        lines.append(
            f"{r['mode']:8} {r['contestant']:20} {cell:>26} "
            f"{'-' if ratio is None else f'{ratio:.2f}':>14} {r['tokens_per_cpu_s']:>10.0f} "
            f"{'-' if mem is None else f'{mem / 2**20:.1f}':>13}"
        )
    for t in report["targets"]:
        met = "met" if t["met"] else "NOT met"
        lines.append(f"target {t['what']} >= {t['target']}: {t['measured']:.2f} ({met})")
    lines.append(
        f"load average {report['machine']['load_average_start']} -> "
        f"{report['machine']['load_average_end']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker is not None:
        args.result.write_text(json.dumps(run_worker(args)))
        return {}
    torch.set_num_threads(args.threads)
    quiet_transformers()
    info = machine(torch.device("cpu"), ("transformers",))
    work = Work(args)
    agreement = check_agreement(args, work)
    print(f"agreement with transformers: {agreement}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="deltanet_layer_bench_"))
    rounds: dict[str, list[list[dict]]] = {name: [] for name in args.only}
    for r in range(args.rounds):
        for name in round_order(args.only, r):
            started = time.perf_counter()
            rounds[name].append(run_contestant(args, name, workdir))
            print(f"round {r}: {name} done in {time.perf_counter() - started:.0f} s", flush=True)
    results = summarise(rounds, work)
    report = {
        "machine": info,
        "settings": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("worker", "result")
        },
        "work": {
            "widths": work.widths,
            "kernel": KERNEL,
            "chunk_size": CHUNK,
            "samples": len(work.lengths),
            "lengths": work.lengths,
            "tokens": work.tokens,
            "packed_rows": len(work.rows),
            "packed_row_lengths": work.row_lengths,
            "padded_len": max(work.lengths),
            "positions": work.positions,
        },
        "agreement": agreement,
        "results": results,
        "targets": targets(results),
    }
    if args.profile:
        report["profile"] = profile_fusion(args, work)
    report["machine"]["load_average_end"] = os.getloadavg()
    table = format_table(report)
    print(table)
    if args.profile:
        print(report["profile"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "deltanet_layer.json").write_text(json.dumps(report, indent=1))
    (args.out / "deltanet_layer_cpu.txt").write_text(
        table + ("\n\n" + report["profile"] if args.profile else "") + "\n"
    )
    print(f"wrote {args.out / 'deltanet_layer.json'}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
