"""One AdamW step over a Qwen2.5-VL fine-tuning benchmark's parameters: torch's for-loop
AdamW (its default on the CPU), its foreach AdamW and its fused AdamW (the recipes' since
issue 40, :func:`fusion.training.adamw_warmup_cosine`).

Parameters: the shapes of ``benchmarks/finetune.py --family qwen2_5_vl --train full``'s text
side (Qwen2.5-VL-3B's widths: the 151,936 x 2048 embedding, ``--layers`` decoder layers of
width 2048 with 16 query and 2 key-value heads of 128 and a SwiGLU of 11,008, their norms and
q/k/v biases), float32, random values and gradients, fixed seed; ``--quick`` shrinks every
width 16-fold. Each contestant runs in a fresh process per round (``--rounds``, alternating
order: as given, then reversed, ...) with ``--threads`` torch threads: one untimed step (which
makes the state), then ``--repeats`` timed steps, the median kept. The three are checked to
compute the same update first (within 1e-6 of each other, absolute, after three steps).

Reported per contestant: the step's median over rounds and its range, and the ratio to the
for-loop as the median over rounds of the ratio within a round.

    python benchmarks/optimizer_step.py            # 3 rounds, ~1 min on 2 cores
    python benchmarks/optimizer_step.py --quick    # tiny, in this process: checks the script

Writes ``optimizer_step.json`` to ``--out``.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from common import add_out_argument, machine, output_dir

CONTESTANTS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
BASELINE = "loop"


def parameter_shapes(layers: int, shrink: int) -> list[tuple[int, ...]]:
    """The text side's parameter shapes, every width divided by ``shrink``."""
    dim, ffn, vocab, kv = 2048 // shrink, 11008 // shrink, 151936 // shrink, 256 // shrink
    layer = [(dim, dim), (dim,), (kv, dim), (kv,), (kv, dim), (kv,), (dim, dim)]
    layer += [(ffn, dim), (ffn, dim), (dim, ffn), (dim,), (dim,)]
    return [(vocab, dim), *layer * layers, (dim,)]


def optimizer(name: str, shapes: list[tuple[int, ...]]) -> torch.optim.AdamW:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param)
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), **CONTESTANTS[name])


def check_same_update(shapes: list[tuple[int, ...]]) -> None:
    stepped = {}
    for name in CONTESTANTS:
        adamw = optimizer(name, shapes)
        for _ in range(3):
            adamw.step()
        stepped[name] = [p.detach() for group in adamw.param_groups for p in group["params"]]
    for name, params in stepped.items():
        for ours, loop in zip(params, stepped[BASELINE], strict=True):
            if not torch.allclose(ours, loop, rtol=0, atol=1e-6):
                sys.exit(f"{name}'s AdamW differs from the loop's by {(ours - loop).abs().max()}")


def step_ms(args: argparse.Namespace, name: str) -> float:
    """``name``'s median step in milliseconds, in this process."""
    torch.set_num_threads(args.threads)
    adamw = optimizer(name, parameter_shapes(args.layers, args.shrink))
    adamw.step()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        adamw.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run_round(args: argparse.Namespace, order: list[str]) -> dict[str, float]:
    """Each contestant's step, in a fresh process each (``--quick``: in this one)."""
    if args.quick:
        return {name: step_ms(args, name) for name in order}
    measured = {}
    for name in order:
        command = [sys.executable, __file__, "--worker", name, "--threads", str(args.threads)]
        command += ["--layers", str(args.layers), "--shrink", str(args.shrink)]
        command += ["--repeats", str(args.repeats)]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        measured[name] = json.loads(done.stdout.splitlines()[-1])["step_ms"]
    return measured


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="widths / 16, one round, in this process: a check"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worker", choices=CONTESTANTS, help=argparse.SUPPRESS)
    p.add_argument("--shrink", type=int, default=1, help=argparse.SUPPRESS)
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        args.shrink, args.rounds, args.repeats = 16, 1, 2
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps({"step_ms": step_ms(args, args.worker)}))
        return {}
    shapes = parameter_shapes(args.layers, args.shrink)
    check_same_update(parameter_shapes(1, 64))
    rounds = []
    for index in range(args.rounds):
        order = list(CONTESTANTS) if index % 2 == 0 else list(reversed(CONTESTANTS))
        rounds.append(run_round(args, order))
    results = {
        name: {
            "step_ms_median": statistics.median(r[name] for r in rounds),
            "step_ms_range": [min(r[name] for r in rounds), max(r[name] for r in rounds)],
            "speedup_over_loop": statistics.median(r[BASELINE] / r[name] for r in rounds),
        }
        for name in CONTESTANTS
    }
    report = {
        "machine": machine(torch.device("cpu")),
        "settings": {**vars(args), "out": None, "parameters": sum(map(_numel, shapes))},
        "rounds": rounds,
        "results": results,
    }
    out = output_dir(args.out, check=args.quick)
    out.mkdir(parents=True, exist_ok=True)
    (out / "optimizer_step.json").write_text(json.dumps(report, indent=2) + "\n")
    for name, result in results.items():
        low, high = result["step_ms_range"]
        print(
            f"{name:8s} {result['step_ms_median']:9.1f} ms  [{low:.1f}, {high:.1f}]  "
            f"{result['speedup_over_loop']:.2f}x the loop"
        )
    print(f"wrote {out / 'optimizer_step.json'}")
    return report


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


if __name__ == "__main__":
    main()
