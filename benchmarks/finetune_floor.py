"""The arithmetic floor under ``benchmarks/finetune.py``'s CPU results: how fast and how lean
any implementation of each contestant's step could be on this machine, from the work the step
cannot skip, so that a target can be checked against what the hardware allows.

For the model, samples and steps of ``finetune.py`` (same flags), in this process:

- **work**: the floating-point operations of each contestant's first timed step, forward and
  backward (:class:`torch.utils.flop_counter.FlopCounterMode`: matrix products, convolutions
  and attention, but not CPU flash attention, which torch 2.13 does not count; elementwise
  work and the optimizer step are left out, so the floor is low), in total and in the frozen
  vision tower (its forward under ``no_grad``);
- **rate**: the best rate this machine reaches in fp32 matrix products at the model's own
  shapes (the fastest of ``--rounds`` rounds, the fastest shape: generous, and robust to
  other jobs on the cores, which only slow rounds down). With ``--results`` from a run that
  timed them after each of its rounds (``matrix_rate``, in a fresh process), the best of
  those: the machine's speed in the minutes the steps were timed, which can be 10-20% off
  its speed an hour apart; the rate measured now is reported beside it;
- **time floor** = work / rate: no implementation of the step is faster;
- **kernels alone**: the same step's matrix products, convolutions and attention (CPU flash
  attention included), each timed alone at its own shapes and layouts in a fresh process with
  the run's threads and huge pages (``kernel_replay.py``), summed: the time a step decomposed
  into these kernels takes with nothing between them. Their rate over the best rate measured
  now is the share of the time floor such a step would reach (``reach``); against a measured
  step, the share of it the kernels take, the rest being everything between them;
- **memory floor** of ``fusion_packed``: the resident set of this process before any model
  (torch and the library imported, the run's samples made, as every contestant's process
  holds them), plus the model's parameters, plus the trained parameters' AdamW state
  (created by the first step, resident from then on), plus the step's inputs (the tensors of
  its batch that the forward does not keep), plus the larger of the activations its forward
  saves for the backward pass (measured with saved-tensor hooks; the weights themselves are
  not counted again), all live when the backward pass starts, and the trained parameters'
  gradients, all live when the optimizer steps;
- **loss-time floor** of ``fusion_packed``'s own loss: the same resident part, plus every
  saved activation, plus what its loss holds beside them at the end of the forward: one
  chunk's float32 logits (the largest of the even chunks of at most the run's
  ``--loss-chunk-rows``, by default ``fused_token_loss``'s) and, for the fused loss without
  ``--defer-output-grad``, the trained output's gradient, which it makes there. No run of this
  loss design is leaner; where it is above the memory floor by more than a target allows, the
  target is below what the design can reach, and the deferral is the way under it.

With ``--results`` (a ``finetune.json`` measured on this machine, whose settings are taken)
the floors are set against the measured medians: the best ratio ``fusion_packed`` could reach
against each baseline's measured step (the baseline as it is, ``fusion_packed`` at its
floor); against ``fusion_padded`` at equal efficiency (the two run the same kernels, so their
times scale with their work); and the memory floor against the measured peak of
``transformers_padded``. A time floor only bounds times measured on the same machine in the
same state: run this right after ``finetune.py``; results from another machine (another
``platform``) are refused.

    python benchmarks/finetune_floor.py --results benchmarks/results/finetune/X/finetune.json \
        --out benchmarks/results/finetune/X/floor.json
    python benchmarks/finetune_floor.py --quick   # a tiny model: checks the script
"""

import argparse
import dataclasses
import inspect
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path

import finetune as bench
import kernel_replay
import torch
from torch.utils.flop_counter import FlopCounterMode

from fusion.labels import _even_chunks

MiB = 2**20
#: fused_token_loss's and chunked_token_loss's chunks, at most (their ``chunk_size`` default)
LOSS_CHUNK_ROWS = inspect.signature(bench.fused_token_loss).parameters["chunk_size"].default


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--rounds", type=int, default=5, help="rounds per matrix product shape")
    p.add_argument("--family", choices=bench.FAMILIES, default="smolvlm")
    p.add_argument("--train", choices=bench.TRAIN_MODES, default="full")
    p.add_argument(
        "--loss", choices=bench.LOSSES, default="fused", help="fusion's loss (the recipe's on CPU)"
    )
    p.add_argument(
        "--results",
        type=Path,
        help="a finetune.json: its settings (over --family, --train and --loss), and the floors "
        "set against it",
    )
    p.add_argument("--out", type=Path, help="write the report here as JSON")
    return p.parse_args(argv)


def finetune_settings(args: argparse.Namespace, workdir: Path) -> argparse.Namespace:
    """``finetune.py``'s settings: those ``--results`` was measured with, else its defaults
    for ``--family``, ``--train`` and ``--loss``."""
    argv = ["--out", str(workdir / "unused")] + ["--quick"] * args.quick
    argv += ["--family", args.family, "--train", args.train, "--loss", args.loss]
    if args.results is not None:
        results = json.loads(args.results.read_text())
        stored, measured_on = results["settings"], results["machine"]["platform"]
        if stored["device"] != "cpu":
            raise SystemExit(f"--results: expected a CPU run, got one on {stored['device']}")
        if measured_on != platform.platform():
            raise SystemExit(
                f"--results: measured on {measured_on}, this is {platform.platform()}: a time "
                "floor only bounds times measured on the same machine"
            )
        argv = ["--out", str(workdir / "unused")] + ["--quick"] * stored["quick"]
        argv += ["--short-warmup"] * stored["short_warmup"]
        for key in ("family", "train", "loss"):
            argv += [f"--{key}", stored.get(key, getattr(args, key))]
        for key in ("samples_per_step", "steps", "seed", "max_seq_len", "text_layers"):
            if stored[key] is not None:
                argv += [f"--{key.replace('_', '-')}", str(stored[key])]
        for key in ("vision_layers", "max_image", "loss_chunk_rows"):
            if stored.get(key) is not None:
                argv += [f"--{key.replace('_', '-')}", str(stored[key])]
        argv += ["--defer-output-grad"] * bool(stored.get("defer_output_grad"))
        if stored.get("release_freed_memory") is not None:
            release = stored["release_freed_memory"]
            argv += ["--release-freed-memory" if release else "--no-release-freed-memory"]
        argv += ["--transparent-huge-pages"] * bool(stored.get("transparent_huge_pages"))
    return bench.parse_args(argv)


def loss_held_mib(model, fargs: argparse.Namespace, targets: int) -> tuple[float, float]:
    """What ``fusion_packed``'s loss holds beside the saved activations at the end of the
    forward, in MiB: one chunk's float32 logits (the largest even chunk of ``targets`` rows),
    and the trained output's gradient where the fused loss makes it there (not deferred)."""
    decoder = model.decoder
    output = decoder.output if decoder.output is not None else decoder.tok_embeddings
    vocab = output.weight.size(0)
    limit = fargs.loss_chunk_rows or LOSS_CHUNK_ROWS
    rows = _even_chunks(targets, limit)[0]  # the loss's own split: the largest chunk first
    made_now = fargs.loss == "fused" and not fargs.defer_output_grad
    gradient = sum(p.numel() * p.element_size() for p in output.parameters() if p.requires_grad)
    return rows * vocab * 4 / MiB, gradient * made_now / MiB


def rss_mib() -> float:
    return bench.rss_bytes() / MiB


def load(name: str, model_dir: Path, fargs: argparse.Namespace):
    """``name``'s model as ``finetune.py`` trains it (``--train``), and its vision tower."""
    worker = argparse.Namespace(**vars(fargs) | {"worker": name, "model_dir": model_dir})
    model, tower, trained_in_tower = bench.load_contestant(worker, torch.device("cpu"))
    bench.set_trainable(worker, model, tower, trained_in_tower)
    return model, tower


def grouped_conv_backward_flop(
    grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
    _output_padding, _groups, output_mask, out_shape=None, **kwargs,
) -> int:  # fmt: skip
    """A convolution's backward, groups counted: each of the input's and the weight's
    gradients costs what the forward does, ``2 * batch * output positions * weight size``
    (the weight ``[c_out, c_in / groups, k...]``). torch's own formula (2.13) takes the
    weight's gradient as an ungrouped convolution, which overcounts a depthwise one (Qwen3.5's
    Gated DeltaNet conv over 6144 channels) by the channel count."""
    positions = (x_shape if transposed else grad_out_shape)[2:]
    forward = 2 * grad_out_shape[0] * math.prod(positions) * math.prod(w_shape)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


#: FlopCounterMode's formulas that this script replaces.
FLOP_FORMULAS = {torch.ops.aten.convolution_backward: grouped_conv_backward_flop}


def step_work(name: str, model, tower, steps, settings) -> tuple[dict, dict[str, int]]:
    """The first timed step's floating-point operations, in total and in the tower, and its
    compute kernels' calls (:class:`kernel_replay.KernelLog`)."""
    with ExitStack() as stack:
        if name.startswith("fusion_"):
            model.skip_output_layer = True
            feed = stack.enter_context(bench.fusion_feed(steps, settings, name == "fusion_packed"))
            next(feed)  # the warm-up step's micro-batch
            settings = dataclasses.replace(settings, feed=feed)
        tower_flops = []
        counter = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
        handle = tower.register_forward_hook(
            lambda *_: tower_flops.append(counter.get_total_flops())
        )
        before = tower.register_forward_pre_hook(
            lambda *_: tower_flops.append(-counter.get_total_flops())
        )
        with counter, kernel_replay.KernelLog() as kernels:
            _, positions = bench.STEPS[name](model, steps[1], settings)
        handle.remove()
        before.remove()
    work = {
        "gflop": counter.get_total_flops() / 1e9,
        "tower_gflop": sum(tower_flops) / 1e9,
        "positions": positions,
    }
    return work, dict(kernels.calls)


def kernels_alone(
    calls: dict[str, int], threads: int, fargs: argparse.Namespace, workdir: Path
) -> dict:
    """:func:`kernel_replay.main` on a step's kernel log in a fresh process with ``threads``
    and the run's environment (huge pages as it had them): the step's kernels timed alone."""
    log, out = workdir / "kernels.json", workdir / "kernel_times.json"
    log.write_text(json.dumps(calls))
    command = [sys.executable, kernel_replay.__file__, str(log), "--out", str(out)]
    command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, env=bench.contestant_env(fargs))
    if done.returncode:
        raise RuntimeError(f"the kernel replay failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def tensors_in(value: object) -> Iterator[torch.Tensor]:
    """The tensors of a batch's nested inputs (mappings, sequences, dataclasses)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))


def step_memory_mib(model, steps, settings) -> tuple[float, float]:
    """What ``fusion_packed``'s forward saves for its backward, parameters left out, and its
    batch's tensors that the forward does not keep (the step's inputs), in MiB."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in weights and pointer not in seen:
            seen.add(pointer)
            total += tensor.untyped_storage().nbytes()
        return tensor

    model.skip_output_layer = True
    with bench.fusion_feed(steps, settings, packing=True) as feed:
        next(feed)
        batch = next(feed).batch
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = bench.fusion_loss(model, batch, sum(s.num_targets for s in steps[1]), settings)
        inputs = {}
        for tensor in tensors_in([batch.model_inputs(), batch.labels]):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                inputs[storage.data_ptr()] = storage.nbytes()
    del loss
    return total / MiB, sum(inputs.values()) / MiB


def run_rate(during: object) -> float:
    """``--results``' ``matrix_rate``: its best rate, refused unless a positive finite number
    (a floor at a rate of 0 or NaN would bound nothing)."""
    best = during.get("best_gflops") if isinstance(during, dict) else None
    if isinstance(best, bool) or not isinstance(best, int | float) or not 0 < best < math.inf:
        raise SystemExit(
            f"--results: matrix_rate.best_gflops: expected a positive finite rate (GFLOP/s), "
            f"got {best!r:.40}"
        )
    return float(best)


def measured(results: dict) -> dict:
    """Median first-timed-step seconds and peak MiB of each contestant in ``finetune.json``."""
    out = {}
    for name, r in results["results"].items():
        firsts = r["step_s"][:: len(r["tokens"])]  # round after round, each its timed steps
        out[name] = {
            "step_s": statistics.median(firsts),
            "peak_mib": r["peak_memory_bytes"] / MiB,
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report: dict = {"settings": vars(args) | {"out": str(args.out), "results": str(args.results)}}
    with tempfile.TemporaryDirectory(prefix="finetune_floor_") as workdir:
        fargs = finetune_settings(args, Path(workdir))
        # With --results, its family, training mode and loss stand in for the flags'
        report["settings"] |= {key: getattr(fargs, key) for key in ("family", "train", "loss")}
        family = fargs.family
        config = bench.hf_config(fargs.quick, family, fargs.text_layers, fargs.vision_layers)
        settings = bench.StepSettings(
            torch.device("cpu"), bench.pad_id(config), fargs.max_seq_len, loss=fargs.loss
        )
        steps = bench.step_samples(fargs, config)
        baseline_mib = rss_mib()  # torch, this script and the samples, before any model
        report["finetune_settings"] = {k: str(v) for k, v in vars(fargs).items()}
        model_dir = Path(workdir) / "model"
        torch.manual_seed(fargs.seed)
        bench.save_model(family, config, model_dir)
        results = None if args.results is None else json.loads(args.results.read_text())
        work, kernel_calls = {}, {}
        for name in fargs.only:
            # With --results, the contestants it measured (not one that ran out of memory)
            if results is not None and name not in {*results["results"], "fusion_packed"}:
                continue
            model, tower = load(name, model_dir, fargs)
            work[name], kernel_calls[name] = step_work(name, model, tower, steps, settings)
            del model, tower
        model, _ = load("fusion_packed", model_dir, fargs)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        activations, inputs = step_memory_mib(model, steps, settings)
        logits, output_gradient = loss_held_mib(model, fargs, sum(s.num_targets for s in steps[1]))
        del model
        for name, calls in kernel_calls.items():
            replay = kernels_alone(calls, args.threads, fargs, Path(workdir))
            work[name] |= {"kernels_s": replay["seconds"], "kernels_by_op": replay["by_op"]}
    rates = bench.gemm_gflops(args.rounds, bench.gemm_shapes(family, args.quick))
    rate_now = max(rates.values())
    # The run's own rate where it measured one (after each of its rounds): the machine's
    # speed in the minutes the steps were timed, which may differ from its speed now.
    during = None if results is None else results.get("matrix_rate")
    rate = rate_now if during is None else run_rate(during)
    for entry in work.values():
        entry["floor_s"] = entry["gflop"] / rate
        # The share of the floor a step of these kernels with nothing between them would
        # reach: their rate over the best one, both measured now.
        entry["kernels_reach"] = entry["gflop"] / entry["kernels_s"] / rate_now
    memory = {
        "process_before_load_mib": baseline_mib,
        "step_inputs_mib": inputs,
        "parameters_mib": weights / MiB,
        "adamw_state_mib": 2 * trained / MiB,
        "saved_activations_mib": activations,
        "gradients_mib": trained / MiB,
    }
    resident = ("process_before_load_mib", "parameters_mib", "adamw_state_mib", "step_inputs_mib")
    memory["floor_mib"] = sum(memory[key] for key in resident) + max(
        activations, memory["gradients_mib"]
    )
    memory |= {"loss_chunk_logits_mib": logits, "output_gradient_at_loss_mib": output_gradient}
    memory["loss_time_floor_mib"] = (
        sum(memory[key] for key in resident) + activations + logits + output_gradient
    )
    report |= {"gemm_gflops": rates, "rate_now_gflops": rate_now, "rate_gflops": rate}
    report |= {"rate_from": "now" if during is None else "run", "work": work, "memory": memory}
    packed = work["fusion_packed"]
    lines = [
        f"fp32 matrix products now: best {rate_now:.0f} GFLOP/s "
        + ", ".join(f"{shape} {r:.0f}" for shape, r in rates.items()),
        f"the floors' rate: {rate:.0f} GFLOP/s, "
        + ("measured now" if during is None else "the run's best, after its rounds"),
        f"{'contestant':26} {'GFLOP/step':>10} {'tower':>8} {'positions':>9} {'floor s':>8} "
        f"{'kernels s':>9} {'reach':>6}",
    ]
    lines += [
        f"{name:26} {w['gflop']:10.1f} {w['tower_gflop']:8.1f} {w['positions']:9d} "
        f"{w['floor_s']:8.2f} {w['kernels_s']:9.2f} {w['kernels_reach']:6.0%}"
        for name, w in work.items()
    ]
    lines.append(
        "kernels s: the step's matrix products, convolutions and attention timed alone, now; "
        "reach: the share of the time floor a step of them alone would reach"
    )
    lines.extend(
        (
            f"fusion_packed memory floor {memory['floor_mib']:.0f} MiB = process "
            f"{baseline_mib:.0f} + parameters {memory['parameters_mib']:.0f} + AdamW state "
            f"{memory['adamw_state_mib']:.0f} + step inputs {inputs:.0f} + the larger of saved "
            f"activations {activations:.0f} and gradients {memory['gradients_mib']:.0f}",
            f"fusion_packed loss-time floor {memory['loss_time_floor_mib']:.0f} MiB "
            f"({memory['loss_time_floor_mib'] / memory['floor_mib'] - 1:.0%} above the memory "
            f"floor) = the resident part + saved activations {activations:.0f} + a loss chunk's "
            f"logits {logits:.0f} + the output's gradient made in the loss {output_gradient:.0f}",
        )
    )
    if results is not None:
        seen = measured(results)
        bounds = {
            f"fusion_packed / {name} (tokens/s, at most)": seen[name]["step_s"] / packed["floor_s"]
            for name in ("transformers_padded", "transformers_padding_free")
            if name in seen
        }
        if "fusion_padded" in work:  # not when --results measured fusion packed alone
            bounds["fusion_packed / fusion_padded (tokens/s, equal efficiency)"] = (
                work["fusion_padded"]["gflop"] / packed["gflop"]
            )
        if "transformers_padded" in seen:
            bounds["fusion_packed / transformers_padded (peak memory, at least)"] = (
                memory["floor_mib"] / seen["transformers_padded"]["peak_mib"]
            )
        # Each contestant's share of its own time floor, and fusion_packed's peak over its
        # memory floor (issue 40: at least 75%, within 15%).
        shares = {name: work[name]["floor_s"] / seen[name]["step_s"] for name in seen}
        # How much of each measured step its kernels alone (timed now) take
        kernels_of_step = {name: work[name]["kernels_s"] / seen[name]["step_s"] for name in seen}
        above_floor = seen["fusion_packed"]["peak_mib"] / memory["floor_mib"] - 1
        above_loss_floor = seen["fusion_packed"]["peak_mib"] / memory["loss_time_floor_mib"] - 1
        report |= {
            "measured": seen,
            "bounds": bounds,
            "share_of_time_floor": shares,
            "kernels_of_step": kernels_of_step,
            "fusion_packed_peak_above_memory_floor": above_floor,
            "fusion_packed_peak_above_loss_time_floor": above_loss_floor,
        }
        lines += [f"{key}: {value:.2f}x" for key, value in bounds.items()]
        lines += [
            f"{name}: measured step {seen[name]['step_s']:.2f} s, {share:.0%} of its time floor; "
            f"its kernels alone (timed now) take {kernels_of_step[name]:.0%} of it"
            for name, share in shares.items()
        ]
        lines.append(
            f"fusion_packed: peak {seen['fusion_packed']['peak_mib']:.0f} MiB, "
            f"{above_floor:.0%} above its memory floor, {above_loss_floor:.0%} above its "
            "loss-time floor"
        )
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
