"""Tiny configurations and runners for the training job's tests (the ``job`` fixture)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# A model and dataset small enough for a step in a few milliseconds on one CPU thread.
TINY = [
    "--num-train", "64", "--num-heldout", "16", "--image-size", "16", "--patch-size", "8",
    "--encoder-dim", "16", "--encoder-layers", "1", "--encoder-heads", "2",
    "--decoder-dim", "16", "--decoder-layers", "1", "--decoder-heads", "2",
    "--decoder-kv-heads", "1", "--decoder-mlp-dim", "32",
    "--batch-size", "8", "--warmup-steps", "2", "--lr", "1e-2",
    "--no-progress", "--num-samples", "2", "--threads", "1",
]  # fmt: skip


class Job:
    """Builds argument lists for the tiny job and runs it in a subprocess."""

    @staticmethod
    def tiny(*extra: str) -> list[str]:
        return [*TINY, *extra]

    @staticmethod
    def losses(output_dir: Path) -> list[float]:
        return json.loads((Path(output_dir) / "metrics.json").read_text())["losses"]

    @staticmethod
    def command(*args: str, nproc: int | None = None) -> list[str]:
        """``python -m fusion.training ARGS``, or under ``torchrun`` with ``nproc`` processes."""
        if nproc is None:
            return [sys.executable, "-m", "fusion.training", *args]
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        return [sys.executable, *launcher, "-m", "fusion.training", *args]

    @staticmethod
    def env() -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def run(self, *args: str, nproc: int | None = None, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(*args, nproc=nproc),
            cwd=cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=300,
        )


@pytest.fixture(scope="session")
def job() -> Job:
    return Job()


@pytest.fixture(autouse=True)
def _keep_thread_count():
    """The job sets torch's thread count for the process; give it back to the other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
