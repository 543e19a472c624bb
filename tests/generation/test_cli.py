"""The command line, on a tiny Llama saved by ``transformers`` and checked against it."""

import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM

from fusion.generation import generate_stream
from fusion.generation.cli import _print, main
from helpers import HF_VOCAB as VOCAB
from helpers import tiny_hf_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random untied Llama, saved with ``save_pretrained``, and the model itself (the oracle)."""
    model = tiny_hf_llama(
        tied=False,
        initializer_range=0.3,
        randomize_norms=False,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        eos_token_id=2,
    )
    directory = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(directory)
    return directory, model


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by full recomputation with the ``transformers`` model."""
    sequence = torch.tensor([prompt])
    for _ in range(steps):
        with torch.no_grad():
            logits = model(sequence).logits[:, -1]
        sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
    return sequence[0, len(prompt) :].tolist()


def run(*argv: str) -> str:
    out = io.StringIO()
    assert main(list(argv), out=out) == 0
    return out.getvalue()


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    usage = capsys.readouterr().out
    assert exit_info.value.code == 0 and usage.startswith("usage: python -m fusion.generation")
    assert "--checkpoint" in usage and "--prompt-ids" in usage
    assert "default: 32" in usage  # --max-new-tokens says its default


def test_one_prompt_end_to_end(model_dir):
    # The only subprocess (importing torch takes seconds): `python -m fusion.generation`.
    directory, model = model_dir
    command = [sys.executable, "-m", "fusion.generation", "--checkpoint", str(directory)]
    command += ["--prompt-ids", "5,6,7", "--temperature", "0", "--max-new-tokens", "8"]
    result = subprocess.run([*command, "--ignore-eos"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ",".join(map(str, hf_greedy(model, [5, 6, 7], 8))) + "\n"


def test_several_prompts(model_dir):
    directory, model = model_dir
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]
    argv = ["--checkpoint", str(directory), "--temperature", "0", "--max-new-tokens", "6"]
    for prompt in prompts:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    lines = run(*argv, "--ignore-eos").splitlines()
    assert lines == [",".join(map(str, hf_greedy(model, p, 6))) for p in prompts]


def test_stops_at_the_configs_eos(tmp_path, model_dir):
    directory, model = model_dir
    expected = hf_greedy(model, [5, 6, 7], 10)
    eos = expected[3]
    shutil.copytree(directory, tmp_path / "m")
    generation_config = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [eos, VOCAB - 1]
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(generation_config))
    argv = ["--checkpoint", str(tmp_path / "m"), "--prompt-ids", "5,6,7", "--temperature", "0"]
    output = run(*argv, "--max-new-tokens", "10")
    assert output == ",".join(map(str, expected[: expected.index(eos) + 1])) + "\n"


def test_compile(model_dir, monkeypatch):
    """``--compile`` compiles the generation (here with dynamo's eager backend: the same graphs,
    without inductor's minute of C++ compilation)."""
    import fusion.generation.cli as cli

    calls = []

    def recorded(*args, **kwargs):
        calls.append(kwargs["compile"])
        return generate_stream(*args, **(kwargs | {"compile": {"backend": "eager"}}))

    monkeypatch.setattr(cli, "generate_stream", recorded)
    directory, model = model_dir
    argv = ["--checkpoint", str(directory), "--prompt-ids", "5,6,7", "--temperature", "0"]
    output = run(*argv, "--max-new-tokens", "6", "--ignore-eos", "--compile")
    assert calls == [True]
    assert output == ",".join(map(str, hf_greedy(model, [5, 6, 7], 6))) + "\n"


def test_steps_after_the_stop_print_nothing():
    # A stream may run a few steps past the last stop (it looks every few steps): those steps
    # hold pad ids only and must not print anything.
    steps = [torch.tensor([t]) for t in (7, 9, 2, 0, 0)]
    out = io.StringIO()
    _print(iter(steps), 1, (2,), None, out)
    assert out.getvalue() == "7,9,2\n"
    out = io.StringIO()
    _print(
        iter([torch.tensor([4, 2]), torch.tensor([2, 5]), torch.tensor([0, 2])]), 2, (2,), None, out
    )
    assert out.getvalue() == "4,2\n2\n"


def test_sampling_is_seeded(model_dir):
    directory, _ = model_dir
    argv = ["--checkpoint", str(directory), "--prompt-ids", "5,6,7", "--max-new-tokens", "12"]
    argv += ["--ignore-eos", "--top-k", "40", "--top-p", "0.9"]
    assert run(*argv, "--seed", "3") == run(*argv, "--seed", "3")
    assert run(*argv, "--seed", "3") != run(*argv, "--seed", "4")


def test_text_prompts_with_a_tokenizer(tmp_path, model_dir):
    directory, model = model_dir
    shutil.copytree(directory, tmp_path / "m")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "m" / "tokenizer.json"))
    argv = ["--checkpoint", str(tmp_path / "m"), "--temperature", "0", "--max-new-tokens", "5"]
    expected = hf_greedy(model, [5, 6, 7], 5)
    output = run(*argv, "--prompt", "w5 w6 w7", "--ignore-eos")
    assert output == tokenizer.decode(expected) + "\n"
    output = run(*argv, "--prompt", "w5 w6 w7", "--prompt", "w9", "--ignore-eos")
    second = hf_greedy(model, [9], 5)
    assert output.splitlines() == [tokenizer.decode(expected), tokenizer.decode(second)]


def fail(capsys, *argv: str) -> str:
    """Run the command line, expecting an error: a non-zero status and exactly one line on
    stderr (no traceback, no usage dump); returns that line."""
    try:
        status = main(list(argv), out=io.StringIO())
    except SystemExit as exit_info:
        status = exit_info.code
    err = capsys.readouterr().err
    assert status not in (0, None), err
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    return err


def test_usage_errors_are_one_line(model_dir, capsys):
    directory, _ = model_dir
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(directory), "--prompt", "hello"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--prompt-ids" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(directory), "--prompt-ids", "1,x"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "comma-separated integers" in err
    assert err.count("\n") == 1


# (arguments after --checkpoint DIR, what the one line must say); every run fails before the
# weights are loaded, except where noted.
BAD_ARGUMENTS = [
    (["--prompt-ids", "5,x"], "--prompt-ids: expected comma-separated integers"),
    (["--prompt-ids", ""], "--prompt-ids: expected comma-separated integers"),
    (["--prompt-ids", "5,-1"], "--prompt-ids: expected ids >= 0"),
    (["--prompt-ids", f"5,{VOCAB}"], rf"--prompt-ids: ids \[{VOCAB}\] are outside"),
    (["--prompt-ids", "5," + "9" * 30], "--prompt-ids: ids .* are outside"),
    (["--prompt-ids", "0,5"], "starts with pad_id=0"),
    (["--prompt-ids", "5", "--pad-id", "-1"], "--pad-id: expected an integer >= 0"),
    (["--prompt-ids", "5", "--pad-id", str(VOCAB)], "--pad-id: ids .* are outside"),
    (["--prompt-ids", "5", "--stop-token", str(VOCAB)], "--stop-token: ids .* are outside"),
    (["--prompt-ids", "5", "--stop-token", "x"], "--stop-token: expected an integer"),
    (["--prompt-ids", "5", "--dtype", "int8"], "--dtype: invalid choice"),
    (["--prompt-ids", "5", "--device", "nonsense"], "--device: expected a device"),
    (["--prompt-ids", "5", "--device", "cuda:7"], "--device: device cuda:7 is not available"),
    (["--prompt-ids", "5", "--device", "meta"], "--device: the meta device holds no data"),
    (["--prompt-ids", "5", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1"),
    (["--prompt-ids", "5", "--max-new-tokens", "-3"], "--max-new-tokens: expected an integer"),
    (["--prompt-ids", "5", "--max-new-tokens", "2.5"], "--max-new-tokens: expected an integer"),
    (["--prompt-ids", "5", "--max-new-tokens", "200"], "--max-new-tokens: .* needs 200 positions"),
    (["--prompt-ids", "5", "--max-seq-len", "0"], "--max-seq-len: expected an integer >= 1"),
    (
        ["--prompt-ids", "5,6,7", "--max-seq-len", "4"],
        "needs 34 positions, more than the model's 4",
    ),
    (["--prompt-ids", "5", "--temperature", "nan"], "--temperature: expected a finite number"),
    (["--prompt-ids", "5", "--temperature", "-1"], "--temperature: expected a finite number"),
    (["--prompt-ids", "5", "--top-k", "0"], "--top-k: expected an integer >= 1"),
    (["--prompt-ids", "5", "--top-k", str(VOCAB + 1)], rf"top_k: expected .* \[1, {VOCAB}\]"),
    (["--prompt-ids", "5", "--top-p", "2"], r"--top-p: expected a number in \(0, 1\]"),
    (["--prompt-ids", "5", "--top-p", "inf"], r"--top-p: expected a number in \(0, 1\]"),
    (["--prompt-ids", "5", "--seed", str(2**64)], "--seed: expected an integer in"),
    (["--prompt-ids", "5", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize(
    ("extra", "match"), BAD_ARGUMENTS, ids=[" ".join(extra) for extra, _ in BAD_ARGUMENTS]
)
def test_bad_arguments(model_dir, capsys, extra, match):
    if "cuda:7" in extra and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    directory, _ = model_dir
    assert re.search(match, fail(capsys, "--checkpoint", str(directory), *extra))


@pytest.mark.parametrize("prompt", [["--prompt", "w5 w6"], ["--prompt-ids", "5,6"]])
def test_a_mistyped_checkpoint_directory(tmp_path, capsys, prompt):
    missing = tmp_path / "no_such_model"
    err = fail(capsys, "--checkpoint", str(missing), *prompt)
    assert f"--checkpoint: {missing} does not exist" in err
    (tmp_path / "a_file").write_text("{}")
    err = fail(capsys, "--checkpoint", str(tmp_path / "a_file"), *prompt)
    assert "is not a directory" in err
    err = fail(capsys, "--checkpoint", str(tmp_path), *prompt)  # a directory, not a model
    assert "config.json: missing" in err


@pytest.fixture
def copy_of(tmp_path, model_dir):
    shutil.copytree(model_dir[0], tmp_path / "m")
    return tmp_path / "m"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"eos_token_id": "2"}', "generation_config.json, key 'eos_token_id': expected an id"),
        ('{"eos_token_id": [2, 1.5]}', "key 'eos_token_id': expected an id"),
        ('{"eos_token_id": true}', "key 'eos_token_id': expected an id"),
        ('{"pad_token_id": -1}', "key 'pad_token_id': expected an id"),
        ('{"eos_token_id": 1' + "0" * 5000 + "}", "generation_config.json: unreadable"),
        ("[" * 100_000 + "]" * 100_000, "generation_config.json: unreadable"),
        ("[1, 2]", "generation_config.json: expected a JSON object"),
        ('{"eos_token_id": 2', "generation_config.json: unreadable"),
        (b"\xff\xfe{}", "generation_config.json: unreadable"),
        ('{"eos_token_id": 9999}', "eos_token_id of the config: ids .* are outside"),
    ],
    ids=[
        "eos-string",
        "eos-float",
        "eos-bool",
        "pad-negative",
        "5000-digits",
        "deep-nesting",
        "not-an-object",
        "truncated",
        "not-utf8",
        "eos-outside-vocabulary",
    ],
)
def test_bad_generation_config(copy_of, capsys, content, match):
    file = copy_of / "generation_config.json"
    file.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert re.search(match, fail(capsys, "--checkpoint", str(copy_of), "--prompt-ids", "5"))


def test_special_files_are_not_read(copy_of, capsys):
    (copy_of / "generation_config.json").unlink()
    os.mkfifo(copy_of / "generation_config.json")  # reading it would wait for a writer
    err = fail(capsys, "--checkpoint", str(copy_of), "--prompt-ids", "5")
    assert "generation_config.json: not a regular file" in err
    (copy_of / "generation_config.json").unlink()
    (copy_of / "config.json").unlink()
    (copy_of / "config.json").symlink_to("/dev/zero")  # endless
    err = fail(capsys, "--checkpoint", str(copy_of), "--prompt-ids", "5")
    assert "config.json: not a regular file" in err


def test_a_corrupt_tokenizer(copy_of, capsys):
    (copy_of / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    err = fail(capsys, "--checkpoint", str(copy_of), "--prompt", "w5")
    assert "tokenizer.json: unreadable tokenizer" in err


@pytest.mark.parametrize("planted_in", ["tokenizer_config.json", "config.json"])
def test_code_in_the_checkpoint_is_never_run_nor_offered(
    copy_of, tmp_path, capsys, planted_in, monkeypatch
):
    """A directory whose config maps the tokenizer to its own Python file: transformers would
    ask on stdin whether to run it; answering "y" would run it. It is refused without asking."""
    marker = tmp_path / "code_ran"
    (copy_of / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class PlantedTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    auto_map = {"AutoTokenizer": ["planted.PlantedTokenizer", "planted.PlantedTokenizer"]}
    file = copy_of / planted_in
    content = json.loads(file.read_text()) if file.exists() else {}
    content["auto_map"] = auto_map | (
        {"AutoConfig": "planted.PlantedConfig"} if planted_in == "config.json" else {}
    )
    if planted_in == "tokenizer_config.json":
        content["tokenizer_class"] = "PlantedTokenizer"
    else:  # without a model type, transformers has no code of its own for the config: it asks
        content.pop("model_type", None)
    file.write_text(json.dumps(content))
    # Where transformers copies code it runs: not the user's home, should this test fail.
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    stdin = io.StringIO("y\ny\ny\n")
    monkeypatch.setattr(sys, "stdin", stdin)
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(copy_of), "--prompt", "w5 w6", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert not marker.exists(), "the checkpoint's code ran"
    assert stdin.tell() == 0, "stdin was read"
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "--prompt: text needs a tokenizer" in err


def test_help_is_not_an_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().err == ""
