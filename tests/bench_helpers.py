"""Running the benchmark scripts from the tests, as a user runs them."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(name: str, *args: str) -> str:
    """``python benchmarks/<name> <args>`` in a fresh process (Triton's CPU interpreter off),
    asserted to succeed; its stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module; its sibling imports (``common``) resolve as when it
    runs."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: ``benchmarks/finetune.py``'s contestants.
FINETUNE_CONTESTANTS = (
    "transformers_padded",
    "transformers_padding_free",
    "fusion_padded",
    "fusion_packed",
)


def assert_padding_free_matches_padded(report: dict, rounds: int) -> None:
    """In a ``finetune.py`` report: transformers' padding-free loss equals its padded loss, on
    the same weights in its own process (before training) and at the first timed step of every
    round, and it computes exactly its tokens (no padding)."""
    results = report["results"]
    free, padded = results["transformers_padding_free"], results["transformers_padded"]
    checks = free["same_weights_check_rounds"]
    assert len(checks) == rounds
    for check in checks:
        assert check["samples"] == 2
        assert check["padding_free_loss"] == pytest.approx(check["padded_loss"], rel=1e-5)
        assert check["relative_difference"] <= check["tolerance"] == 1e-5
    first = [losses[0] for losses in free["losses_rounds"]]
    assert first == pytest.approx([losses[0] for losses in padded["losses_rounds"]], rel=1e-5)
    summary = report["padding_free_first_loss"]
    assert summary["agree"] and len(summary["rounds"]) == rounds
    assert all(r["padding_free"] == x for r, x in zip(summary["rounds"], first, strict=True))
    assert free["padding_fraction"] == 0.0 and free["tokens"] == free["positions"]
