import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from fusion.training import (
    TrainingError,
    TrainState,
    adamw_warmup_cosine,
    check_model_tensors,
    checkpoint_dir,
    checkpoint_root,
    latest_checkpoint,
    list_checkpoints,
    load_train_state,
    load_training_checkpoint,
    match_saved,
    newest_intact_checkpoint,
    read_model_state_dict,
    restore_checkpoint,
    save_checkpoint,
    set_aside_damaged,
    verify_checkpoint,
)
from fusion.training import checkpoint as ckpt
from fusion.training.job import check_optimizer_state
from fusion.training.safe_dcp import read_metadata
from helpers import build_tiny_decoder


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_save_and_load_round_trip(trained, tmp_path):
    model, optimizer, _, path = trained.saved(tmp_path)
    assert path == tmp_path / "step_00000001" and latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "train_state.json",
    ]
    fresh, fresh_optimizer, _ = trained.build(seed=1)
    load_training_checkpoint(path, fresh, fresh_optimizer)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved = optimizer.state_dict()["state"]
    for key, value in fresh_optimizer.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(value[name], saved[key][name]), (key, name)
    # In one process, without a model: the plain model's keys, whole tensors.
    state_dict = read_model_state_dict(path)
    assert list(state_dict) == list(model.state_dict())
    assert all(torch.equal(state_dict[k], v) for k, v in model.state_dict().items())
    state = load_train_state(path)
    assert state.config == {"lr": 1e-2, "nested": {"layers": [2, 2]}}
    assert (state.step, state.samples_seen, state.epoch, state.world_size) == (1, 2, 0, 1)
    assert state.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_restore_continues_bit_for_bit(trained, tmp_path):
    model, optimizer, scheduler, path = trained.saved(tmp_path, step=2)
    expected = [trained.step(model, optimizer, scheduler) for _ in range(2)]

    torch.manual_seed(99)  # the checkpoint's RNG state must replace this one
    fresh, fresh_optimizer, fresh_scheduler = trained.build(seed=1)
    state = load_train_state(path)
    restore_checkpoint(
        path, state, fresh, fresh_optimizer, fresh_scheduler, rank=0, device=torch.device("cpu")
    )
    assert fresh_scheduler.state_dict() == load_train_state(path).scheduler
    resumed = [trained.step(fresh, fresh_optimizer, fresh_scheduler) for _ in range(2)]
    assert resumed == expected
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_of_the_looping_adamw_resumes_fused(trained, tmp_path):
    """Checkpoints written before the recipes' AdamW became fused (``foreach=None``,
    ``fused=None``) resume with the fused one: the flags are migrated to the live optimizer's,
    where torch's own loading would restore the saved ones, and the run goes on as if the
    optimizer had switched kernels in memory."""
    model, optimizer, scheduler, path = trained.saved(tmp_path, step=2)
    assert optimizer.param_groups[0]["fused"] is None  # the loop, as fusion wrote them
    for group in optimizer.param_groups:  # the uninterrupted run switches kernels in place
        group["fused"], group["foreach"] = True, False
    expected = [trained.step(model, optimizer, scheduler) for _ in range(2)]

    fresh = build_tiny_decoder(seed=1)
    fused, _ = adamw_warmup_cosine(
        fresh.parameters(), lr=1e-3, weight_decay=0.0, warmup=1, total=10
    )
    assert fused.param_groups[0]["fused"] is True
    fused_scheduler = torch.optim.lr_scheduler.LambdaLR(fused, lambda step: 1 / (step + 1))
    state = load_train_state(path)
    check_optimizer_state(path, state, fused, fused_scheduler)
    restore_checkpoint(
        path, state, fresh, fused, fused_scheduler, rank=0, device=torch.device("cpu")
    )
    # the hyper-parameters are the checkpoint's, the kernel the live optimizer's
    assert [(g["fused"], g["betas"]) for g in fused.param_groups] == [(True, (0.9, 0.999))]
    assert [trained.step(fresh, fused, fused_scheduler) for _ in range(2)] == expected
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    # unmigrated, the saved flags (None) would not fit the live ones (True)
    live = [{k: v for k, v in g.items() if k != "params"} for g in fused.param_groups]
    with pytest.raises(TrainingError, match=r"key 'optimizer\.param_groups\[0\]\.fused'"):
        match_saved(path, "optimizer.param_groups", state.param_groups, live)


def test_restore_refuses_a_scheduler_that_does_not_fit_before_loading(trained, tmp_path):
    _, _, _, path = trained.saved(tmp_path)
    fresh, fresh_optimizer, _ = trained.build(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    other = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=3)
    state = load_train_state(path)
    with pytest.raises(TrainingError, match=r"train_state\.json: key 'scheduler'"):
        restore_checkpoint(
            path, state, fresh, fresh_optimizer, other, rank=0, device=torch.device("cpu")
        )
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_only_the_latest_checkpoints_are_kept(trained, tmp_path):
    model, optimizer, scheduler = trained.build()
    for step in (1, 2, 3, 4):
        trained.save(tmp_path, step, model, optimizer, scheduler, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    with pytest.raises(ValueError, match="keep: expected an integer >= 1, got 0"):
        trained.save(tmp_path, 5, model, optimizer, scheduler, keep=0)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]


def test_saving_a_step_again_replaces_it_whole(trained, tmp_path):
    trained.saved(tmp_path, seed=0)
    (tmp_path / ".trash-step_00000000-1").mkdir()  # as left by a crash while pruning
    other, _, _, path = trained.saved(tmp_path, seed=1)
    state_dict = read_model_state_dict(path)
    assert all(torch.equal(state_dict[k], v) for k, v in other.state_dict().items())
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]


@pytest.mark.parametrize("where", ["dcp_save", "train_state"])
def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(
    trained, tmp_path, monkeypatch, where
):
    model, optimizer, scheduler, previous = trained.saved(tmp_path)
    before = _snapshot(tmp_path)

    def crash_in_dcp(state, *, checkpoint_id, **kwargs):  # some files written, then a failure
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError("disk full")

    def crash_in_train_state(path, data):
        path.write_bytes(data[:10])
        raise OSError("disk full")

    if where == "dcp_save":
        monkeypatch.setattr(ckpt.dcp, "save", crash_in_dcp)
    else:
        monkeypatch.setattr(ckpt, "atomic_write_bytes", crash_in_train_state)
    with pytest.raises(OSError, match="disk full"):
        trained.save(tmp_path, 2, model, optimizer, scheduler)
    monkeypatch.undo()

    assert latest_checkpoint(tmp_path) == previous  # the temporary directory is no step
    assert {k: v for k, v in _snapshot(tmp_path).items() if k in before} == before
    verify_checkpoint(previous, model)
    # The next save cleans up after the crash and commits normally.
    committed = trained.save(tmp_path, 2, model, optimizer, scheduler)
    assert latest_checkpoint(tmp_path) == committed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "file.bin"
    ckpt.atomic_write_bytes(target, b"old")

    def fail(fd):
        raise OSError("fsync failed")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="fsync failed"):
        ckpt.atomic_write_bytes(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["file.bin"]  # no temporary file left behind


def test_the_model_tensors_must_match(trained, tmp_path):
    model, _, _, path = trained.saved(tmp_path)
    checked = read_metadata(path)
    with torch.device("meta"):  # checked without allocating
        check_model_tensors(path, checked, build_tiny_decoder())
        untied = build_tiny_decoder(tie_word_embeddings=False)
    with pytest.raises(
        TrainingError,
        match=r"\.metadata: its model tensors do not match: missing \(1\): output\.weight",
    ):
        verify_checkpoint(path, untied)
    model.norm.scale.data = model.norm.scale.data[:-1]
    with pytest.raises(
        TrainingError,
        match=r"differ \(1\): norm\.scale: stored \[32\] torch.float32, expected \[31\]",
    ):
        check_model_tensors(path, checked, model)


def _damage(path: Path) -> None:
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])


def test_resume_finds_the_newest_intact_checkpoint_and_sets_damaged_ones_aside(trained, tmp_path):
    root = checkpoint_root(tmp_path)
    model, optimizer, scheduler = trained.build()
    for step in (1, 2, 3):
        trained.save(root, step, model, optimizer, scheduler)
    _damage(root / "step_00000003")
    (root / "step_00000002" / "train_state.json").write_text("{")

    def inspect(path):
        state = load_train_state(path)
        verify_checkpoint(path, model)
        return state

    before = _snapshot(root)
    path, state, damaged = newest_intact_checkpoint(root, inspect)
    assert path == root / "step_00000001" and state.step == 1
    assert [p.name for p, _ in damaged] == ["step_00000003", "step_00000002"]
    assert "__0_0.distcp: is " in damaged[0][1] and "is not valid JSON" in damaged[1][1]
    assert _snapshot(root) == before  # finding changes nothing

    warnings: list[str] = []
    kept = set_aside_damaged(damaged, path, warnings.append)
    assert [p.name for p in kept] == ["step_00000003.damaged", "step_00000002.damaged"]
    assert [s for s, _ in list_checkpoints(root)] == [1]
    assert "resuming from the older step_00000001" in warnings[0] and str(kept[0]) in warnings[0]
    # Damaged again at the same step: kept beside the first, never overwritten.
    trained.save(root, 3, model, optimizer, scheduler)
    _damage(root / "step_00000003")
    _, _, damaged = newest_intact_checkpoint(root, inspect)
    assert [p.name for p in set_aside_damaged(damaged, path, warnings.append)] == [
        "step_00000003.damaged-2"
    ]


def test_resume_without_an_intact_checkpoint(trained, tmp_path):
    root = checkpoint_root(tmp_path)
    with pytest.raises(TrainingError, match=r"^--resume: no checkpoint in .*run without --resume"):
        newest_intact_checkpoint(root, load_train_state)
    trained.saved(root)
    (root / "step_00000001" / "train_state.json").unlink()
    with pytest.raises(
        TrainingError, match=r"^--from: no intact checkpoint in .*train_state\.json: is missing"
    ):
        newest_intact_checkpoint(root, load_train_state, flag="--from")


def test_checkpoint_dir_arguments(trained, tmp_path):
    trained.saved(checkpoint_root(tmp_path))
    with pytest.raises(TypeError, match=r"path: expected a str or os\.PathLike, got int"):
        checkpoint_dir(3)
    with pytest.raises(TrainingError, match="does not exist"):
        checkpoint_dir(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(TrainingError, match=r"--checkpoint: .* is not a directory"):
        checkpoint_dir(tmp_path / "file", "--checkpoint")
    with pytest.raises(TrainingError, match=r"its latest checkpoint is .*step_00000001"):
        read_model_state_dict(tmp_path)


def test_train_state_json_is_strict_json(trained, tmp_path):
    _, _, _, path = trained.saved(tmp_path)
    stored = json.loads((path / "train_state.json").read_text())
    assert list(stored) == [
        "format", "step", "samples_seen", "epoch", "world_size", "parallel", "losses",
        "config", "scheduler", "optimizer", "rng",
    ]  # fmt: skip
    assert stored["format"] == 2 and len(stored["rng"]) == 1


class Odd(nn.Module):
    """Not a decoder at all: bf16 and fp16 parameters, a 0-d, an empty and a bool buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, dtype=torch.bfloat16))
        self.h = nn.Parameter(torch.randn(2, dtype=torch.float16))
        self.register_buffer("count", torch.tensor(7))
        self.register_buffer("empty", torch.empty(0, 5))
        self.register_buffer("mask", torch.tensor([True, False]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w.float().T).sum() + self.h.float().sum()


def test_any_model_with_odd_dtypes_and_empty_tensors_round_trips(tmp_path):
    def build():
        model = Odd()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    model, optimizer = build()
    model(torch.randn(2, 4)).backward()
    optimizer.step()
    state = TrainState(
        step=0, samples_seen=0, epoch=0, losses=[], config={}, world_size=1, parallel="none",
        scheduler={},
    )  # fmt: skip
    path = save_checkpoint(tmp_path, model, optimizer, state, device=torch.device("cpu"), keep=1)
    stored = read_model_state_dict(path)
    for key, value in model.state_dict().items():
        assert stored[key].dtype == value.dtype and torch.equal(stored[key], value), key
    verify_checkpoint(path, model)
    fresh, fresh_optimizer = build()
    load_training_checkpoint(path, fresh, fresh_optimizer)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    momentum = fresh_optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, optimizer.state_dict()["state"][0]["momentum_buffer"])


class PartlyUsed(nn.Module):
    """``unused`` trains but never gets a gradient (as the last layer of LLaVA's vision
    tower): the optimizer never makes state for it."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).square().sum()


@pytest.mark.parametrize("trainable_only", [False, True])
def test_a_parameter_without_optimizer_state_resumes_without_one(tmp_path, trainable_only):
    def build():
        torch.manual_seed(0)
        model = PartlyUsed()
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    def step(model, optimizer):
        model(torch.ones(2, 4)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model, optimizer = build()
    step(model, optimizer)
    assert len(optimizer.state) == 2  # used.weight and used.bias only
    state = TrainState(
        step=1, samples_seen=1, epoch=0, losses=[1.0], config={}, world_size=1, parallel="none",
        scheduler={},
    )  # fmt: skip
    path = save_checkpoint(
        tmp_path, model, optimizer, state, device=torch.device("cpu"), keep=1,
        trainable_only=trainable_only,
    )  # fmt: skip
    fresh, fresh_optimizer = build()
    load_training_checkpoint(path, fresh, fresh_optimizer)
    assert {id(p) for p in fresh_optimizer.state} == {id(p) for p in fresh.used.parameters()}
    step(model, optimizer)
    step(fresh, fresh_optimizer)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
