"""The recipes' shared config machinery on a config of its own: flags per field (absent
unless given), what each option must be, required flags and absolute paths, stored settings
read back with every key checked, what a resumed run takes from its checkpoint, a recipe's
ConfigSpec, and library errors worded by flag."""

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusion.training import TrainingError
from fusion.training.config import (
    FIXED_GROUPS,
    ConfigSpec,
    build_parser,
    check_ranges,
    config_from_values,
    config_group,
    fields_with,
    flag_errors,
    flag_name,
    group_titles,
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


@dataclass
class Checked:
    """A config whose options say what they must be."""

    count: int = option(2, "count", "data", positive=True)
    rate: float = option(0.5, "rate", "data", non_negative=True)
    seed: int = option(0, "seed", "data", non_negative=True)
    data: str | None = option(None, "data file", "data", path=True)
    model: str | None = option(None, "model directory", "data", path=True)
    steps: int = option(4, "steps", "run", positive=True)
    resume: bool = option(False, "resume", "session")
    threads: int = option(0, "threads", "session", non_negative=True)


def test_options_say_what_they_must_be():
    check_ranges(Checked())  # the defaults are fine; unset paths too
    for bad, message in [
        (Checked(count=0), "--count: expected a positive value, got 0"),
        (Checked(rate=-0.5), "--rate: expected a value >= 0, got -0.5"),
        (Checked(rate=math.nan), "--rate: expected a finite number, got nan"),
        (Checked(data=""), "--data: expected a path, got ''"),
        # positive fields first, then the non-negative ones, then paths, each in field order
        (Checked(seed=-1, steps=0, data=""), "--steps: expected a positive value, got 0"),
        (Checked(seed=-1, data=""), "--seed: expected a value >= 0, got -1"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            check_ranges(bad)
    assert fields_with(Checked, "path") == ["data", "model"]
    with pytest.raises(ValueError, match=r"^key 'config.count': expected a positive value"):
        check_ranges(Checked(count=-3), lambda n: f"key 'config.{n}'")
    with pytest.raises(ValueError, match="--data: expected no NUL character"):
        check_ranges(Checked(data="a\0b"), no_nul=True)
    check_ranges(Checked(data="a\0b"))  # only asked for


def spec(**kwargs) -> ConfigSpec[Checked]:
    def check(config: Checked, name) -> None:
        check_ranges(config, name)
        if config.seed > config.steps:
            raise ValueError(f"{name('seed')}: expected at most {name('steps')}")

    return ConfigSpec(
        Checked, prog="prog", description="d", group_titles=TITLES, check=check,
        fixed_groups=("data",), **kwargs,
    )  # fmt: skip


def test_the_command_line_requires_flags_in_order_and_makes_paths_absolute(capsys, tmp_path):
    flags = spec(required=("model", "data"), stored_groups=("data", "run"))
    for argv, message in [
        ([], "--model: required"),  # the order given, not the fields'
        (["--model", "m"], "--data: required"),
        (["--model", "m", "--data", ""], "--data: expected a path, got ''"),
        (["--model", "m", "--data", "d", "--seed", "9"], "--seed: expected at most --steps"),
        (["--model", "m", "--data", "d", "--threads", str(10**6)], "--threads: expected at most"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            flags.parse_args(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and len(err.splitlines()) == 1
    config, given = flags.parse_args(["--model", "m", "--data", str(tmp_path / "d")])
    assert (config.model, config.data) == (os.path.abspath("m"), str(tmp_path / "d"))
    assert given == {"model", "data"}
    assert flags.parse_args(["--resume"])[0] == Checked(resume=True)  # the checkpoint has them


def test_a_spec_stores_its_groups_and_reads_them_back():
    flags = spec(stored_groups=("data", "run"), added={"model": None})
    config = Checked(count=3, data="/d", model="/m", steps=8, resume=True, threads=1)
    stored = flags.to_json(config)
    assert stored == {"count": 3, "rate": 0.5, "seed": 0, "data": "/d", "model": "/m", "steps": 8}
    file = Path("ck/train_state.json")
    assert flags.from_json(stored, file) == Checked(count=3, data="/d", model="/m", steps=8)
    del stored["model"]  # as a checkpoint written before the setting existed
    assert flags.from_json(stored, file).model is None
    with pytest.raises(TrainingError, match=r"key 'config.seed': expected at most key 'config.st"):
        flags.from_json({**stored, "seed": 9}, file)
    with pytest.raises(TrainingError, match=r"key 'config': missing keys \['count'\]"):
        flags.from_json({k: v for k, v in stored.items() if k != "count"}, file)
    now = Checked(count=3, steps=20, threads=2)
    resumed = flags.resumed(now, {"steps", "threads"}, flags.from_json(stored, file), 8)
    assert resumed == Checked(count=3, data="/d", steps=20, threads=2)
    with pytest.raises(TrainingError, match="--count: the checkpoint was trained with 3, not 4"):
        flags.resumed(Checked(count=4), {"count"}, flags.from_json(stored, file), 8)
    assert "--count COUNT" in flags.build_parser().format_help()


def test_flag_errors_name_the_flag_in_one_line():
    with pytest.raises(TrainingError, match=r"^--model: first line$") as info:
        with flag_errors("--model", OSError, ValueError):
            raise ValueError("first line\nsecond line")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(KeyError), flag_errors("--model", OSError, ValueError):
        raise KeyError("not one of them")
    with flag_errors("--model", ValueError):
        pass  # no error, nothing raised


def test_the_conventional_groups_and_their_titles():
    titles = group_titles()
    assert list(titles) == ["data", "model", "optim", "run", "session"]
    assert set(FIXED_GROUPS) == {"data", "model", "optim"}
    for group in FIXED_GROUPS:
        assert titles[group].endswith("(restored by --resume; a different value is refused)")
    assert titles["run"] == "run (restored by --resume unless given; --steps may extend the run)"
    named = group_titles(model="model and what trains", extend="--steps/--epochs")
    assert named["model"].startswith("model and what trains (restored by --resume")
    assert "; --steps/--epochs may extend the run)" in named["run"]
