"""What a recipe's command line does around its loop, on a config of its own: the start of a
run (new or resumed), checkpoints against what their config builds, the end of a step, and
one-line errors with an exit status."""

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fusion.training import (
    Runtime,
    TrainingError,
    agree_on_start,
    check_batch_split,
    check_config_model,
    check_optimizer_state,
    compare_plain_decoder,
    load_train_state,
    optimizer_step,
    plan_start,
    resume_checkpoint,
    run_job,
    run_recipe,
    safe_dcp,
    save_checkpoint,
    save_step,
    warmup_cosine,
)
from fusion.training.config import build_parser as config_parser
from fusion.training.config import check_argv, option, parse_args, positive_int
from helpers import VOCAB, build_tiny_decoder

ONE = Runtime(0, 1, 0, torch.device("cpu"), distributed=False)
TITLES = {"data": "data", "run": "run", "session": "session"}


@dataclass
class Config:
    seed: int = option(0, "seed", "data")
    steps: int = option(4, "steps", "run")
    output_dir: str | None = option(None, "output", "session")
    resume: bool = option(False, "resume", "session")
    threads: int = option(0, "threads", "session")


def check(config: Config, name=None) -> None:
    if config.steps < 1:
        raise ValueError(f"--steps: expected a positive value, got {config.steps}")


def inspect(path: Path):
    return load_train_state(path, lambda values, file: Config(**values))


def save(trained, root: Path, step: int, config: Config):
    torch.manual_seed(0)
    model, optimizer, scheduler = trained.build()
    state = trained.state(step, scheduler)
    state.config = config
    return save_step(root, model, optimizer, state, ONE, keep=3)


def plan(config: Config, given=(), output_dir: Path | None = None, **kwargs):
    output_dir = output_dir or Path(config.output_dir)
    return plan_start(
        config, given, output_dir, prog="prog", inspect=inspect, fixed_groups=("data",), **kwargs
    )


def test_a_new_run_and_a_resumed_one(tmp_path, trained, capsys):
    out = tmp_path / "run"
    start = agree_on_start(ONE, lambda: plan(Config(output_dir=str(out))), Config)
    assert (start.config, start.output_dir, start.resume) == (
        Config(output_dir=str(out)),
        out,
        None,
    )
    path = save(trained, out / "checkpoints", 2, Config(steps=4, output_dir=str(out)))
    assert f"saved checkpoint {path} (step 2, loss 1.0000)" in capsys.readouterr().out

    with pytest.raises(TrainingError, match=r"already holds checkpoints \(latest: step_00000002\)"):
        plan(Config(output_dir=str(out)))
    given = Config(output_dir=str(out), resume=True, steps=6)
    start = plan(given, {"output_dir", "resume", "steps"})
    assert start.resume == path and start.config.steps == 6  # run settings given apply
    with pytest.raises(TrainingError, match=r"^--seed: the checkpoint was trained with 0, not 1"):
        plan(Config(seed=1, output_dir=str(out), resume=True), {"seed", "resume"})


def test_prepare_sees_the_checkpoint_and_outputs_mark_a_run(tmp_path, trained):
    out = tmp_path / "run"
    seen = []

    def prepare(config, resume):
        seen.append(resume)
        return Config(**{**vars(config), "steps": 9})

    assert plan(Config(output_dir=str(out)), prepare=prepare).config.steps == 9
    path = save(trained, out / "checkpoints", 1, Config(output_dir=str(out)))
    assert plan(Config(output_dir=str(out), resume=True), prepare=prepare).config.steps == 9
    assert seen == [None, path]
    (tmp_path / "other" / "final").mkdir(parents=True)
    with pytest.raises(TrainingError, match="already holds a final/; pass --resume"):
        plan(Config(output_dir=str(tmp_path / "other")), outputs=("final",))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(TrainingError, match="a-file exists and is not a directory"):
        plan(Config(output_dir=str(tmp_path / "a-file")))


def test_damaged_checkpoints_are_set_aside_with_a_warning(tmp_path, trained, capsys):
    out = tmp_path / "run"
    older = save(trained, out / "checkpoints", 1, Config(output_dir=str(out)))
    newer = save(trained, out / "checkpoints", 2, Config(output_dir=str(out)))
    (newer / "train_state.json").write_text("garbage")
    capsys.readouterr()
    assert plan(Config(output_dir=str(out), resume=True)).resume == older
    [warning] = capsys.readouterr().err.splitlines()
    assert warning.startswith("prog: warning: checkpoint ") and "resuming from the older" in warning
    assert (out / "checkpoints" / "step_00000002.damaged").is_dir()


def test_checkpoints_against_their_config(tmp_path, trained):
    *_, path = trained.saved(tmp_path, step=1)
    checked = safe_dcp.read_metadata(path)
    check_config_model(path, checked, lambda: trained.build()[0], layers=2)
    with pytest.raises(TrainingError, match="config has 1000 layers, but the checkpoint holds"):
        check_config_model(path, checked, lambda: trained.build()[0], layers=1000)

    def refuse():
        raise ValueError("num_heads: expected a divisor")

    with pytest.raises(TrainingError, match="its config builds no model: num_heads: expected"):
        check_config_model(path, checked, refuse, layers=1)
    with pytest.raises(TrainingError, match="its model tensors do not match"):
        check_config_model(path, checked, lambda: nn.Linear(2, 2), layers=1)

    state = load_train_state(path)
    fresh = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1e-2)
    check_optimizer_state(path, state, fresh, torch.optim.lr_scheduler.LambdaLR(fresh, lambda s: 1))
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-2)
    with pytest.raises(TrainingError, match=r"key 'optimizer\.param_groups"):
        check_optimizer_state(path, state, other, warmup_cosine(other, 1, 2))


def test_resuming_says_where_it_resumes(tmp_path, trained, capsys):
    model, _, scheduler, path = trained.saved(tmp_path, step=2)
    fresh, fresh_optimizer, fresh_scheduler = trained.build(seed=1)
    capsys.readouterr()
    state = load_train_state(path)
    resume_checkpoint(path, state, fresh, fresh_optimizer, fresh_scheduler, ONE, total=5)
    assert capsys.readouterr().out == (
        f"resumed from {path} at step 2 of 5 (saved by 1 process(es), now 1)\n"
    )
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    assert fresh_scheduler.state_dict() == scheduler.state_dict()


def test_the_end_of_a_step():
    weight = nn.Parameter(torch.tensor([3.0, 4.0]))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scheduler = warmup_cosine(optimizer, 0, 2)
    (weight.sum() * 2).backward()  # gradient [2, 2], norm 2.83
    loss = optimizer_step(
        ONE, [weight], optimizer, scheduler, grad_clip=1.0, loss_sum=torch.tensor(6.0),
        num_targets=3,
    )  # fmt: skip
    assert loss == 2.0 and weight.grad is None
    assert torch.allclose(weight.detach(), torch.tensor([3.0, 4.0]) - 2**-0.5)
    assert scheduler.last_epoch == 1


def test_one_line_errors_and_exit_statuses(capsys):
    def fails(error):
        def job(runtime):
            raise error

        return job

    assert run_job("prog", "cpu", lambda runtime: 7) == 7
    assert run_job("prog", "cpu", fails(TrainingError("--x: bad\nsecond line"))) == 1
    assert capsys.readouterr().err == "prog: error: --x: bad second line\n"
    assert run_job("prog", "cpu", fails(OSError(28, "No space left on device"))) == 1
    assert capsys.readouterr().err == "prog: error: I/O error: [Errno 28] No space left on device\n"
    assert run_job("prog", "cpu", fails(RuntimeError("can't allocate memory: 1 TB"))) == 1
    assert "prog: error: out of memory: " in capsys.readouterr().err
    assert run_job("prog", "cpu", fails(KeyboardInterrupt())) == 130
    assert "interrupted" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="a bug"):
        run_job("prog", "cpu", fails(RuntimeError("a bug")))  # its traceback is wanted


def test_command_lines(capsys):
    parser = config_parser(Config, prog="prog", description="d", group_titles=TITLES)
    assert parse_args(parser, Config, ["--steps", "3"], check) == (Config(steps=3), {"steps"})
    for argv, message in (
        (["--steps", "0"], "prog: error: --steps: expected a positive value, got 0 (see --help)"),
        (["--threads", "100000"], "prog: error: --threads: expected at most the "),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(parser, Config, argv, check)
        assert exit_info.value.code == 2 and capsys.readouterr().err.startswith(message)
    assert positive_int("3") == 3
    with pytest.raises(Exception, match="expected a positive integer, got 0"):
        positive_int("0")
    check_argv(None)
    check_argv(["--steps", "3"])
    with pytest.raises(TypeError, match=r"^argv: expected None or a list of str, got '--steps 3'"):
        check_argv("--steps 3")


def test_a_recipe_job_starts_trains_and_reports(tmp_path, capsys):
    out = tmp_path / "run"
    flags = SimpleNamespace(device="cpu", threads=1, progress=False)  # the command line's
    seen = []

    def train(runtime, start):
        seen.append((start.config, start.output_dir, start.resume, torch.get_num_threads()))
        return "trained"

    def report(runtime, start, result):
        seen.append(result)
        return 3

    threads = torch.get_num_threads()
    try:
        status = run_recipe(
            "prog", flags, Config, lambda runtime: plan(Config(output_dir=str(out))), train, report
        )
    finally:
        torch.set_num_threads(threads)
    assert status == 3
    assert seen == [(Config(output_dir=str(out)), out, None, 1), "trained"]
    assert f"output directory: {out}" in capsys.readouterr().out

    def refuse(runtime, start):
        raise TrainingError("--x: bad")

    other = Config(output_dir=str(tmp_path / "other"))
    assert run_recipe("prog", flags, Config, lambda runtime: plan(other), refuse, report) == 1
    assert capsys.readouterr().err == "prog: error: --x: bad\n"


class TextOnlyFusion(nn.Module):
    """An early-fusion model as a checkpoint sees it: its decoder under ``decoder.``."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.head = nn.Linear(2, 2)  # an encoder part the plain decoder does not load

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens)


def test_a_checkpoints_decoder_against_a_plain_one(tmp_path, trained):
    fused = TextOnlyFusion(build_tiny_decoder(seed=0))
    optimizer = torch.optim.AdamW(fused.parameters(), lr=1e-2)
    _, _, scheduler = trained.build()
    state = trained.state(1, scheduler)
    path = save_checkpoint(tmp_path, fused, optimizer, state, device=torch.device("cpu"), keep=1)
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    rng = torch.get_rng_state()
    plain = partial(build_tiny_decoder, seed=1)  # other initial values: the checkpoint's load
    assert compare_plain_decoder(path, fused.eval(), plain, tokens) == (True, 0.0)
    assert torch.equal(torch.get_rng_state(), rng)  # building the plain decoder drew nothing

    with torch.no_grad():
        fused.decoder.norm.scale.add_(1.0)  # the live model no longer matches its checkpoint
    equal, max_diff = compare_plain_decoder(path, fused, plain, tokens)
    assert not equal and max_diff > 0
    with pytest.raises(RuntimeError, match="Missing key"):  # the checkpoint holds a tied one
        compare_plain_decoder(path, fused, partial(build_tiny_decoder, False), tokens)


def test_a_global_batch_splits_over_the_processes(tmp_path):
    config = SimpleNamespace(batch_size=6)
    assert check_batch_split(3, config, None) is config
    with pytest.raises(TrainingError, match=r"^--batch-size: expected a multiple of the 4 .* 6$"):
        check_batch_split(4, config, None)
    with pytest.raises(TrainingError, match=r"got 6 \(the batch size of step_00000002\)$"):
        check_batch_split(4, config, tmp_path / "step_00000002")
