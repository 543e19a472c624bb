"""Image-to-text generation: ``fusion.generate`` against ``transformers``' ``generate`` on the
same weights, for a random model of SmolVLM-256M's shape.

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
Both sides must emit the same tokens (checked, reported).

    python benchmarks/vlm_generation.py           # SmolVLM-256M's shape -> benchmarks/results/
    python benchmarks/vlm_generation.py --quick   # a tiny model, seconds -> a temporary directory
    python benchmarks/vlm_generation.py --device cuda --dtype bfloat16 --out results/gpu

Writes ``vlm_generation.json`` to ``--out``: by default ``benchmarks/results/`` for the full
run, and a fresh temporary directory for ``--quick`` (so a quick run never replaces the
published numbers).
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import add_out_argument, idefics3_hf_config, output_dir

from fusion.checkpoint.hf_vlm import load_hf_idefics3
from fusion.generation import generate_stream
from fusion.models.idefics3 import (
    SMOLVLM_256M_IMAGE_TOKEN_ID,
    SMOLVLM_256M_SCALE_FACTOR,
    SMOLVLM_256M_TEXT,
    SMOLVLM_256M_VISION,
)
from fusion.preprocessing import Idefics3ImageProcessor, VisionLanguageProcessor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    add_out_argument(p)
    p.add_argument("--image-height", type=int, default=768)
    p.add_argument("--image-width", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.image_height, args.image_width, args.max_new_tokens = 40, 56, 4
    args.out = output_dir(args.out, check=args.quick)
    return args


def hf_config(quick: bool) -> dict:
    """``SmolVLMConfig`` fields: SmolVLM-256M's shape, or a tiny one for ``--quick``."""
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
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    torch.manual_seed(args.seed)
    config = hf_config(args.quick)
    theirs = SmolVLMForConditionalGeneration(SmolVLMConfig(**config)).eval()
    theirs.save_pretrained(directory)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    ours = load_hf_idefics3(directory, dtype=dtype, device=device).eval()
    theirs = theirs.to(device=device, dtype=dtype)
    theirs.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return theirs, ours, config


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


class _Clock:
    """Times at which each new token is out (as a transformers streamer, or called directly)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.prompt_seen = False
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.tokens: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # transformers passes the prompt first
            self.prompt_seen = True
            return
        self.step(value)

    def step(self, value: torch.Tensor) -> None:
        sync(self.device)
        self.times.append(time.perf_counter())
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
        }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="vlm_generation_model_"))
    try:
        theirs, ours, config = build(args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    tokens, pixels, tiles = inputs(args, ours)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    tokens, pixels = tokens.to(device), pixels.to(device=device, dtype=dtype)

    def run_ours(n: int, clock: _Clock | None = None) -> None:
        steps = generate_stream(
            ours,
            tokens,
            encoder_input={"image": {"pixel_values": pixels}},
            max_new_tokens=n,
            temperature=0,
            pad_id=0,
        )
        for step in steps:
            if clock is not None:
                clock.step(step)

    def run_theirs(n: int, clock: _Clock | None = None) -> None:
        with torch.no_grad():
            theirs.generate(
                input_ids=tokens,
                attention_mask=torch.ones_like(tokens),
                pixel_values=pixels[None],
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )

    results, outputs = {}, {}
    for name, run in (("fusion", run_ours), ("transformers", run_theirs)):
        run(2)  # warm-up: lazy initialisation, allocator
        sync(device)
        clock = _Clock(device)
        run(args.max_new_tokens, clock)
        results[name] = clock.report()
        outputs[name] = torch.stack(clock.tokens, dim=1)
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
            "load_average_end": os.getloadavg(),
        },
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": {
            "config": config,
            "parameters": sum(p.numel() for p in ours.parameters()),
            "tiles": tiles,
            "prompt_tokens": tokens.size(1),
        },
        "results": results,
        "speedup_tokens_per_s": results["fusion"]["tokens_per_s"]
        / results["transformers"]["tokens_per_s"],
        "same_tokens": torch.equal(outputs["fusion"], outputs["transformers"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vlm_generation.json").write_text(json.dumps(report, indent=1))
    print(
        f"{report['model']['parameters'] / 1e6:.1f}M parameters, {tiles} tiles, "
        f"{tokens.size(1)} prompt tokens, {args.max_new_tokens} new tokens, {args.dtype} on "
        f"{device}"
    )
    for name, r in results.items():
        decode = r["decode_tokens_per_s"]
        print(
            f"{name:12} first token {r['first_token_s'] * 1e3:8.1f} ms  total "
            f"{r['total_s']:7.2f} s  {r['tokens_per_s']:7.2f} tokens/s  (decode "
            f"{'-' if decode is None else f'{decode:.2f}'}/s)"
        )
    print(f"same tokens: {report['same_tokens']}  -> {args.out / 'vlm_generation.json'}")
    return report


if __name__ == "__main__":
    main()
