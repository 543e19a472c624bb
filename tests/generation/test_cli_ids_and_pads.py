"""``python -m fusion.generation``: ``--print-ids`` with and without images, ``--max-pixels``,
image errors naming ``--image``, and the pad id of a directory whose ``pad_token_id`` lies
outside the vocabulary (SmolVLM's published config), chosen as transformers chooses it."""

import copy
import io
import json

import pytest
import torch
from PIL import Image

from fusion import generate
from fusion.checkpoint import CheckpointError, load_hf_vlm
from fusion.generation.cli import _generation_config, default_pad_id, main
from fusion.preprocessing import load_image, prepare_inputs
from vlm_helpers import EOS, char_tokenizer, make_image, tiny_hf_idefics3

PROMPTS = ["<image>What is it?", "Say hi"]


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory):
    """A SmolVLM directory as published: config.json's top-level pad_token_id 128002 lies
    outside the vocabulary (128 here), text_config names none, no generation_config.json."""
    directory = tmp_path_factory.mktemp("smolvlm")
    tiny_hf_idefics3(smolvlm=True).save_pretrained(directory)
    (directory / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((directory / "config.json").read_text())
    config["pad_token_id"] = 128_002
    config["text_config"].pop("pad_token_id", None)
    config.pop("_pad_token_id", None)
    (directory / "config.json").write_text(json.dumps(config))
    char_tokenizer().save(str(directory / "tokenizer.json"))
    Image.fromarray(make_image(20, 28)).save(directory / "photo.png")
    return directory


def test_pad_id_outside_the_vocabulary_falls_back_as_transformers(smolvlm_dir):
    from transformers import SmolVLMForConditionalGeneration

    hf = SmolVLMForConditionalGeneration.from_pretrained(smolvlm_dir)
    # transformers reads 128002, which no embedding of 128 rows can take once generation
    # feeds a finished sequence's pad back; an unset pad id falls back to the first EOS id:
    assert hf.generation_config.pad_token_id == 128_002
    unset = copy.deepcopy(hf.generation_config)
    unset.pad_token_id = None
    hf._prepare_special_tokens(unset, device="cpu")
    config = _generation_config(smolvlm_dir)
    with pytest.warns(UserWarning) as said:
        assert default_pad_id(config, 128) == int(unset._pad_token_tensor) == EOS
    assert [str(w.message) for w in said] == [
        f"config.json pad_token_id 128002 lies outside the vocabulary [0, 128): left-padding "
        f"with eos_token_id {EOS} instead (pass --pad-id to choose)"
    ]
    # In the vocabulary, the first named in transformers' order is taken.
    with pytest.warns(UserWarning, match="with config.json text_config.pad_token_id 3 instead"):
        assert default_pad_id(config | {"text_pad_token_id": 3}, 128) == 3
    assert default_pad_id(config | {"pad_token_id": 7, "text_pad_token_id": 3}, 128) == 7
    assert default_pad_id(config | {"generation_pad_token_id": 5}, 128) == 5
    assert default_pad_id({}, 128) == 0


def run_ids(directory, *argv: str) -> list[dict]:
    out = io.StringIO()
    args = ["--checkpoint", str(directory), "--print-ids", "--temperature", "0", *argv]
    assert main([*args, "--max-new-tokens", "4", "--ignore-eos"], out=out) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_print_ids_with_and_without_images(smolvlm_dir):
    photo = smolvlm_dir / "photo.png"
    printed = run_ids(smolvlm_dir, "--image", str(photo), *(f"--prompt={p}" for p in PROMPTS))
    inputs = prepare_inputs(smolvlm_dir, PROMPTS, [load_image(photo)])
    tokens = inputs.tokens(EOS)  # the pad id the command line chose
    model = load_hf_vlm(smolvlm_dir).eval()
    new = generate(
        model,
        tokens,
        encoder_input=inputs.encoder_input(),
        max_new_tokens=4,
        temperature=0,
        pad_id=EOS,
    )[:, tokens.size(1) :]
    assert printed == [
        {"prompt_ids": ids, "new_ids": row}
        for ids, row in zip(inputs.ids, new.tolist(), strict=True)
    ]
    text_only = run_ids(smolvlm_dir, "--prompt", "Say hi")
    assert text_only[0]["prompt_ids"] == char_tokenizer().encode("Say hi").ids
    assert len(text_only) == 1 and len(text_only[0]["new_ids"]) == 4
    ids_only = run_ids(smolvlm_dir, "--prompt-ids", "1,5,6")
    assert ids_only[0]["prompt_ids"] == [1, 5, 6] and len(ids_only[0]["new_ids"]) == 4


def fail(capsys, *argv: str) -> str:
    status = main(list(argv), out=io.StringIO())
    err = capsys.readouterr().err
    assert status == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_image_errors_name_the_flag_and_the_cap(smolvlm_dir, capsys, monkeypatch):
    photo = smolvlm_dir / "photo.png"
    base = ["--checkpoint", str(smolvlm_dir), "--prompt", "<image>hi"]
    err = fail(capsys, *base, "--image", str(smolvlm_dir / "missing.png"))
    assert err.startswith("error: --image: image ") and "missing.png': no such file" in err
    err = fail(capsys, *base, "--image", str(photo), "--max-pixels", "500")
    assert "--image: " in err and "28 x 20 = 560 pixels, more than max_pixels=500" in err
    # Pillow warns between its limit and twice that: the warning never reaches stderr, and
    # our cap (Pillow's limit by default) answers with one line.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300)
    err = fail(capsys, *base, "--image", str(photo))
    assert "560 pixels, more than max_pixels=300" in err
    out = io.StringIO()
    argv = [*base, "--image", str(photo), "--max-pixels", "4000", "--max-new-tokens", "1"]
    assert main(argv, out=out) == 0
    # The only lines on stderr: the pad id passed over and the image processor defaults,
    # each said once, on one line.
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("warning: config.json pad_token_id 128002 lies outside")
    assert len(lines) <= 2 and not any("DecompressionBomb" in line for line in lines)
    assert all(line.startswith("warning: ") and "idefics3 defaults" in line for line in lines[1:])
    with pytest.raises(SystemExit):
        main([*base, "--image", str(photo), "--max-pixels", "0"])
    assert "--max-pixels: expected an integer >= 1" in capsys.readouterr().err


def test_print_ids_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out
    assert "--print-ids" in usage and "--max-pixels" in usage
    assert torch.tensor(0).item() == 0


@pytest.mark.parametrize(
    ("file", "where", "key"),
    [
        ("config.json", (), "pad_token_id"),
        ("config.json", ("text_config",), "text_config.pad_token_id"),
        ("generation_config.json", (), "pad_token_id"),
        ("config.json", (), "eos_token_id"),
    ],
)
def test_an_id_beyond_int64_is_refused_naming_the_file_and_key(
    smolvlm_dir, tmp_path, capsys, file, where, key
):
    import shutil

    directory = tmp_path / "m"
    shutil.copytree(smolvlm_dir, directory)
    path = directory / file
    config = json.loads(path.read_text()) if path.exists() else {}
    section = config
    for name in where:
        section = section[name]
    section[key.rsplit(".", 1)[-1]] = 10**30  # no token: not an id outside the vocabulary
    path.write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=rf"{file}, key '{key}': expected an id in \[0, 2\*\*63\)"
    ):
        _generation_config(directory)
    err = fail(capsys, "--checkpoint", str(directory), "--prompt-ids", "1,5")
    assert f"{file}, key '{key}'" in err and "1000000000000000000000000000000" in err


def test_the_pad_id_passed_over_is_one_line_on_stderr(smolvlm_dir, capsys):
    run_ids(smolvlm_dir, "--prompt-ids", "1,5,6")
    assert capsys.readouterr().err == (
        "warning: config.json pad_token_id 128002 lies outside the vocabulary [0, 128): "
        f"left-padding with eos_token_id {EOS} instead (pass --pad-id to choose)\n"
    )
    run_ids(smolvlm_dir, "--prompt-ids", "1,5,6", "--pad-id", "0")
    assert capsys.readouterr().err == ""
