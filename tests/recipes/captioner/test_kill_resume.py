"""SIGKILL a training process mid-run, resume it, and compare with an uninterrupted run."""

import re
import signal
import subprocess

from fusion.training import latest_checkpoint, list_checkpoints
from recipes.captioner import main
from recipes.captioner.state import load_train_state

STEPS = 60


def test_killed_run_resumes_to_the_same_losses(job, tmp_path):
    args = job.tiny("--steps", str(STEPS), "--checkpoint-every", "5", "--keep-checkpoints", "3")

    # The uninterrupted reference, in this process.
    assert main([*args, "--output-dir", str(tmp_path / "reference")]) == 0
    reference = job.losses(tmp_path / "reference")

    # The same run in a subprocess, killed (SIGKILL: no cleanup at all) once it has committed
    # its third checkpoint, while it trains on.
    out = tmp_path / "killed"
    process = subprocess.Popen(
        job.command(*args, "--output-dir", str(out)),
        cwd=tmp_path,
        env=job.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in process.stdout:
            if "saved checkpoint" in line and "(step 15," in line:
                process.send_signal(signal.SIGKILL)
                break
    finally:
        process.kill()
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    checkpoint = latest_checkpoint(out / "checkpoints")
    step = load_train_state(checkpoint).step
    assert 15 <= step < STEPS, "the process was not killed mid-run"
    assert not (out / "metrics.json").exists()

    resumed = job.run(*args, "--output-dir", str(out), "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(rf"resumed from .*step_{step:08d} at step {step} ", resumed.stdout)
    losses = job.losses(out)
    assert len(losses) == STEPS
    assert losses[step:] == reference[step:]  # bitwise, from the checkpoint step on
    assert losses[:step] == reference[:step]  # the history came back with the checkpoint
    assert [s for s, _ in list_checkpoints(out / "checkpoints")][-1] == STEPS
