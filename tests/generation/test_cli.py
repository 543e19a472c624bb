"""The command line, on a tiny Llama saved by ``transformers`` and checked against it."""

import io
import json
import shutil
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM

from fusion.generation.cli import main
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


def test_errors(tmp_path, model_dir, capsys):
    directory, _ = model_dir
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(directory), "--prompt", "hello"])
    assert exit_info.value.code == 2 and "--prompt-ids" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(directory), "--prompt-ids", "1,x"])
    assert exit_info.value.code == 2 and "comma-separated integers" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path), "--prompt-ids", "1,2"]) == 1
    assert "config.json" in capsys.readouterr().err
    assert main(["--checkpoint", str(directory), "--prompt-ids", "1,2", "--top-p", "2"]) == 1
    assert "top_p" in capsys.readouterr().err
