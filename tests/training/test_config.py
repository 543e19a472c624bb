"""The recipes' shared config machinery on a config of its own: flags per field (absent
unless given), stored settings read back with every key checked, and what a resumed run
takes from its checkpoint."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from fusion.training import TrainingError
from fusion.training.config import (
    build_parser,
    config_from_values,
    config_group,
    flag_name,
    option,
    resumed_config,
)

TITLES = {"data": "data", "run": "run", "session": "session"}


@dataclass
class Config:
    seed: int = option(0, "seed", "data")
    lr: float = option(0.1, "learning rate", "data")
    mode: str = option("a", "mode", "data", choices=("a", "b"))
    steps: int = option(10, "steps", "run")
    out: str | None = option(None, "output", "session")
    progress: bool = option(True, "bar", "session")


def check(config: Config, name) -> None:
    if config.steps < 0:
        raise ValueError(f"{name('steps')}: expected a value >= 0, got {config.steps}")


def test_flags_are_absent_unless_given(capsys):
    parser = build_parser(Config, prog="prog", description="d", group_titles=TITLES)
    assert vars(parser.parse_args([])) == {}
    given = vars(parser.parse_args(["--lr", "2", "--no-progress", "--mode", "b"]))
    assert given == {"lr": 2.0, "progress": False, "mode": "b"}
    assert flag_name("batch_tokens") == "--batch-tokens"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--mode", "c"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--mode" in err and "(see --help)" in err


def test_stored_values_are_checked():
    file = Path("ck/train_state.json")
    values = {"seed": 1, "lr": 1, "mode": "b", "steps": 3}
    config = config_from_values(Config, values, file, check=check, stored_groups=("data", "run"))
    assert config == Config(seed=1, lr=1.0, mode="b", steps=3)  # an integer for a float taken
    for bad, message in [
        ({**values, "seed": [1]}, r"'config.seed': expected int, got a value of type list"),
        ({**values, "seed": True}, r"'config.seed': expected int, got True"),
        ({**values, "mode": "c"}, r"'config.mode': expected one of \['a', 'b'\], got 'c'"),
        ({**values, "evil": 1}, r"missing keys \[\], unknown keys \['evil'\]"),
        ({**values, "steps": -1}, r"key 'config.steps': expected a value >= 0, got -1"),
        ([1], r"key 'config': expected an object"),
    ]:
        with pytest.raises(TrainingError, match=r"^checkpoint ck: train_state.json: .*" + message):
            config_from_values(Config, bad, file, check=check, stored_groups=("data", "run"))


def test_resumed_config():
    stored = Config(seed=1, lr=0.5, steps=4, out="old")
    now = Config(seed=1, steps=8, out="new", progress=False)
    resumed = resumed_config(
        now, {"seed", "steps", "out", "progress"}, stored, 4, fixed_groups=("data",)
    )
    assert resumed == Config(seed=1, lr=0.5, steps=8, out="new", progress=False)
    assert config_group(resumed, "session") == {"out": "new", "progress": False}
    # A run setting not given comes from the checkpoint.
    assert resumed_config(now, set(), stored, 4, fixed_groups=("data",)).steps == 4
    with pytest.raises(
        TrainingError, match=r"^--lr: the checkpoint was trained with 0.5, not 0.1; drop"
    ):
        resumed_config(Config(seed=1), {"lr"}, stored, 4, fixed_groups=("data",))
    with pytest.raises(TrainingError, match="--steps: expected at least the checkpoint's step 4"):
        resumed_config(Config(steps=3), {"steps"}, stored, 4, fixed_groups=("data",))
