"""What every benchmark script shares: where its results go."""

import argparse
import tempfile
from pathlib import Path

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
