"""What every benchmark script shares: where its results go, and what it records of the run."""

import argparse
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write (default: benchmarks/results/ for full runs, a new temporary "
        "directory for checks, so the committed results are never overwritten by them)",
    )


def output_dir(out: Path | None, check: bool) -> Path:
    """``--out`` if given; else the committed results for a full run, a new temporary directory
    for a check (``--quick``, ``--target``, ``--cpu-smoke``)."""
    if out is not None:
        return out
    return Path(tempfile.mkdtemp(prefix="fusion-bench-")) if check else RESULTS


def machine(device: torch.device, packages: tuple[str, ...] = ()) -> dict:
    """Where, when and how a run started: date, platform, Python, torch and ``packages``
    versions (None where not installed), CPU model and threads, load average, the command; the
    GPU's name on CUDA."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_start": os.getloadavg(),
        "command": " ".join(["python", *sys.argv]),
    }
    for package in packages:
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = None
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = names[0] if names else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def idefics3_hf_config(text: dict, vision: dict, scale_factor: int, image_token_id: int) -> dict:
    """``Idefics3Config`` / ``SmolVLMConfig`` fields for a model given as this library's
    ``llama3_2`` keyword arguments (``text``) and SigLIP sizes (``vision``)."""
    return {
        "text_config": {
            "model_type": "llama",
            "vocab_size": text["vocab_size"],
            "hidden_size": text["embed_dim"],
            "intermediate_size": text["intermediate_dim"],
            "num_hidden_layers": text["num_layers"],
            "num_attention_heads": text["num_heads"],
            "num_key_value_heads": text["num_kv_heads"],
            "max_position_embeddings": text["max_seq_len"],
            "rope_theta": float(text["rope_base"]),
            "rms_norm_eps": text["norm_eps"],
            "tie_word_embeddings": text["tie_word_embeddings"],
        },
        "vision_config": dict(vision),
        "scale_factor": scale_factor,
        "image_token_id": image_token_id,
        "tie_word_embeddings": text["tie_word_embeddings"],
    }


#: Qwen3.5-0.8B's text stack as its published ``config.json`` gives it (``Qwen3_5TextConfig``
#: fields), less its layer count and vocabulary, which each benchmark cuts (shared by
#: ``finetune.py`` and ``qwen3_5_generation.py``).
QWEN3_5_TEXT: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
}
