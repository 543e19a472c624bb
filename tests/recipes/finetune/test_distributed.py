"""Two processes on CPU (gloo) under torchrun: full fine-tuning of a tiny Idefics3 with
FSDP2 matches one process, and its sharded checkpoint resumes on one process."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from recipes.finetune import main

REPOSITORY = Path(__file__).resolve().parents[3]
# Two processes sum the same per-token losses in another order and reduce gradients over
# gloo: float32 rounding, not bitwise.
RTOL = 1e-4


def test_fsdp_on_two_processes_resumes_on_one(model_dirs, ft, tmp_path):
    data = ft.write_data(tmp_path / "data")
    # 4 steps of 2 conversations; each process takes one per step.
    args = ft.recipe_args(model_dirs["idefics3"], data, tmp_path / "one", "--steps", "4")
    args += ["--train", "full", "--batch-tokens", "128", "--checkpoint-every", "2"]
    assert main(args) == 0
    reference = ft.metrics(tmp_path / "one")["losses"]

    out = tmp_path / "two"
    two = [*args[: args.index("--output-dir")], "--output-dir", str(out)]
    two += args[args.index("--output-dir") + 2 :]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    run = subprocess.run(
        [*launcher, "-m", "recipes.finetune", *two, "--parallel", "fsdp"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 process(es) on cpu (fsdp)" in run.stdout
    torch.testing.assert_close(ft.metrics(out)["losses"], reference, rtol=RTOL, atol=0)

    # As if the two processes had died after step 2: one process continues their checkpoint.
    shutil.rmtree(out / "checkpoints" / "step_00000004")
    shutil.rmtree(out / "final")
    (out / "metrics.json").unlink()
    assert main(["--resume", "--output-dir", str(out), "--threads", "1", "--no-progress"]) == 0
    torch.testing.assert_close(ft.metrics(out)["losses"], reference, rtol=RTOL, atol=0)
    expected = load_file(tmp_path / "one" / "final" / "model.safetensors")
    resumed = load_file(out / "final" / "model.safetensors")
    assert expected.keys() == resumed.keys()
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=RTOL, atol=1e-5)
