"""Fine-tuning throughput and peak memory: fusion with packed samples, fusion padded, and
``transformers``' own ``Idefics3ForConditionalGeneration`` on padded batches, on the same
weights, samples and optimizer.

The model has SmolVLM-256M's shape (SmolLM2-135M's decoder, SigLIP base patch-16/512, 4 x 4
pixel shuffle: 64 rows per 512 x 512 image) with random weights: written once by
``transformers`` and loaded by each contestant (``fusion.checkpoint.load_hf_idefics3`` for
ours). Every contestant trains the decoder and the connector (vision tower frozen, as in
SmolVLM's and LLaVA's fine-tuning) with AdamW, one optimizer step per ``--samples-per-step``
samples (the same samples, in the same order, for everyone):

- ``fusion_packed``: the step's samples packed into rows of at most ``--max-seq-len`` tokens
  (``fusion.data.pack_samples``, block-causal mask, positions restarting per sample), one row
  per forward/backward, gradients accumulated (``fusion.masked_token_loss`` sums divided by
  the step's target count: the gradients of one big batch);
- ``fusion_padded``: the step's samples in one batch, right-padded to the longest
  (``fusion.data.collate_padded``);
- ``transformers_padded``: the same padded batch through ``Idefics3ForConditionalGeneration``
  (SDPA attention, ``attention_mask``, ``labels`` with -100: its own loss), as the Hugging Face
  Trainer trains with ``per_device_train_batch_size = samples_per_step``.

Samples: a fixed-seed mix of LLaVA-Instruct-like lengths: one image per sample (64 rows and
its 3 wrapper tokens), a question of 8 to 40 tokens, an answer of 10 to 400 tokens (40% short
10-100 as in its conversations, 30% 100-250 as in its detailed descriptions, 30% 250-400 as in
its complex reasoning), and an end-of-turn token. The loss covers the answer and the end token.

Each contestant runs in a fresh process, one after the other (``--quick``: in this process): a
warm-up step (2 samples: allocator, kernels, the optimizer's state), then ``--steps`` timed
steps. Reported: non-padding
tokens per second over the timed steps, the positions computed (padding included), the peak
resident memory of the process (``ru_maxrss``; CPU) or the peak CUDA memory allocated (GPU),
and the first timed step's loss (the three must agree: same weights, same samples).

    python benchmarks/finetune.py                 # CPU, fp32, 2 threads -> benchmarks/results/
    python benchmarks/finetune.py --quick         # a tiny model, seconds -> a temporary directory
    python benchmarks/finetune.py --device cuda   # bf16 autocast, fp32 weights

Writes ``finetune.json`` (and ``finetune_<device>.txt``, the table) to ``--out``.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import add_out_argument, idefics3_hf_config, machine, output_dir

from fusion import masked_token_loss
from fusion.data import IGNORE_INDEX, Sample, collate_packed, collate_padded, pack_samples
from fusion.models.idefics3 import (
    SMOLVLM_256M_IMAGE_TOKEN_ID,
    SMOLVLM_256M_SCALE_FACTOR,
    SMOLVLM_256M_TEXT,
    SMOLVLM_256M_VISION,
)

CONTESTANTS = ("transformers_padded", "fusion_padded", "fusion_packed")
PAD_ID = 2  # SmolVLM's <|im_end|> doubles as padding; any id works: padding is never a target
BOS_ID, FAKE_ID, GLOBAL_ID, END_ID = 1, 49_189, 49_152, 49_279
LR = 1e-5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    add_out_argument(p)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    p.add_argument("--samples-per-step", type=int, default=None, help="default 8 (CPU), 32")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps")
    p.add_argument("--max-seq-len", type=int, default=None, help="default 1024 (CPU), 4096")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=CONTESTANTS, nargs="+", default=list(CONTESTANTS))
    p.add_argument("--worker", choices=CONTESTANTS, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if args.samples_per_step is None:
        args.samples_per_step = 4 if args.quick else 32 if cuda else 8
    if args.max_seq_len is None:
        args.max_seq_len = 256 if args.quick else 4096 if cuda else 1024
    if args.quick:
        args.steps = 1
    if args.worker is None:
        args.out = output_dir(args.out, check=args.quick)
    return args


# ---------------------------------------------------------------------- model and samples


def hf_config(quick: bool) -> dict:
    """``Idefics3Config`` fields: SmolVLM-256M's shape, or a tiny one for ``--quick``."""
    text, vision = dict(SMOLVLM_256M_TEXT), dict(SMOLVLM_256M_VISION)
    scale, image_id = SMOLVLM_256M_SCALE_FACTOR, SMOLVLM_256M_IMAGE_TOKEN_ID
    if quick:
        text |= {"num_layers": 2, "embed_dim": 36, "intermediate_dim": 64}
        vision |= {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
        vision |= {"num_attention_heads": 2, "image_size": 32, "patch_size": 4}
        scale = 2
    config = idefics3_hf_config(text, vision, scale, image_id)
    config["text_config"]["pad_token_id"] = config["pad_token_id"] = PAD_ID
    return config


def image_rows(config: dict) -> int:
    vision = config["vision_config"]
    return (vision["image_size"] // vision["patch_size"] // config["scale_factor"]) ** 2


def answer_length(generator: torch.Generator, quick: bool) -> int:
    """10-400 tokens: 40% 10-100, 30% 100-250, 30% 250-400 (``--quick``: a tenth)."""
    u = float(torch.rand((), generator=generator))
    low, high = (10, 100) if u < 0.4 else (100, 250) if u < 0.7 else (250, 400)
    length = int(torch.randint(low, high + 1, (), generator=generator))
    return max(length // 10, 2) if quick else length


def make_samples(count: int, config: dict, seed: int, quick: bool) -> list[Sample]:
    """``count`` samples of the fixed-seed length mix (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    image_id, vocab = config["image_token_id"], config["text_config"]["vocab_size"]
    rows, size = image_rows(config), config["vision_config"]["image_size"]
    samples = []
    for _ in range(count):
        question = int(torch.randint(8, 41, (), generator=generator))
        answer = answer_length(generator, quick)
        text = torch.randint(
            100, min(image_id, FAKE_ID) - 1, (question + answer,), generator=generator
        )
        prompt = [
            BOS_ID,
            FAKE_ID,
            GLOBAL_ID,
            *[image_id] * rows,
            FAKE_ID,
            *text[:question].tolist(),
        ]
        tokens = torch.tensor([*prompt, *text[question:].tolist(), END_ID], dtype=torch.int64)
        assert int(tokens.max()) < vocab
        labels = torch.full_like(tokens, IGNORE_INDEX)
        start = len(prompt)  # the first answer token: predicted at position start - 1
        labels[start - 1 : -1] = tokens[start:]
        pixels = torch.randn(1, 3, size, size, generator=generator)
        samples.append(Sample(tokens, labels, pixels, source=f"synthetic:{len(samples)}"))
    return samples


def step_samples(args: argparse.Namespace, config: dict) -> list[list[Sample]]:
    """The warm-up step's samples (2), then each timed step's."""
    n = args.samples_per_step
    samples = make_samples(2 + n * args.steps, config, args.seed, args.quick)
    return [samples[:2]] + [samples[2 + i * n : 2 + (i + 1) * n] for i in range(args.steps)]


# ---------------------------------------------------------------------- contestants


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_step(model, samples: list[Sample], device: torch.device) -> tuple[float, int]:
    """One padded batch through transformers' model and its own loss; (loss, positions)."""
    batch = collate_padded(samples, pad_id=PAD_ID)
    labels = torch.full_like(batch.labels, IGNORE_INDEX)
    labels[:, 1:] = batch.labels[:, :-1]  # transformers shifts labels itself
    attention = torch.zeros_like(batch.tokens)
    for row, sample in enumerate(samples):
        attention[row, : len(sample)] = 1
    pixels = torch.cat([s.pixel_values for s in samples])[:, None]  # [b, 1 image, 3, h, w]
    out = model(
        input_ids=batch.tokens.to(device),
        attention_mask=attention.to(device),
        pixel_values=pixels.to(device),
        labels=labels.to(device),
    )
    out.loss.backward()
    return out.loss.detach(), batch.tokens.numel()


def fusion_padded_step(model, samples: list[Sample], device: torch.device) -> tuple[float, int]:
    batch = collate_padded(samples, pad_id=PAD_ID).to(device)
    loss_sum, count = masked_token_loss(model(**batch.model_inputs()), batch.labels)
    loss = loss_sum / count
    loss.backward()
    return loss.detach(), batch.tokens.numel()


def fusion_packed_step(
    model, samples: list[Sample], device: torch.device, max_seq_len: int
) -> tuple[float, int]:
    """Rows of packed samples, one forward/backward each; the loss is divided by the step's
    target count (known before the step), so the gradients are those of one batch."""
    targets = sum(sample.num_targets for sample in samples)
    total, positions = torch.zeros((), device=device), 0
    for row in pack_samples(samples, max_seq_len):
        batch = collate_packed([row], pad_id=PAD_ID).to(device)
        loss_sum, _ = masked_token_loss(model(**batch.model_inputs()), batch.labels)
        (loss_sum / targets).backward()
        total += loss_sum.detach() / targets
        positions += batch.tokens.numel()
    return total, positions


def run_worker(args: argparse.Namespace) -> None:
    """One contestant, in this process: load, train, write the measurements to ``--result``."""
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = hf_config(args.quick)
    steps = step_samples(args, config)
    if args.worker == "transformers_padded":
        from transformers import Idefics3ForConditionalGeneration

        model = Idefics3ForConditionalGeneration.from_pretrained(
            args.model_dir, dtype=torch.float32, attn_implementation="sdpa"
        ).to(device)
        tower = model.model.vision_model
        step = hf_step
    else:
        from fusion.checkpoint import load_hf_idefics3

        model = load_hf_idefics3(args.model_dir, device=device)
        tower = model.encoders["image"].vision_model
        if args.worker == "fusion_packed":

            def step(model, samples, device):
                return fusion_packed_step(model, samples, device, args.max_seq_len)
        else:
            step = fusion_padded_step
    model.train()
    for param in model.parameters():
        param.requires_grad_(True)
    for param in tower.parameters():
        param.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR)
    loaded = rss_bytes()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    times, losses, positions = [], [], []
    for i, samples in enumerate(steps):
        sync(device)
        start = time.perf_counter()
        with autocast:
            loss, computed = step(model, samples, device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if i:  # step 0 is the warm-up
            times.append(time.perf_counter() - start)
            losses.append(float(loss))
            positions.append(computed)
    tokens = [sum(len(s) for s in samples) for samples in steps[1:]]
    result = {
        "step_s": times,
        "losses": losses,
        "tokens": tokens,
        "positions": positions,
        "tokens_per_s": sum(tokens) / sum(times),
        "padding_fraction": 1 - sum(tokens) / sum(positions),
        "peak_memory_bytes": peak_bytes(device),
        "rss_after_load_bytes": loaded,
        "trainable_parameters": sum(p.numel() for p in trainable),
        "load_average_end": os.getloadavg(),
    }
    args.result.write_text(json.dumps(result))


# ---------------------------------------------------------------------- the run


def run_contestant(args: argparse.Namespace, name: str, workdir: Path) -> dict:
    """Run contestant ``name`` in a fresh process (in this one for ``--quick``, where the
    peak memory is then the whole run's so far); its measurements."""
    result_file = workdir / f"{name}.json"
    if args.quick:
        worker = argparse.Namespace(**vars(args))
        worker.worker, worker.model_dir, worker.result = name, workdir / "model", result_file
        run_worker(worker)
        return json.loads(result_file.read_text())
    command = [sys.executable, __file__, "--worker", name, "--model-dir", str(workdir / "model")]
    command += ["--result", str(result_file), "--device", args.device]
    command += ["--threads", str(args.threads), "--seed", str(args.seed)]
    command += ["--samples-per-step", str(args.samples_per_step)]
    command += ["--steps", str(args.steps), "--max-seq-len", str(args.max_seq_len)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(result_file.read_text())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return {}
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = hf_config(args.quick)
    info = machine(torch.device(args.device))  # the load average at the start
    workdir = Path(tempfile.mkdtemp(prefix="finetune_bench_"))
    try:
        torch.manual_seed(args.seed)
        Idefics3ForConditionalGeneration(Idefics3Config(**config)).save_pretrained(
            workdir / "model"
        )
        results = {}
        for name in args.only:
            started = time.perf_counter()
            results[name] = run_contestant(args, name, workdir)
            results[name]["process_s"] = time.perf_counter() - started
            print(f"{name}: done in {results[name]['process_s']:.0f} s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = summarise(args, config, results, info)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "finetune.json").write_text(json.dumps(report, indent=1))
    table = format_table(report)
    (args.out / f"finetune_{args.device}.txt").write_text(table)
    print(table, end="")
    print(f"-> {args.out / 'finetune.json'}")
    return report


def summarise(args: argparse.Namespace, config: dict, results: dict, info: dict) -> dict:
    import transformers

    baseline = results.get("transformers_padded")
    for r in results.values():
        if baseline is not None:
            r["x_transformers_tokens_per_s"] = r["tokens_per_s"] / baseline["tokens_per_s"]
            r["x_transformers_peak_memory"] = r["peak_memory_bytes"] / baseline["peak_memory_bytes"]
    first_losses = [r["losses"][0] for r in results.values()]
    info["transformers"] = transformers.__version__
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    for key in ("worker", "model_dir", "result"):
        settings.pop(key)
    return {
        "machine": info,
        "settings": settings
        | {"lr": LR, "dtype": "bfloat16 autocast" if args.device == "cuda" else "float32"},
        "model": {"config": config, "image_rows": image_rows(config)},
        "results": results,
        "first_step_losses_agree": max(first_losses) - min(first_losses)
        <= 1e-3 * max(abs(x) for x in first_losses),
        "load_average_end": os.getloadavg(),
    }


def format_table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"fine-tuning, SmolVLM-256M-shaped{' (quick: tiny)' if s['quick'] else ''}, "
        f"{s['device']} {s['dtype']}, {report['machine']['torch_threads']} threads, "
        f"{s['samples_per_step']} samples/step, {s['steps']} timed steps, packed rows <= "
        f"{s['max_seq_len']}",
        f"{'contestant':22} {'tokens/s':>9} {'x HF':>6} {'padding':>8} {'peak MiB':>9} "
        f"{'x HF':>6} {'loss':>8}",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"{name:22} {r['tokens_per_s']:9.1f} {r.get('x_transformers_tokens_per_s', 0):6.2f} "
            f"{r['padding_fraction']:8.1%} {r['peak_memory_bytes'] / 2**20:9.0f} "
            f"{r.get('x_transformers_peak_memory', 0):6.2f} {r['losses'][0]:8.4f}"
        )
    lines.append(
        f"first-step losses agree: {report['first_step_losses_agree']}; load average "
        f"at start {report['machine']['load_average_start']}, end {report['load_average_end']}"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
