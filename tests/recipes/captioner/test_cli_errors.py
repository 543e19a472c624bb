"""Every error of ``python -m recipes.captioner`` is one line on stderr and a non-zero exit;
optional dependencies missing cost their feature only, said up front."""

import errno
import json
import sys

import pytest
import torch

import fusion.training.checkpoint
import fusion.training.report
import recipes.captioner.trainer
from recipes.captioner import main

PROG = "python -m recipes.captioner: "


def _fails_in_one_line(job, argv, capsys, status: int) -> str:
    err = job.error(argv, capsys, status)
    assert err.count("\n") == 1 and err.startswith(PROG + "error: "), err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "nonsense"], "argument --device: invalid choice: 'nonsense'"),
        (["--device", "cuda:7"], "argument --device: invalid choice: 'cuda:7'"),
        (["--threads", "100000"], "--threads: expected at most the "),
        (["--output-dir", ""], "--output-dir: expected a directory path"),
        (["--output-dir", "a\0b"], "--output-dir: expected a directory path"),
        (["--lr", "inf"], "--lr: expected a finite number, got inf"),
        (["--weight-decay", "nan"], "--weight-decay: expected a finite number, got nan"),
        (["--steps", "99999999999"], "--steps: expected at most 2147483647"),
        (["--seed", "-99999999999"], "--seed: expected at most 2147483647 in magnitude"),
        (["--steps", "9" * 5000], "argument --steps: invalid int value"),
        (["--num-samples", "-1"], "--num-samples: expected a value >= 0"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flags(argv, message, capsys, job):
    assert message in _fails_in_one_line(job, argv, capsys, status=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
def test_cuda_without_cuda(job, tmp_path, capsys):
    argv = job.tiny("--device", "cuda", "--output-dir", str(tmp_path / "run"))
    err = _fails_in_one_line(job, argv, capsys, status=1)
    assert "--device: 'cuda' requested, but torch sees no CUDA device" in err
    assert not (tmp_path / "run").exists()


def test_unusable_output_dirs(job, tmp_path, capsys):
    for where in ("/proc/fusion-run", "/sys/fusion-run"):  # refused even to root
        err = _fails_in_one_line(job, job.tiny("--output-dir", where), capsys, status=1)
        assert f"--output-dir: {where} is not writable" in err


def test_malformed_torchrun_environment(job, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "first")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    err = _fails_in_one_line(job, job.tiny("--output-dir", str(tmp_path)), capsys, status=1)
    assert "environment variable RANK: expected an integer >= 0, got 'first'" in err


def test_argv_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"^argv: expected None or a list of str"):
        main("--steps 3")


def test_errors_from_the_command_line_are_one_line(job, tmp_path):
    run = job.run("--device", "cuda:7", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "--device: invalid choice: 'cuda:7'" in run.stderr


def test_without_matplotlib_the_metrics_are_written(job, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    # Said before any work: a run that fails at once says it too.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    expected = "warning: no loss plot: matplotlib cannot be imported"
    capsys.readouterr()
    assert main(job.tiny("--output-dir", str(blocker))) == 1
    assert expected in capsys.readouterr().err

    out = tmp_path / "run"
    assert main(job.tiny("--steps", "2", "--output-dir", str(out))) == 0
    err = capsys.readouterr().err
    [warning] = err.splitlines()
    assert expected in warning and "pip install -e '.[train]'" in warning
    assert len(json.loads((out / "metrics.json").read_text())["losses"]) == 2
    assert not (out / "loss.png").exists()


def test_without_tqdm_there_is_no_progress_bar(job, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fusion.training.report, "tqdm", None)
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(job.tiny("--steps", "2", "--progress", "--output-dir", str(out))) == 0
    captured = capsys.readouterr()
    [warning] = captured.err.splitlines()
    assert "warning: no progress bar: tqdm is not installed" in warning
    assert "pip install -e '.[train]'" in warning
    assert "saved checkpoint" in captured.out  # the log goes on without tqdm
    assert (out / "metrics.json").exists() and (out / "loss.png").exists()


def test_a_full_disk_while_training_is_one_line(job, tmp_path, capsys, monkeypatch):
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(fusion.training.checkpoint, "atomic_write_bytes", full)
    out = tmp_path / "run"
    err = _fails_in_one_line(job, job.tiny("--steps", "2", "--output-dir", str(out)), capsys, 1)
    assert "I/O error: [Errno 28] No space left on device" in err
    assert not list((out / "checkpoints").glob("step_*"))  # no partial checkpoint committed


def test_out_of_memory_is_one_line(job, tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):  # what torch's CPU allocator raises for a too large tensor
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")

    monkeypatch.setattr(recipes.captioner.trainer, "make_splits", refuse)
    argv = job.tiny("--image-size", "65536", "--output-dir", str(tmp_path / "run"))
    assert "error: out of memory: " in _fails_in_one_line(job, argv, capsys, 1)


def test_other_runtime_errors_keep_their_traceback(job, tmp_path, monkeypatch):
    def bug(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(recipes.captioner.trainer, "make_splits", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(job.tiny("--output-dir", str(tmp_path / "run")))
