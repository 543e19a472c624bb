"""``--resume`` restores the stored configuration: ``--output-dir X --resume`` alone continues
the run as it was configured; ``--steps`` extends it; flags that would change the run are
refused by name."""

import dataclasses
import shutil
from pathlib import Path

import pytest

from fusion.training import latest_checkpoint, list_checkpoints
from recipes.captioner import TrainingError, main
from recipes.captioner.config import TrainConfig, resumed_config
from recipes.captioner.state import load_train_state


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def interrupted(finished_run, tmp_path) -> Path:
    """A copy of the finished 12-step run as if it had died after its step-10 checkpoint."""
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    shutil.rmtree(out / "checkpoints" / "step_00000012")
    (out / "metrics.json").unlink()
    return out


def test_resume_alone_continues_the_run_as_configured(finished_run, interrupted, job, capsys):
    reference = job.losses(finished_run[0])
    capsys.readouterr()
    # No data, model, optimisation or --steps flag: all come from the checkpoint.
    assert main(["--output-dir", str(interrupted), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "at step 10 of 12 " in printed
    losses = job.losses(interrupted)
    assert losses == reference  # to the stored 12 steps (not the default 1000), bitwise
    # The run settings came back too: --num-samples 2 (the default prints 8).
    assert printed.count("  [ok   ] ") + printed.count("  [WRONG] ") == 2
    resumed = load_train_state(latest_checkpoint(interrupted / "checkpoints")).config
    original = load_train_state(finished_run[0] / "checkpoints" / "step_00000010").config
    for group in ("data", "model", "optim", "run"):
        assert resumed.group(group) == original.group(group), group


def test_steps_extends_the_run_and_other_run_flags_apply(finished_run, job, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    argv = ["--output-dir", str(out), "--resume", "--no-progress", "--threads", "1"]
    # A fixed flag given with the checkpoint's own value is no change.
    assert main([*argv, "--steps", "15", "--checkpoint-every", "1", "--lr", "1e-2"]) == 0
    losses = job.losses(out)
    assert len(losses) == 15 and losses[:12] == job.losses(finished_run[0])
    assert [step for step, _ in list_checkpoints(out / "checkpoints")] == [14, 15]
    state = load_train_state(out / "checkpoints" / "step_00000015")
    assert state.config.steps == 15 and state.config.checkpoint_every == 1
    assert state.config.output_dir == str(out)


def test_flags_that_would_change_the_run_are_refused_by_name(finished_run, capsys):
    out = finished_run[0]
    before = _snapshot(out)
    argv = ["--output-dir", str(out), "--resume"]
    capsys.readouterr()
    assert main([*argv, "--num-train", "256", "--seed", "3", "--decoder-dim", "16"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (
        "error: --seed: the checkpoint was trained with 0, not 3; --num-train: the checkpoint "
        "was trained with 64, not 256; drop these flags to resume" in err
    )
    assert "--decoder-dim" not in err  # given with the checkpoint's value: no change
    assert _snapshot(out) == before


def test_resumed_config_semantics():
    stored = TrainConfig(num_train=64, steps=20, checkpoint_every=5, threads=3, progress=False)
    given = TrainConfig(output_dir="x", resume=True, steps=30, device="cpu")
    config = resumed_config(given, {"output_dir", "resume", "steps", "device"}, stored, step=10)
    expected = dataclasses.replace(
        stored, output_dir="x", resume=True, steps=30, device="cpu", threads=1, progress=True
    )
    assert config == expected  # session settings are this invocation's (defaults included)
    assert resumed_config(given, {"output_dir", "resume"}, stored, 10).steps == 20
    with pytest.raises(TrainingError, match=r"^--steps: expected at least the checkpoint's step"):
        resumed_config(given, {"steps"}, stored, step=31)
    changed = dataclasses.replace(given, batch_size=32)
    with pytest.raises(TrainingError, match=r"^--batch-size: the checkpoint was trained with 64,"):
        resumed_config(changed, {"batch_size"}, stored, step=10)
