import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fusion.training import RngState, TrainingError, TrainState, load_train_state, match_saved
from fusion.training.state import TRAIN_STATE, key_error


@dataclasses.dataclass
class Config:
    lr: float = 1e-3
    layers: int = 2


def parse_config(values: dict, file: Path) -> Config:
    if set(values) != {"lr", "layers"}:
        raise TrainingError(f"{file}: key 'config': unexpected keys {sorted(values)}")
    return Config(**values)


def state(**kwargs) -> TrainState:
    values = {
        "step": 3,
        "samples_seen": 12,
        "epoch": 1,
        "losses": [2.0, float("nan"), float("inf")],
        "config": {"lr": 1e-3, "layers": 2},
        "world_size": 2,
        "parallel": "fsdp",
        "scheduler": {"last_epoch": 3, "_step_count": 4},
        "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.95]}],
        "rng": [RngState.capture(torch.device("cpu"))] * 2,
    }
    return TrainState(**(values | kwargs))


def write(path: Path, saved: TrainState) -> Path:
    path.mkdir(exist_ok=True)
    (path / TRAIN_STATE).write_bytes(saved.encode())
    return path


def test_round_trip_with_a_dict_or_a_dataclass_config(tmp_path):
    saved = state(eval_losses=[(0, 3.0), (2, 1.5)])
    loaded = load_train_state(write(tmp_path, saved))
    assert (loaded.step, loaded.samples_seen, loaded.epoch) == (3, 12, 1)
    assert loaded.losses[0] == 2.0 and loaded.losses[2] == float("inf")
    assert loaded.losses[1] != loaded.losses[1]  # nan: a diverged run's history
    assert loaded.config == {"lr": 1e-3, "layers": 2} and loaded.eval_losses == [(0, 3.0), (2, 1.5)]
    assert (loaded.world_size, loaded.parallel, loaded.scheduler) == (2, "fsdp", saved.scheduler)
    assert torch.equal(loaded.rng_of(1).cpu, saved.rng[1].cpu)
    assert loaded.rng_of(5) is loaded.rng[0]  # more processes than saved it: rank 0's

    as_dataclass = load_train_state(write(tmp_path, state(config=Config())), parse_config)
    assert as_dataclass.config == Config() and as_dataclass.eval_losses == []
    stored = json.loads((tmp_path / TRAIN_STATE).read_text())
    assert "eval_losses" not in stored  # written only when there are some
    assert stored["config"] == {"lr": 1e-3, "layers": 2}


def test_the_rng_state_comes_back(tmp_path):
    torch.manual_seed(5)
    saved = state(rng=[RngState.capture(torch.device("cpu"))] * 2)
    expected = torch.rand(3)
    loaded = load_train_state(write(tmp_path, saved))
    torch.manual_seed(6)
    loaded.rng_of(0).restore(torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)


def _edit(key: str, value):
    def edit(stored: dict) -> None:
        *parents, last = key.split(".")
        target = stored
        for name in parents:
            target = target[int(name)] if isinstance(target, list) else target[name]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return edit


def _drop(key: str):
    return lambda stored: stored.pop(key)


MALFORMED = {
    "unknown key": (
        _edit("extra", 1),
        r"key '<top level>': missing keys \[\], unknown keys \['extra'\]",
    ),
    "missing key": (_drop("epoch"), r"missing keys \['epoch'\]"),
    "format": (_edit("format", 3), r"key 'format': expected 2, got 3"),
    "negative step": (_edit("step", -1), r"key 'step': expected an integer in \[0, "),
    "losses": (_edit("step", 4), r"key 'losses': expected a list of 4, got a list"),
    "long integer in config": (
        _edit("config.nested", {"n": [1, int("9" * 40)]}),
        r"key 'config\.nested\.n\[1\]': expected an integer of at most 19 digits, "
        "got an integer of 40 digits",
    ),
    "parallel": (
        _edit("parallel", "tp"),
        r"key 'parallel': expected one of \['none', 'ddp', 'fsdp'\]",
    ),
    "rng count": (_edit("world_size", 3), r"key 'rng': expected a list of 3"),
    "eval step order": (
        _edit("eval_losses", [[2, 1.0], [2, 1.0]]),
        r"key 'eval_losses\[1\]\[0\]': expected an integer in \[3, 3\], got 2",
    ),
    "eval after the step": (
        _edit("eval_losses", [[4, 1.0]]),
        r"key 'eval_losses\[0\]\[0\]': expected an integer in \[0, 3\], got 4",
    ),
    "eval pair": (_edit("eval_losses", [[1]]), r"key 'eval_losses\[0\]': expected a list of 2"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_files_name_the_file_and_the_key(case, tmp_path):
    edit, message = MALFORMED[case]
    stored = json.loads(state().encode().decode().replace("NaN", "1.0").replace("Infinity", "1.0"))
    stored["eval_losses"] = []
    edit(stored)
    (tmp_path / TRAIN_STATE).write_text(json.dumps(stored))
    with pytest.raises(TrainingError, match=message) as error:
        load_train_state(tmp_path)
    assert str(error.value).startswith(f"checkpoint {tmp_path}: {TRAIN_STATE}: ")


def test_the_recipe_checks_its_config_and_position(tmp_path):
    write(tmp_path, state(config={"lr": 1e-3}))
    with pytest.raises(TrainingError, match=r"key 'config': unexpected keys \['lr'\]"):
        load_train_state(tmp_path, parse_config)
    error = key_error(tmp_path, "samples_seen", "6 (step 3 x 2)", 12)
    assert str(error) == (
        f"checkpoint {tmp_path}: {TRAIN_STATE}: key 'samples_seen': expected 6 (step 3 x 2), got 12"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"step": -1}, r"step: expected an integer >= 0, got -1"),
        ({"epoch": 1.0}, r"epoch: expected an integer >= 0, got 1\.0"),
        ({"losses": [1.0]}, r"losses: expected one loss per step \(3\), got 1"),
        ({"world_size": 0}, r"world_size: expected an integer >= 1, got 0"),
        ({"parallel": "tp"}, r"parallel: expected one of \['none', 'ddp', 'fsdp'\], got 'tp'"),
    ],
)
def test_a_state_that_could_not_be_loaded_again_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        state(**change)


def test_a_config_json_cannot_store_is_refused_when_encoding():
    with pytest.raises(
        TypeError, match="config: expected a dict or a dataclass instance, got list"
    ):
        state(config=[1, 2]).encode()
    with pytest.raises(TypeError, match="not JSON serializable"):
        state(config={"device": torch.device("cpu")}).encode()


def test_match_saved(tmp_path):
    template = {"lr": 1e-3, "betas": (0.9, 0.95), "name": "adamw"}
    assert match_saved(tmp_path, "optimizer", {"lr": 2e-3, "betas": [0.8, 0.9]}, template) == {
        "lr": 2e-3,
        "betas": (0.8, 0.9),
        "name": "adamw",  # missing in the file: the live value
    }
    with pytest.raises(TrainingError, match=r"key 'optimizer\.betas': expected a list of 2"):
        match_saved(tmp_path, "optimizer", {"betas": [0.9]}, template)
    with pytest.raises(TrainingError, match=r"key 'optimizer': unknown keys \['momentum'\]"):
        match_saved(tmp_path, "optimizer", {"momentum": 0.9}, template)
