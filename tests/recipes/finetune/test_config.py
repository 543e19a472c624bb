"""The recipe's command line: every flag listed, bad values refused by name, and what a
resumed run takes from its checkpoint."""

import dataclasses
import os
from pathlib import Path

import pytest

from fusion.training import TrainingError
from recipes.finetune.config import (
    FinetuneConfig,
    config_from_json,
    config_to_json,
    parse_args,
    resumed_config,
)

REQUIRED = ["--model", "m", "--data", "d.jsonl", "--output-dir", "out"]
FLAGS = (
    "--eval-data", "--steps", "--epochs", "--lr", "--batch-tokens", "--max-seq-len",
    "--grad-accum", "--train", "--lora-rank", "--lora-alpha", "--lora-dropout",
    "--lora-targets", "--activation-checkpointing", "--dtype", "--seed", "--checkpoint-every",
    "--resume", "--no-packing", "--truncate", "--skip-bad-samples", "--init-adapter",
)  # fmt: skip


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    missing = [flag for flag in FLAGS if flag not in out]
    assert not missing


def test_flags_fill_the_config():
    config, given = parse_args([*REQUIRED, "--train", "full", "--no-packing", "--lr", "1e-3"])
    assert config.train == "full" and config.packing is False and config.lr == 1e-3
    assert given == {"model", "data", "output_dir", "train", "packing", "lr"}
    # paths are stored absolute, so that --resume works from any working directory
    paths = {"model": "m", "data": "d.jsonl", "output_dir": "out"}
    absolute = {key: os.path.abspath(value) for key, value in paths.items()}
    defaults = dataclasses.replace(FinetuneConfig(), **absolute)
    assert parse_args(REQUIRED)[0] == defaults


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--model: required"),
        (["--model", "m", "--output-dir", "o"], "--data: required"),
        ([*REQUIRED, "--train", "adapter"], "--train: invalid choice"),
        ([*REQUIRED, "--lora-targets", "q_proj,q_proj"], "--lora-targets: expected distinct"),
        ([*REQUIRED, "--lora-targets", ","], "--lora-targets: expected distinct"),
        ([*REQUIRED, "--lora-dropout", "1"], "--lora-dropout: expected a probability"),
        ([*REQUIRED, "--batch-tokens", "64"], "--batch-tokens: expected at least --max-seq-len"),
        ([*REQUIRED, "--grad-accum", "0"], "--grad-accum: expected a positive value, got 0"),
        ([*REQUIRED, "--steps", "0", "--epochs", "0"], "--epochs: expected a positive number"),
        ([*REQUIRED, "--lr", "nan"], "--lr: expected a finite number"),
        ([*REQUIRED, "--train-vision"], "--train-vision: expected --train full"),
        (
            [*REQUIRED, "--train", "full", "--init-adapter", "a"],
            "--init-adapter: expected --train lora",
        ),
        ([*REQUIRED, "--init-adapter", ""], "--init-adapter: expected a path"),
        ([*REQUIRED, "--dtype", "float16"], "--dtype: invalid choice"),
        (
            [*REQUIRED, "--chat-template-kwargs", "{enable_thinking: false}"],
            "--chat-template-kwargs: expected a JSON object (not valid JSON",
        ),
        (
            [*REQUIRED, "--chat-template-kwargs", "[false]"],
            "--chat-template-kwargs: expected a JSON object, got a JSON list",
        ),
        (
            [*REQUIRED, "--chat-template-kwargs", '{"messages": []}'],
            "--chat-template-kwargs: expected template variables (variables: expected names",
        ),
        (["--resume"], "--resume: expected --output-dir"),
    ],
)
def test_bad_flags_exit_2_with_the_flag_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


def test_resume_restores_the_stored_run_and_refuses_changes(tmp_path):
    stored = config_from_json(
        config_to_json(parse_args([*REQUIRED, "--lr", "1e-3", "--steps", "10"])[0]),
        tmp_path / "train_state.json",
    )
    config, given = parse_args(["--resume", "--output-dir", "out", "--steps", "20"])
    resumed = resumed_config(config, given, stored, step=5)
    assert resumed.lr == 1e-3 and resumed.steps == 20 and resumed.model == os.path.abspath("m")
    assert resumed.resume and resumed.output_dir == os.path.abspath("out")

    config, given = parse_args(["--resume", "--output-dir", "out", "--lr", "0.5"])
    with pytest.raises(TrainingError, match=r"--lr: the checkpoint was trained with 0\.001"):
        resumed_config(config, given, stored, step=5)
    config, given = parse_args(["--resume", "--output-dir", "out", "--steps", "3"])
    with pytest.raises(TrainingError, match="--steps: expected at least the checkpoint's step 5"):
        resumed_config(config, given, stored, step=5)


def test_a_stored_config_is_checked_key_by_key(tmp_path):
    file = Path(tmp_path / "train_state.json")
    values = config_to_json(parse_args(REQUIRED)[0])
    with pytest.raises(TrainingError, match=r"key 'config\.lr': expected float, got 'x'"):
        config_from_json({**values, "lr": "x"}, file)
    with pytest.raises(TrainingError, match=r"unknown keys \['evil'\]"):
        config_from_json({**values, "evil": 1}, file)
    with pytest.raises(TrainingError, match=r"key 'config\.lora_rank': expected a positive"):
        config_from_json({**values, "lora_rank": 0}, file)


def test_a_checkpoint_from_before_init_adapter_reads_as_none(tmp_path):
    values = config_to_json(parse_args(REQUIRED)[0])
    del values["init_adapter"]  # as checkpoints written before the flag existed
    del values["chat_template_kwargs"]
    config = config_from_json(values, tmp_path / "train_state.json")
    assert config.init_adapter is None and config.chat_template_kwargs is None


def test_chat_template_kwargs_are_a_json_object_of_template_variables():
    config, _ = parse_args([*REQUIRED, "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert config.template_variables == {"enable_thinking": False}
    assert parse_args(REQUIRED)[0].template_variables == {}
