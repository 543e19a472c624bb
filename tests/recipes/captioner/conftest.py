"""Tiny configurations and runners for the training job's tests (the ``job`` fixture)."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusion.training import save_checkpoint
from recipes.captioner import build_model, build_tokenizer, main
from recipes.captioner.config import TrainConfig
from recipes.captioner.model import image_input
from recipes.captioner.state import train_state

# `python -m recipes...` in a subprocess started elsewhere than the repository root.
REPOSITORY = Path(__file__).resolve().parents[3]

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
    def error(argv: list[str], capsys, status: int) -> str:
        """Run the job in this process with ``argv``, expecting exit ``status`` (2: argparse
        refused it); what it wrote to stderr."""
        capsys.readouterr()
        if status == 2:
            with pytest.raises(SystemExit) as exit_info:
                main(argv)
            assert exit_info.value.code == 2
        else:
            assert main(argv) == status
        return capsys.readouterr().err

    @staticmethod
    def losses(output_dir: Path) -> list[float]:
        return json.loads((Path(output_dir) / "metrics.json").read_text())["losses"]

    @staticmethod
    def command(
        *args: str, nproc: int | None = None, module: str = "recipes.captioner"
    ) -> list[str]:
        """``python -m MODULE ARGS``, or under ``torchrun`` with ``nproc`` processes."""
        if nproc is None:
            return [sys.executable, "-m", module, *args]
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        return [sys.executable, *launcher, "-m", module, *args]

    @staticmethod
    def env() -> dict[str, str]:
        path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
        return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}

    def run(
        self,
        *args: str,
        nproc: int | None = None,
        module: str = "recipes.captioner",
        cwd: Path,
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(*args, nproc=nproc, module=module),
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


class Small:
    """A small model with AdamW state, saved as a training checkpoint in this process."""

    config = TrainConfig(
        num_train=8,
        num_heldout=4,
        image_size=16,
        encoder_dim=16,
        encoder_layers=1,
        encoder_heads=2,
        decoder_dim=16,
        decoder_layers=1,
        decoder_heads=2,
        decoder_kv_heads=1,
        decoder_mlp_dim=32,
    )

    def model_and_optimizer(self, seed: int = 0):
        torch.manual_seed(seed)
        model = build_model(self.config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        image_id = build_tokenizer().image_id
        tokens = torch.cat([torch.full((2, 4), image_id), torch.randint(0, image_id, (2, 6))], 1)
        model(tokens, encoder_input=image_input(torch.rand(2, 3, 16, 16))).sum().backward()
        optimizer.step()  # every parameter now has AdamW state
        return model, optimizer

    def save(self, root: Path, step: int, model, optimizer, keep: int = 3) -> Path:
        state = train_state(
            step=step,
            losses=[1.0] * step,
            config=self.config,
            world_size=1,
            parallel="none",
            scheduler={},
        )
        return save_checkpoint(root, model, optimizer, state, device=torch.device("cpu"), keep=keep)


@pytest.fixture(scope="session")
def small() -> Small:
    return Small()


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, job) -> tuple[Path, str]:
    """A finished tiny run of 12 steps (checkpoints at 10 and 12 kept): its output directory
    and what it printed. Read-only for the tests that use it."""
    out = tmp_path_factory.mktemp("job") / "run"
    threads = torch.get_num_threads()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(
            job.tiny("--steps", "12", "--checkpoint-every", "5", "--output-dir", str(out))
        )
    torch.set_num_threads(threads)
    assert status == 0
    return out, stdout.getvalue()
