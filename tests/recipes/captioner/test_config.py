import pytest

from recipes.captioner import parse_config
from recipes.captioner.config import GROUP_TITLES, TrainConfig, build_parser


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--steps", "--resume", "--output-dir", "--parallel", "--decoder-dim", "--seed"):
        assert flag in out


def test_flags_fill_the_config(job):
    config = parse_config(job.tiny("--steps", "7", "--parallel", "fsdp", "--no-progress"))
    assert config.steps == 7 and config.parallel == "fsdp" and config.progress is False
    assert config.decoder_dim == 16 and config.lr == 1e-2
    assert parse_config([]) == TrainConfig()  # the defaults are the dataclass's


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--steps", "ten"], "--steps: invalid int value"),
        (["--steps", "0"], "--steps: expected a positive value, got 0"),
        (["--image-size", "30"], "--image-size: expected a multiple of --patch-size=8, got 30"),
        (["--decoder-heads", "3"], "--decoder-dim: expected a multiple of --decoder-heads=3"),
        (["--parallel", "zero"], "--parallel: invalid choice"),
        (["--lr", "-1"], "--lr: expected a positive learning rate"),
        (["--resume"], "--resume: expected --output-dir"),
    ],
)
def test_bad_flags_exit_2_with_the_flag_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_groups_partition_the_fields():
    config = TrainConfig()
    names = [n for g in GROUP_TITLES for n in config.group(g)]
    assert sorted(names) == sorted(vars(config))
    assert "decoder_dim" in config.group("model") and "steps" in config.group("run")
    assert {"output_dir", "resume", "device"} <= set(config.group("session"))
    assert build_parser().prog == "python -m recipes.captioner"
