"""Image-to-text generation: ``fusion.generate`` against ``transformers``' ``generate`` on the
same weights, for a random model of SmolVLM-256M's shape or of Qwen2.5-VL-3B's widths.

The model is ``transformers.SmolVLMForConditionalGeneration`` with SmolVLM-256M's config
(SmolLM2-135M's decoder: 30 layers, width 576, 9/3 heads; SigLIP base patch-16/512; 4 x 4 pixel
shuffle, 64 rows per tile) and random weights, saved as a Hugging Face directory and loaded
with ``fusion.checkpoint.hf_vlm.load_hf_idefics3``, so both sides run the same numbers. One
prompt of one image (split into tiles as SmolVLM's processor splits it, preprocessed by
``fusion.preprocessing``) generates ``--max-new-tokens`` tokens greedily, no stop token, on
each side: one untimed warm-up run of 2 tokens, then one timed run, in which the time of every
new token is taken as it comes (``fusion.generation.generate_stream``; a streamer for
``transformers``). Reported: the time to the first token (the prefill: vision tower,
connector, prompt), tokens/s over the whole run, and decode tokens/s after the first token.
Both sides must emit the same tokens (checked, reported). The process's CPU time (user and
system, every thread) to the first token and over the run is reported too: time-slicing by
other jobs on shared cores moves it less than the wall clock (threads that spin while waiting
still count).

``--family qwen2_5_vl``: ``transformers.Qwen2_5_VLForConditionalGeneration`` with Qwen2.5-VL-3B's
widths (``finetune.QWEN2_5_VL_3B_TEXT`` and ``QWEN2_5_VL_3B_VISION``: text 2048 wide, 16/2
heads, vocabulary 151936, tied output layer; ViT 1280 wide, 112-pixel windows) and tiny depths
(2 text layers; 2 vision blocks, block 1 full attention), loaded with
``fusion.checkpoint.load_hf_vlm``. The image goes through ``fusion.preprocessing``'s
``Qwen2VLImageProcessor`` with Qwen2.5-VL's published settings (3136 to 12845056 pixels;
768 x 1024 becomes 54 x 74 patches, 999 rows), in Qwen's chat template; transformers gets the
same patches, ``image_grid_thw`` and ``mm_token_type_ids``. Both sides decode eagerly.

``--rounds N`` times each side N times after the warm-ups, in alternating order (fusion first,
then transformers first, ...): reported are each side's medians over rounds with their range,
and fusion / transformers in tokens/s as the median over rounds of the ratio within a round.

    python benchmarks/vlm_generation.py           # SmolVLM-256M's shape -> benchmarks/results/
    python benchmarks/vlm_generation.py --quick   # a tiny model, seconds -> a temporary directory
    python benchmarks/vlm_generation.py --family qwen2_5_vl --rounds 5
    python benchmarks/vlm_generation.py --device cuda --dtype bfloat16 --out results/gpu

Writes ``vlm_generation.json`` (``--family qwen2_5_vl``: ``vlm_generation_qwen2_5_vl.json``)
to ``--out``: by default ``benchmarks/results/`` for the full run, and a fresh temporary
directory for ``--quick`` (so a quick run never replaces the published numbers).
"""

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import add_out_argument, idefics3_hf_config, output_dir
from finetune import qwen_chat_ids, qwen_hf_config

from fusion.checkpoint.hf_vlm import load_hf_idefics3, load_hf_vlm
from fusion.families.idefics3.builders import (
    SMOLVLM_256M_IMAGE_TOKEN_ID,
    SMOLVLM_256M_SCALE_FACTOR,
    SMOLVLM_256M_TEXT,
    SMOLVLM_256M_VISION,
)
from fusion.generation import generate_stream
from fusion.preprocessing import (
    Idefics3ImageProcessor,
    Qwen2VLImageProcessor,
    VisionLanguageProcessor,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FAMILIES = ("smolvlm", "qwen2_5_vl")
# Qwen2.5-VL's published preprocessor_config.json: its pixel range (CLIP's mean and std, 14-pixel
# patches, 2 x 2 merge, 2 frames: the image processor's defaults).
QWEN2_5_VL_PIXELS = {"min_pixels": 3136, "max_pixels": 12_845_056}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    add_out_argument(p)
    p.add_argument("--family", choices=FAMILIES, default="smolvlm", help="the model's shape")
    p.add_argument("--rounds", type=int, default=1, help="timed runs per side, alternating")
    p.add_argument("--image-height", type=int, default=768)
    p.add_argument("--image-width", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: expected at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.image_height, args.image_width, args.max_new_tokens = 40, 56, 4
    args.out = output_dir(args.out, check=args.quick)
    return args


def hf_config(quick: bool, family: str = "smolvlm") -> dict:
    """``SmolVLMConfig`` fields: SmolVLM-256M's shape, or a tiny one for ``--quick``;
    ``Qwen2_5_VLConfig`` fields for ``family="qwen2_5_vl"`` (``finetune.qwen_hf_config``)."""
    if family == "qwen2_5_vl":
        return qwen_hf_config(quick)
    text, vision = dict(SMOLVLM_256M_TEXT), dict(SMOLVLM_256M_VISION)
    scale, image_id = SMOLVLM_256M_SCALE_FACTOR, SMOLVLM_256M_IMAGE_TOKEN_ID
    if quick:
        text |= {"vocab_size": 256, "num_layers": 2, "embed_dim": 36, "intermediate_dim": 64}
        vision |= {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
        vision |= {"num_attention_heads": 2, "image_size": 32, "patch_size": 4}
        scale, image_id = 2, 200
    return idefics3_hf_config(text, vision, scale, image_id)


def build(args: argparse.Namespace, directory: Path):
    """The transformers model (random weights), saved; ours loaded from the same directory."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    torch.manual_seed(args.seed)
    config = hf_config(args.quick, args.family)
    qwen = args.family == "qwen2_5_vl"
    if qwen:
        theirs = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config)).eval()
    else:
        theirs = SmolVLMForConditionalGeneration(SmolVLMConfig(**config)).eval()
    theirs.save_pretrained(directory)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    load = load_hf_vlm if qwen else load_hf_idefics3
    ours = load(directory, dtype=dtype, device=device).eval()
    theirs = theirs.to(device=device, dtype=dtype)
    theirs.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return theirs, ours, config


def qwen_inputs(args: argparse.Namespace, ours, config: dict):
    """One prompt with one random image in Qwen's chat template, its image marker expanded to
    the image's rows as Qwen2.5-VL's processor expands it (a stand-in tokenizer: one id per
    character). Returns ``VisionInputs``."""
    vocab = ours.decoder.vocab_size
    im_start, im_end = qwen_chat_ids(config)
    specials = {
        "<|im_start|>": im_start,
        "<|im_end|>": im_end,
        "<|vision_start|>": config["vision_start_token_id"],
        "<|vision_end|>": config["vision_end_token_id"],
        "<|image_pad|>": config["image_token_id"],
    }
    text_ids = min(vocab, *specials.values()) - 8

    def encode(text: str) -> list[int]:  # a stand-in tokenizer: one id per character
        ids = []
        for part in re.split(r"(<\|[a-z_]+\|>)", text):
            if part in specials:
                ids.append(specials[part])
            else:
                ids += [8 + ord(c) % text_ids for c in part]
        return ids

    vision = config["vision_config"]
    processor = VisionLanguageProcessor(
        "qwen2_vl",
        Qwen2VLImageProcessor(
            **QWEN2_5_VL_PIXELS,
            patch_size=vision["patch_size"],
            merge_size=vision["spatial_merge_size"],
            temporal_patch_size=vision["temporal_patch_size"],
        ),
        image_token_id=config["image_token_id"],
        encode=encode,
        vision_start_token_id=config["vision_start_token_id"],
        vision_end_token_id=config["vision_end_token_id"],
    )
    generator = torch.Generator().manual_seed(args.seed)
    image = torch.randint(
        0, 256, (3, args.image_height, args.image_width), dtype=torch.uint8, generator=generator
    )
    prompt = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Can you describe this image?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    return processor([prompt], [image])


def inputs(args: argparse.Namespace, ours) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One prompt with one random image, as SmolVLM's processor would expand and tile it."""
    vocab = ours.decoder.vocab_size
    image_id = ours.encoder_tokens["image"]
    specials = {"<image>": image_id}

    def encode(text: str) -> list[int]:  # a stand-in tokenizer: one id per character
        ids = [1]
        for part in re.split(r"(<[^<>]+>)", text):
            if part.startswith("<"):
                ids.append(specials.get(part, 2 + len(part) % 5))
            else:
                ids += [8 + ord(c) % (min(vocab, image_id) - 8) for c in part]
        return ids

    size = ours.encoders["image"].vision_model.image_size
    processor = VisionLanguageProcessor.for_model(
        ours, encode, Idefics3ImageProcessor.for_image_size(size)
    )
    generator = torch.Generator().manual_seed(args.seed)
    image = torch.randint(
        0, 256, (3, args.image_height, args.image_width), dtype=torch.uint8, generator=generator
    )
    prompt = "<|im_start|>User:<image>Can you describe this image?<end_of_utterance>\nAssistant:"
    batch = processor([prompt], [image])
    return batch.tokens(pad_id=0), batch.pixel_values, batch.pixel_values.size(0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Clock:
    """Times at which each new token is out (as a transformers streamer, or called directly),
    and the process's CPU time then."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.prompt_seen = False
        self.start, self.cpu_start = time.perf_counter(), cpu_seconds()
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.tokens: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # transformers passes the prompt first
            self.prompt_seen = True
            return
        self.step(value)

    def step(self, value: torch.Tensor) -> None:
        sync(self.device)
        self.times.append(time.perf_counter())
        self.cpu_times.append(cpu_seconds())
        self.tokens.append(value.reshape(-1).cpu())

    def end(self) -> None:
        pass

    def report(self) -> dict:
        n = len(self.times)
        first, last = self.times[0] - self.start, self.times[-1] - self.start
        return {
            "new_tokens": n,
            "first_token_s": first,
            "total_s": last,
            "tokens_per_s": n / last,
            "decode_tokens_per_s": (n - 1) / (last - first) if n > 1 else None,
            "first_token_cpu_s": self.cpu_times[0] - self.cpu_start,
            "total_cpu_s": self.cpu_times[-1] - self.cpu_start,
        }


def summarise(rounds: list[dict]) -> dict:
    """One side's rounds -> the medians over rounds (the first round's ``new_tokens``), each
    with its range, and every round."""
    out: dict = {"new_tokens": rounds[0]["new_tokens"]}
    for key in (
        "first_token_s",
        "total_s",
        "tokens_per_s",
        "decode_tokens_per_s",
        "first_token_cpu_s",
        "total_cpu_s",
    ):
        values = [r[key] for r in rounds if r[key] is not None]
        out[key] = statistics.median(values) if values else None
        out[f"{key}_range"] = [min(values), max(values)] if values else None
    out["rounds"] = rounds
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    load_start = os.getloadavg()
    qwen = args.family == "qwen2_5_vl"
    directory = Path(tempfile.mkdtemp(prefix="vlm_generation_model_"))
    try:
        theirs, ours, config = build(args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    grid = None
    if qwen:
        batch = qwen_inputs(args, ours, config)
        pad = config["pad_token_id"]
        tokens, pixels, grid = batch.tokens(pad_id=pad), batch.pixel_values, batch.image_grid_thw
        rows = int((tokens == config["image_token_id"]).sum())
        image = {"image_grid_thw": grid.tolist(), "image_rows": rows}
    else:
        pad = 0
        tokens, pixels, tiles = inputs(args, ours)
        image = {"tiles": tiles}
    tokens, pixels = tokens.to(device), pixels.to(device=device, dtype=dtype)
    if qwen:
        encoder_input = {"pixel_values": pixels, "image_grid_thw": grid}  # the grid on the CPU
        hf_images = {
            "pixel_values": pixels,
            "image_grid_thw": grid.to(device),
            "mm_token_type_ids": (tokens == config["image_token_id"]).to(torch.int32),
        }
    else:
        encoder_input = {"pixel_values": pixels}
        hf_images = {"pixel_values": pixels[None]}

    def run_ours(n: int, clock: _Clock | None = None) -> None:
        steps = generate_stream(
            ours,
            tokens,
            encoder_input={"image": encoder_input},
            max_new_tokens=n,
            temperature=0,
            pad_id=pad,
        )
        for step in steps:
            if clock is not None:
                clock.step(step)

    def run_theirs(n: int, clock: _Clock | None = None) -> None:
        with torch.no_grad():
            theirs.generate(
                input_ids=tokens,
                attention_mask=torch.ones_like(tokens),
                **hf_images,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
                streamer=clock,
            )

    sides = {"fusion": run_ours, "transformers": run_theirs}
    for run in sides.values():
        run(2)  # warm-up: lazy initialisation, allocator
        sync(device)
    rounds: dict[str, list[dict]] = {name: [] for name in sides}
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            sync(device)
            clock = _Clock(device)
            sides[name](args.max_new_tokens, clock)
            rounds[name].append(clock.report() | {"round": r})
            outputs[name].append(torch.stack(clock.tokens, dim=1))
    results = {name: summarise(runs) for name, runs in rounds.items()}
    # Within each round: fusion / transformers in tokens/s (overall and decode), and
    # transformers / fusion in time and CPU time (above 1: fusion is faster, or uses less CPU).
    pairs = list(zip(rounds["fusion"], rounds["transformers"], strict=True))
    paired_rounds = {"tokens_per_s": [a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs]}
    for key in ("first_token_s", "first_token_cpu_s", "total_cpu_s"):
        paired_rounds[key] = [b[key] / a[key] for a, b in pairs]
    if all(a["decode_tokens_per_s"] and b["decode_tokens_per_s"] for a, b in pairs):
        paired_rounds["decode_tokens_per_s"] = [
            a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in pairs
        ]
    paired = paired_rounds["tokens_per_s"]
    first = outputs["fusion"][0]
    import transformers

    report = {
        "machine": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": str(device),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
        },
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": {
            "family": args.family,
            "config": config,
            "parameters": sum(p.numel() for p in ours.parameters()),
            **image,
            "prompt_tokens": tokens.size(1),
        },
        "results": results,
        "speedup_tokens_per_s": statistics.median(paired),
        "speedup_tokens_per_s_rounds": paired,
        "speedup_tokens_per_s_range": [min(paired), max(paired)],
        "paired_speedups": {
            key: {"median": statistics.median(v), "range": [min(v), max(v)], "rounds": v}
            for key, v in paired_rounds.items()
        },
        "same_tokens": all(torch.equal(out, first) for outs in outputs.values() for out in outs),
    }
    name = "vlm_generation.json" if not qwen else f"vlm_generation_{args.family}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / name).write_text(json.dumps(report, indent=1))
    what = f"{image['tiles']} tiles" if not qwen else f"grid {image['image_grid_thw']}"
    print(
        f"{args.family}: {report['model']['parameters'] / 1e6:.1f}M parameters, {what}, "
        f"{tokens.size(1)} prompt tokens, {args.max_new_tokens} new tokens, {args.dtype} on "
        f"{device}, {args.rounds} round{'s' * (args.rounds > 1)} (median [range])"
    )
    for side, r in results.items():
        decode, low, high = r["decode_tokens_per_s"], *r["tokens_per_s_range"]
        print(
            f"{side:12} first token {r['first_token_s'] * 1e3:8.1f} ms  total "
            f"{r['total_s']:7.2f} s  {r['tokens_per_s']:7.2f} [{low:.2f}-{high:.2f}] tokens/s  "
            f"(decode {'-' if decode is None else f'{decode:.2f}'}/s)  CPU "
            f"{r['first_token_cpu_s']:.2f} s to the first token, {r['total_cpu_s']:.2f} s in all"
        )
    for key, v in report["paired_speedups"].items():
        what = "fusion / transformers" if "tokens_per_s" in key else "transformers / fusion"
        low, high = v["range"]
        print(f"{what} {key}: {v['median']:.3f} [{low:.3f}-{high:.3f}] (paired)")
    print(f"load average {load_start} -> {report['machine']['load_average_end']}")
    print(f"same tokens: {report['same_tokens']}  -> {args.out / name}")
    return report


if __name__ == "__main__":
    main()
