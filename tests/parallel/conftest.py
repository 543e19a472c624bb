"""One 2-process gloo run of every sharding scenario, shared by the tests of this folder."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel.sharding_scenarios import WORLD_SIZE

TESTS = Path(__file__).parents[1]


class ShardedRuns:
    """The saved results of every rank, and the run's output folder."""

    def __init__(self, out_dir: Path, ranks: list[dict]) -> None:
        self.out_dir = out_dir
        self.ranks = ranks

    def result(self, name: str, rank: int) -> dict:
        """Scenario ``name`` on ``rank``; fails the test with the scenario's traceback if it
        raised."""
        result = self.ranks[rank][name]
        if not result["ok"]:
            pytest.fail(f"scenario {name} raised on rank {rank}:\n{result['traceback']}")
        return result


def run_scenarios(module: str, out_dir: Path) -> ShardedRuns:
    """Run ``python -m module RANK WORLD_SIZE INIT_FILE OUT_DIR`` on ``WORLD_SIZE`` processes
    (``tests`` on the path) and load each rank's ``rank{RANK}.pt``."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }
    init_file = out_dir / "store"
    command = [sys.executable, "-m", module]
    processes = [
        subprocess.Popen(
            [*command, str(rank), str(WORLD_SIZE), str(init_file), str(out_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=300)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for rank, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0, (
            f"rank {rank} exited {process.returncode}:\n{output[-4000:]}"
        )
    ranks = [
        torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)
    ]
    return ShardedRuns(out_dir, ranks)


@pytest.fixture(scope="session")
def sharded_runs(tmp_path_factory) -> ShardedRuns:
    return run_scenarios("parallel.sharding_scenarios", tmp_path_factory.mktemp("sharding"))
