"""``--resume`` when the newest checkpoint is damaged: the newest intact one takes over, with a
warning naming the damaged one, which is kept; with none intact, one line and exit 1."""

import json
import shutil
from pathlib import Path

import pytest

from recipes.captioner import main


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _edit_train_state(checkpoint: Path, key: str, value) -> None:
    state = json.loads((checkpoint / "train_state.json").read_text())
    state[key] = value
    (checkpoint / "train_state.json").write_text(json.dumps(state))


DAMAGE = {
    "truncated data file": lambda c: _truncate(c / "__0_0.distcp"),
    "empty data file": lambda c: (c / "__0_0.distcp").write_bytes(b""),
    "missing data file": lambda c: (c / "__0_0.distcp").unlink(),
    "truncated metadata": lambda c: _truncate(c / ".metadata"),
    "missing metadata": lambda c: (c / ".metadata").unlink(),
    "corrupt train state": lambda c: (c / "train_state.json").write_bytes(b"\x00garbage"),
    "scheduler state": lambda c: _edit_train_state(c, "scheduler", {"last_epoch": "x"}),
    "optimizer state": lambda c: _edit_train_state(c, "optimizer", {"param_groups": []}),
}
REASONS = {
    "truncated data file": "__0_0.distcp: is ",
    "empty data file": "__0_0.distcp: is 0 bytes",
    "missing data file": "__0_0.distcp: is missing",
    "truncated metadata": ".metadata: is not readable DCP metadata",
    "missing metadata": ".metadata: is missing",
    "corrupt train state": "train_state.json: is not valid JSON",
    "scheduler state": "train_state.json: key 'scheduler.last_epoch': expected an integer",
    "optimizer state": "train_state.json: key 'optimizer.param_groups': expected a list of 1",
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, job) -> tuple[Path, list[str], list[float]]:
    """A 4-step run with checkpoints at steps 2 and 4: directory, arguments, losses."""
    out = tmp_path_factory.mktemp("resume") / "run"
    args = job.tiny("--steps", "4", "--checkpoint-every", "2", "--output-dir", str(out))
    assert main(args) == 0
    return out, args, job.losses(out)


@pytest.mark.parametrize("damage", DAMAGE)
def test_resume_falls_back_to_the_newest_intact_checkpoint(damage, finished, tmp_path, capsys):
    source, args, reference = finished
    out = tmp_path / "run"
    shutil.copytree(source, out)
    (out / "metrics.json").unlink()
    newest = out / "checkpoints" / "step_00000004"
    DAMAGE[damage](newest)
    damaged = _snapshot(newest)
    capsys.readouterr()

    assert main([*args, "--output-dir", str(out), "--resume"]) == 0
    captured = capsys.readouterr()
    [warning] = [line for line in captured.err.splitlines() if "warning" in line]
    assert f"checkpoint {newest}: {REASONS[damage]}" in warning
    assert "resuming from the older step_00000002" in warning
    assert "resumed from" in captured.out and "at step 2" in captured.out
    kept = newest.with_name("step_00000004.damaged")
    assert f"kept as {kept}" in warning
    assert _snapshot(kept) == damaged  # never deleted, never changed
    # The run continued from step 2 to the same losses, and saved step 4 anew.
    assert json.loads((out / "metrics.json").read_text())["losses"] == reference
    assert newest.is_dir()


def test_resume_with_no_intact_checkpoint_fails_in_one_line(finished, tmp_path, capsys):
    source, args, _ = finished
    out = tmp_path / "run"
    shutil.copytree(source, out)
    DAMAGE["truncated metadata"](out / "checkpoints" / "step_00000004")
    DAMAGE["missing data file"](out / "checkpoints" / "step_00000002")
    before = _snapshot(out)
    capsys.readouterr()

    assert main([*args, "--output-dir", str(out), "--resume"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m recipes.captioner: error: --resume:")
    assert f"no intact checkpoint in {out / 'checkpoints'}" in err
    assert "step_00000004: .metadata: is not readable" in err
    assert "step_00000002: __0_0.distcp: is missing" in err
    assert _snapshot(out) == before  # nothing renamed, nothing written
