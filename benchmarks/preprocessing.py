"""Image preprocessing: ``fusion.preprocessing`` against ``transformers``' image processors on
the same decoded image, for LLaVA-1.5's (CLIP 336, padded to a square) and SmolVLM-256M's
(longest edge 2048, 512-pixel tiles, Lanczos) settings.

Each case starts from one decoded Pillow image (decoding is the same Pillow call on both sides
and is not timed) and times the whole processor call: ours ``ClipImageProcessor.process`` /
``Idefics3ImageProcessor.process`` (Pillow image -> tensor, pad, resize, crop or tiles,
rescale and normalise), theirs ``processor(images=[image], return_tensors="pt")``
(transformers' Pillow backend, the one whose pixels ours matches). Both resize with Pillow's
own ``Image.resize`` (recorded as ``settings.fusion_resize``). The two alternate within each
round; reported:
the median of the rounds on each side and the median of the per-round ratios
(transformers / fusion: above 1, fusion is faster). The pixels are compared (largest absolute
difference, reported).

    python benchmarks/preprocessing.py           # 4000x3000 and 12000x12000 -> benchmarks/results/
    python benchmarks/preprocessing.py --quick   # small images and tiles, seconds -> a temp dir

Writes ``preprocessing.json`` to ``--out``.
"""

import argparse
import json
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
from common import add_out_argument, machine, output_dir
from PIL import Image

from fusion.preprocessing import ClipImageProcessor, Idefics3ImageProcessor

# (height, width): a 12 MP photo, and the 144 MP image the issue found 4.7x slower.
SIZES = [(3000, 4000), (12000, 12000)]
QUICK_SIZES = [(120, 160), (90, 90)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small images: checks the script")
    add_out_argument(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds = 1
    args.out = output_dir(args.out, check=args.quick)
    return args


def processors(quick: bool = False) -> dict:
    """name -> (ours, theirs) with the same settings (``quick``: SmolVLM's sizes divided by 8,
    so that a check takes seconds)."""
    from transformers import LlavaImageProcessor, SmolVLMImageProcessor

    clip = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}
    clip |= {"do_pad": True, "resample": 3}
    longest, tile = (256, 64) if quick else (2048, 512)
    smolvlm = {"size": {"longest_edge": longest}, "max_image_size": {"longest_edge": tile}}
    smolvlm |= {"resample": 1, "do_image_splitting": True}
    # The 144 MP image is above the default cap (Pillow's bomb limit): raised, as a user would.
    cap = {"max_pixels": 12_000 * 12_000}
    return {
        "llava_1_5": (
            replace(ClipImageProcessor.from_config(clip), **cap),
            LlavaImageProcessor(**clip),
        ),
        "smolvlm_256m": (
            replace(Idefics3ImageProcessor.from_config(smolvlm), **cap),
            SmolVLMImageProcessor(**smolvlm),
        ),
    }


def image(height: int, width: int) -> Image.Image:
    """A photo-like RGB image: smooth gradients and noise (so resizing has work to do)."""
    rng = np.random.default_rng(0)
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    for c, base in enumerate((x + 0 * y, y + 0 * x, (x + y) / 2)):
        noise = rng.integers(0, 40, (height, width), dtype=np.uint8)
        pixels[..., c] = np.clip(base * 0.8 + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def ours_pixels(processor, picture: Image.Image) -> torch.Tensor:
    out = processor.process(picture)
    return out.tiles if hasattr(out, "tiles") else out[None]


def theirs_pixels(processor, picture: Image.Image) -> torch.Tensor:
    out = processor(images=[picture], return_tensors="pt")["pixel_values"]
    if out.dim() == 5:  # Idefics3 / SmolVLM: [batch, tiles, 3, s, s], padded tiles dropped
        out = out[0][out[0].flatten(1).any(1)]
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = {
        "machine": machine(torch.device("cpu"), ("transformers", "PIL", "numpy")),
        "settings": {
            "rounds": args.rounds,
            "quick": args.quick,
            "fusion_resize": "pillow",  # fusion's resize is Pillow's Image.resize
        },
        "results": [],
    }
    for height, width in QUICK_SIZES if args.quick else SIZES:
        picture = image(height, width)
        for name, (ours, theirs) in processors(args.quick).items():
            mine, hf = ours_pixels(ours, picture), theirs_pixels(theirs, picture)  # warm-up
            difference = (mine - hf).abs().max().item() if mine.shape == hf.shape else None
            ours_s, theirs_s = [], []
            for _ in range(args.rounds):
                start = time.perf_counter()
                ours_pixels(ours, picture)
                ours_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                theirs_pixels(theirs, picture)
                theirs_s.append(time.perf_counter() - start)
            row = {
                "processor": name,
                "height": height,
                "width": width,
                "output_shape": list(mine.shape),
                "same_shape": mine.shape == hf.shape,
                "max_abs_difference": difference,
                "fusion_s": ours_s,
                "transformers_s": theirs_s,
                "fusion_median_s": statistics.median(ours_s),
                "transformers_median_s": statistics.median(theirs_s),
                "ratio_transformers_to_fusion": statistics.median(
                    t / o for t, o in zip(theirs_s, ours_s, strict=True)
                ),
            }
            report["results"].append(row)
            print(
                f"{name:13s} {height}x{width}: fusion {row['fusion_median_s']:.2f} s, "
                f"transformers {row['transformers_median_s']:.2f} s, ratio "
                f"{row['ratio_transformers_to_fusion']:.2f}, max |diff| {difference}",
                flush=True,
            )
    report["machine"]["load_average_end"] = __import__("os").getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "preprocessing.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
