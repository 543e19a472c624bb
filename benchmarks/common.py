"""What every benchmark script shares: where its results go, and what it records of the run."""

import argparse
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path

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
