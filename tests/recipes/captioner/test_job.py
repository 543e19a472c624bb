"""The job end to end, in this process: report, determinism and bad input."""

import json
import os
from pathlib import Path

import pytest

from recipes.captioner import main


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_the_report(finished_run):
    out, printed = finished_run
    assert "held-out exact match:" in printed and "with greedy generation" in printed
    assert "sample generations" in printed
    assert "text-only logits of the fused model and the plain decoder are bitwise equal" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["losses"]) == 12 and metrics["decoder_check_equal"] is True
    assert 0 <= metrics["heldout_exact_match"] <= 1 and metrics["heldout_size"] == 16
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Checkpoints at 5, 10 and the last step; the default keeps the latest two.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000010",
        "step_00000012",
    ]


def test_a_fixed_seed_gives_the_same_loss_curve(job, tmp_path, capsys):
    curves = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        args = job.tiny("--steps", "8", "--seed", seed, "--output-dir", str(tmp_path / name))
        assert main(args) == 0
        curves[name] = job.losses(tmp_path / name)
    assert len(curves["a"]) == 8
    assert curves["a"] == curves["b"]  # bitwise
    assert curves["a"] != curves["c"]


# ------------------------------------------------------------------------------ bad input


def _expect_failure(job, argv: list[str], capsys, *, status: int, message: str) -> None:
    err = job.error(argv, capsys, status)
    assert message in err, err


def test_bad_input_changes_no_checkpoint(finished_run, job, capsys, tmp_path):
    out, _ = finished_run
    before = _snapshot(out)
    base = job.tiny("--steps", "12", "--checkpoint-every", "5", "--output-dir", str(out))

    _expect_failure(
        job, [*base, "--no-such-flag"], capsys, status=2, message="unrecognized arguments"
    )
    _expect_failure(
        job, base, capsys, status=1, message="already holds checkpoints (latest: step_00000012)"
    )
    _expect_failure(
        job,
        [*base, "--resume", "--decoder-dim", "32", "--decoder-mlp-dim", "48"],
        capsys,
        status=1,
        message="--decoder-dim: the checkpoint was trained with 16, not 32; --decoder-mlp-dim: "
        "the checkpoint was trained with 32, not 48; drop these flags to resume",
    )
    _expect_failure(
        job,
        [*base, "--resume", "--lr", "0.5"],
        capsys,
        status=1,
        message="--lr: the checkpoint was trained with 0.01, not 0.5; drop the flag to resume",
    )
    _expect_failure(
        job,
        [*base, "--resume", "--steps", "11"],
        capsys,
        status=1,
        message="--steps: expected at least the checkpoint's step 12, got 11",
    )
    assert _snapshot(out) == before


def test_resume_without_a_checkpoint(job, capsys, tmp_path):
    out = tmp_path / "empty"
    _expect_failure(
        job,
        job.tiny("--steps", "3", "--resume", "--output-dir", str(out)),
        capsys,
        status=1,
        message=f"--resume: no checkpoint in {out / 'checkpoints'}",
    )
    assert not out.exists()  # nothing was created


def test_output_dir_that_cannot_be_written(job, capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    _expect_failure(
        job,
        job.tiny("--steps", "3", "--output-dir", str(blocker)),
        capsys,
        status=1,
        message=f"--output-dir: {blocker} exists and is not a directory",
    )
    _expect_failure(
        job,
        job.tiny("--steps", "3", "--output-dir", str(blocker / "run")),
        capsys,
        status=1,
        message=f"--output-dir: {blocker / 'run'} is not writable",
    )
    assert blocker.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_output_dir(job, capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    _expect_failure(
        job,
        job.tiny("--steps", "3", "--output-dir", str(locked / "run")),
        capsys,
        status=1,
        message="is not writable",
    )
