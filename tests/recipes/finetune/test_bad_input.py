"""Bad input is found before training: one line naming the file, line and problem, exit 1,
nothing in the output directory lost; --skip-bad-samples and --truncate count what they do."""

import json
import shutil

import pytest

from recipes.finetune import main

LONG = "a" * 300  # longer than the tiny --max-seq-len of 128 tokens


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, ft):
    directory = tmp_path_factory.mktemp("data")
    ft.write_images(directory, 2)
    (directory / "broken.png").write_bytes(b"not a png")
    return directory


def lines(ft) -> dict[str, tuple[str, str]]:
    """Bad line -> (the line, what the message says)."""
    markers = {
        "image": "img0.png",
        "conversations": [
            {"from": "human", "value": "<image><image> hi"},
            {"from": "gpt", "value": "x"},
        ],
    }
    roleless = {"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}
    return {
        "missing image": (json.dumps(ft.hf_record("x", "nope.png")), "nope.png': no such file"),
        "undecodable image": (json.dumps(ft.hf_record("x", "broken.png")), "not an image"),
        "marker count": (json.dumps(markers), "2 image marker(s) '<image>'"),
        "empty line": ("", "empty line"),
        "malformed": ("{not json", "malformed JSON"),
        "role-less": (json.dumps(roleless), "no 'role'"),
        "too long": (json.dumps(ft.hf_record(LONG, "img0.png")), "longer than max_seq_len=128"),
        "no assistant": (
            json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
            "no assistant message",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing image",
        "undecodable image",
        "marker count",
        "empty line",
        "malformed",
        "role-less",
        "too long",
        "no assistant",
    ],
)
def test_bad_lines_are_one_line_naming_file_and_line(
    case, model_dirs, data_dir, ft, tmp_path, capsys
):
    line, problem = lines(ft)[case]
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(ft.hf_record("red fox", "img0.png")) + "\n" + line + "\n")
    # Images are relative to the data file.
    for image in data_dir.iterdir():
        shutil.copy(image, tmp_path / image.name)
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(ft.recipe_args(model_dirs["llava"], data, out, "--steps", "1")) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert f"error: --data: {data}:2: " in err and problem in err
    assert not list((out / "checkpoints").iterdir())


def test_skip_and_truncate_count_what_they_do(model_dirs, data_dir, ft, tmp_path, capsys):
    good = json.dumps(ft.hf_record("red fox", str(data_dir / "img0.png")))
    long = json.dumps(ft.hf_record(LONG, str(data_dir / "img1.png")))
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join([good, "{bad", long, good]) + "\n")
    out = tmp_path / "run"
    argv = ft.recipe_args(model_dirs["llava"], data, out, "--steps", "1", "--skip-bad-samples")
    assert main([*argv, "--truncate"]) == 0
    report = ft.metrics(out)
    assert (report["conversations"], report["skipped"], report["truncated"]) == (3, 1, 1)
    assert f"{data}:2: malformed JSON" in capsys.readouterr().out


def test_a_template_with_no_assistant_turn(model_dirs, ft, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    user_only = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}"
        "{% endfor %}"
    )
    (model / "chat_template.jinja").write_text(user_only)
    data = ft.write_data(tmp_path / "data", images=False)
    capsys.readouterr()
    assert main(ft.recipe_args(model, data, tmp_path / "run", "--steps", "1")) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"{data}:1: " in err
    assert "renders no assistant turn" in err


def test_an_interrupted_run_resumes_and_a_new_run_never_writes_over_it(
    model_dirs, ft, tmp_path, monkeypatch, capsys
):
    from recipes.finetune import trainer

    data = ft.write_data(tmp_path / "data", images=False)
    out = tmp_path / "run"
    argv = ft.recipe_args(model_dirs["llama"], data, out, "--steps", "4", "--checkpoint-every", "2")
    real_step = trainer.train_step

    def interrupted(run, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_step(run, step)

    monkeypatch.setattr(trainer, "train_step", interrupted)
    assert main(argv) == 130
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    assert not (out / "final").exists()
    monkeypatch.setattr(trainer, "train_step", real_step)
    assert main(["--resume", "--output-dir", str(out), "--threads", "1", "--no-progress"]) == 0
    assert len(ft.metrics(out)["losses"]) == 4 and (out / "final" / "config.json").exists()

    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "already holds checkpoints (latest: step_00000004); pass --resume" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--train", "projector"], "--train: 'projector' needs a vision-language --model"),
        (["--max-seq-len", "1024", "--batch-tokens", "1024"], "--max-seq-len: expected at most"),
        (["--lora-targets", "q_proj,qkv"], "--lora-targets: targets: 'qkv' matches no nn.Linear"),
    ],
)
def test_model_problems_are_one_line(extra, message, model_dirs, ft, tmp_path, capsys):
    data = ft.write_data(tmp_path / "data", images=False, count=2)
    argv = ft.recipe_args(model_dirs["llama"], data, tmp_path / "run", "--steps", "1", *extra)
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err


def test_a_missing_model_directory(ft, tmp_path, capsys):
    data = ft.write_data(tmp_path / "data", images=False, count=2)
    capsys.readouterr()
    assert main(ft.recipe_args(tmp_path / "nowhere", data, tmp_path / "run")) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--model: " in err and "nowhere" in err


def test_a_pad_token_outside_the_vocabulary_is_refused_naming_its_source(
    model_dirs, ft, tmp_path, capsys
):
    """The tokenizer knows more tokens than the model embeds: its pad token's id (134 here)
    has no embedding row."""
    from tokenizers import Tokenizer

    model = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], model)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_special_tokens([f"<extra_{i}>" for i in range(20)])
    tokenizer.save(str(model / "tokenizer.json"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["pad_token"] = "<extra_19>"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    found = tokenizer.token_to_id("<extra_19>")
    assert found >= 128  # TEXT_CONFIG's vocab_size
    data = ft.write_data(tmp_path / "data", images=False, count=2)
    capsys.readouterr()
    assert main(ft.recipe_args(model, data, tmp_path / "run", "--steps", "1")) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert (
        f"--model: tokenizer_config.json pad_token '<extra_19>' is id {found} in "
        "tokenizer.json, outside the model's vocabulary [0, 128)"
    ) in err
