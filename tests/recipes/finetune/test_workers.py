"""Micro-batches made by data loader workers: the losses do not depend on how many there
are, a run resumed with workers continues bit for bit, a worker that fails (an image that
can no longer be read, a worker killed) stops the run with one line, the checkpoints saved
before intact, and --num-workers is checked by name and free to change on --resume."""

import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from fusion.data import StepBatches
from fusion.training import latest_checkpoint, verify_checkpoint
from recipes.finetune import main, trainer
from recipes.finetune.config import config_from_json, config_to_json, parse_args, resumed_config

RESUME = ["--resume", "--threads", "1", "--no-progress"]
REQUIRED = ["--model", "m", "--data", "d.jsonl", "--output-dir", "out"]


def run_args(ft, model, data, out, *extra: str) -> list[str]:
    """LoRA with dropout (the training RNG runs) on images, 6 steps of 2 micro-batches,
    checkpoints at 2, 4 and 6, eval losses."""
    argv = ft.recipe_args(model, data, out, "--steps", "6", "--batch-tokens", "256")
    argv += ["--lr", "1e-2", "--lora-dropout", "0.1", "--grad-accum", "2"]
    return [*argv, "--checkpoint-every", "2", "--eval-data", str(data), *extra]


def final_tensors(out) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def assert_same_run(out, reference, ft) -> None:
    """Bit for bit: the losses, the eval losses and the exported weights."""
    ours, theirs = ft.metrics(out), ft.metrics(reference)
    assert ours["losses"] == theirs["losses"] and ours["eval_losses"] == theirs["eval_losses"]
    ours_final, theirs_final = final_tensors(out), final_tensors(reference)
    assert ours_final.keys() == theirs_final.keys()
    assert all(torch.equal(ours_final[k], theirs_final[k]) for k in theirs_final)


@pytest.fixture(scope="module")
def data(tmp_path_factory, ft):
    return ft.write_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(model_dirs, data, tmp_path_factory, ft):
    """The runs made in the training process (``--num-workers 0``), packed and not."""
    root = tmp_path_factory.mktemp("reference")
    runs = {}
    for packing in ("--packing", "--no-packing"):
        out = root / packing.strip("-")
        assert (
            main(run_args(ft, model_dirs["smolvlm"], data, out, packing, "--num-workers", "0")) == 0
        )
        runs[packing] = out
    return runs


@pytest.mark.parametrize("packing", ["--packing", "--no-packing"])
def test_the_losses_do_not_depend_on_the_number_of_workers(
    packing, model_dirs, data, reference, tmp_path, ft
):
    out = tmp_path / "run"
    assert main(run_args(ft, model_dirs["smolvlm"], data, out, packing, "--num-workers", "4")) == 0
    losses = ft.metrics(out)["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert_same_run(out, reference[packing], ft)


def resumable_copy(out, tmp_path, keep: int):
    """A copy of run ``out`` as if it had stopped after checkpoint ``keep``."""
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "final")
    (copy / "metrics.json").unlink()
    for checkpoint in (copy / "checkpoints").iterdir():
        if int(checkpoint.name.split("_")[1]) > keep:
            shutil.rmtree(checkpoint)
    return copy


def test_a_run_resumed_with_workers_continues_bit_for_bit(reference, tmp_path, ft):
    """Stopped at step 4 (its workers had made micro-batches of steps 5 and 6 ahead), resumed
    with another number of workers: the uninterrupted run."""
    copy = resumable_copy(reference["--packing"], tmp_path, keep=4)
    assert main([*RESUME, "--output-dir", str(copy), "--num-workers", "2"]) == 0
    assert_same_run(copy, reference["--packing"], ft)


def images_of_step(run, step: int) -> list[str]:
    samples = run.train_data.samples
    return [ref.path for i in run.plan[step].samples for ref in samples[i].images]


@pytest.mark.parametrize("damage", ["removed", "corrupted"])
def test_an_image_that_can_no_longer_be_read_is_one_line_naming_it(
    damage, model_dirs, tmp_path, monkeypatch, capsys, ft
):
    """The data is read and every image checked before training; an image of the 4th step
    (of 2 conversations each) damaged after that, while the workers make micro-batches
    ahead, stops the run when that step's turn comes, after the checkpoints of steps 1 to 3."""
    data = ft.write_data(tmp_path / "data")
    real_setup = trainer.setup
    damaged = []

    def setup_then_damage(*args, **kwargs):
        run = real_setup(*args, **kwargs)
        earlier = {path for step in range(3) for path in images_of_step(run, step)}
        image = next(p for p in images_of_step(run, 3) if p not in earlier)
        if damage == "removed":
            os.remove(image)
        else:
            with open(image, "r+b") as file:
                file.truncate(40)  # the PNG header, the pixels cut
        damaged.append(image)
        return run

    monkeypatch.setattr(trainer, "setup", setup_then_damage)
    out = tmp_path / "run"
    argv = ft.recipe_args(model_dirs["smolvlm"], data, out, "--steps", "4", "--batch-tokens", "128")
    capsys.readouterr()
    assert main([*argv, "--checkpoint-every", "1", "--num-workers", "2"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert f"error: --data: {data}:" in err and repr(damaged[0]) in err
    checkpoints = out / "checkpoints"
    assert latest_checkpoint(checkpoints).name == "step_00000003"
    for checkpoint in checkpoints.iterdir():
        verify_checkpoint(checkpoint)
    assert not (out / "final").exists()


def test_a_killed_worker_is_one_line_and_the_run_resumes_bit_for_bit(
    model_dirs, data, reference, tmp_path, monkeypatch, capsys, ft
):
    """A worker killed (SIGKILL, as the kernel kills a process out of memory) when it is to
    make step 6's first micro-batch, which the loader asks for once step 4's is in (2 workers,
    2 micro-batches ahead each): by then step 2 has been saved. The run stops with one line;
    resumed, it is the uninterrupted run."""
    real_item = StepBatches.__getitem__

    def dies_on_step_6(self, index):
        if torch.utils.data.get_worker_info() is not None and index == 5 * 2:  # grad_accum 2
            os.kill(os.getpid(), signal.SIGKILL)
        return real_item(self, index)

    monkeypatch.setattr(StepBatches, "__getitem__", dies_on_step_6)  # before the workers fork
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(run_args(ft, model_dirs["smolvlm"], data, out, "--num-workers", "2")) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert "error: --num-workers: a data loader worker process died" in err
    assert "the checkpoints saved before are intact" in err
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved[0] == "step_00000002" and not (out / "final").exists()

    monkeypatch.setattr(StepBatches, "__getitem__", real_item)
    assert main([*RESUME, "--output-dir", str(out), "--num-workers", "2"]) == 0
    assert_same_run(out, reference["--packing"], ft)


@pytest.mark.parametrize(
    ("value", "message"),
    [("-1", "--num-workers: expected a value >= 0, got -1"), ("65", "expected at most 64")],
)
def test_bad_worker_counts_exit_2_naming_the_flag(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*REQUIRED, "--num-workers", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


def test_a_resumed_run_takes_this_invocation_s_worker_count(tmp_path):
    """--num-workers does not change the results: never stored, never refused on resume."""
    config, _ = parse_args([*REQUIRED, "--num-workers", "3"])
    assert config.num_workers == 3 and "num_workers" not in config_to_json(config)
    stored = config_from_json(config_to_json(config), tmp_path / "train_state.json")
    again, given = parse_args(["--resume", "--output-dir", "out", "--num-workers", "0"])
    assert resumed_config(again, given, stored, step=2).num_workers == 0
    assert parse_args(REQUIRED)[0].num_workers == 2
