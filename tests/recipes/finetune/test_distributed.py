"""Two processes on CPU (gloo) under torchrun: full fine-tuning of a tiny Idefics3 with
FSDP2 matches one process, and its sharded checkpoint resumes on one process; a data error
in one process's share is said by that process, with its rank."""

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


# Run under torchrun: the recipe, with process 1 removing, after the data check, the image of
# its own share of step 3 (the other process never reads it: one image per conversation, one
# epoch).
REMOVES_ITS_IMAGE = """
import os, sys
from fusion.training.steps import split_step
from recipes.finetune import main, trainer

real_setup = trainer.setup


def setup(*args, **kwargs):
    run = real_setup(*args, **kwargs)
    if run.runtime.rank == 1:
        batches = run.batches
        groups = split_step(batches.steps[2], batches.lengths, batches.world_size)
        mine = [ref.path for i in groups[1] for ref in batches.samples[i].images]
        print("removed:", mine[0], flush=True)
        os.remove(mine[0])
    return run


trainer.setup = setup
sys.exit(main(sys.argv[1:]))
"""


def test_a_data_error_in_one_process_is_said_by_that_process(model_dirs, ft, tmp_path):
    data = ft.write_data(tmp_path / "data")
    out = tmp_path / "run"
    args = ft.recipe_args(model_dirs["idefics3"], data, out, "--steps", "4")
    args += ["--batch-tokens", "128", "--checkpoint-every", "1", "--num-workers", "0"]
    script = tmp_path / "removes_its_image.py"
    script.write_text(REMOVES_ITS_IMAGE)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    run = subprocess.run(
        [*launcher, str(script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    removed = run.stdout.split("removed: ", 1)[1].split()[0]
    said = [line for line in run.stderr.splitlines() if "python -m recipes.finetune: error" in line]
    # Said once, by the process that found it (before, only the main process spoke: nothing).
    assert len(said) == 1, run.stderr[-3000:]
    assert said[0].startswith(f"python -m recipes.finetune: error: [rank 1] --data: {data}:")
    assert repr(removed) in said[0]
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints[-1] == "step_00000002"  # the steps before it are kept
