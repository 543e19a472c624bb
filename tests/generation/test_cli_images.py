"""``python -m fusion.generation --image``: LLaVA and Idefics3 directories from the shell give
what generating from the loaded model in Python gives."""

import io
import json

import pytest
import torch
from PIL import Image

from fusion import generate
from fusion.checkpoint import load_hf_vlm, save_hf_llama
from fusion.generation.cli import main
from fusion.models import llama3_2
from fusion.preprocessing import load_image, prepare_inputs
from vlm_helpers import PAD, char_tokenizer, make_image, tiny_hf_idefics3, tiny_hf_llava

PROMPT = "<image>What is it?"


@pytest.fixture(scope="module", params=["llava", "idefics3"])
def vlm_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = tiny_hf_llava() if request.param == "llava" else tiny_hf_idefics3()
    model.save_pretrained(directory)
    char_tokenizer().save(str(directory / "tokenizer.json"))
    Image.fromarray(make_image(20, 28)).save(directory / "photo.png")
    return directory


def test_an_image_and_a_prompt(vlm_dir):
    photo = vlm_dir / "photo.png"
    out = io.StringIO()
    argv = ["--checkpoint", str(vlm_dir), "--image", str(photo), "--prompt", PROMPT]
    argv += ["--max-new-tokens", "5", "--temperature", "0", "--ignore-eos"]
    assert main(argv, out=out) == 0

    inputs = prepare_inputs(vlm_dir, PROMPT, [load_image(photo)])
    tokens = inputs.tokens(pad_id=PAD)
    model = load_hf_vlm(vlm_dir).eval()
    expected = generate(
        model, tokens, encoder_input=inputs.encoder_input(), max_new_tokens=5, temperature=0
    )[0, tokens.size(1) :]
    text = char_tokenizer().decode(expected.tolist(), skip_special_tokens=True)
    assert out.getvalue() == text + "\n"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--image", "{dir}/broken.png", "--prompt", PROMPT], "not an image"),
        (["--image", "{dir}/missing.png", "--prompt", PROMPT], "missing.png"),
        (["--image", "{dir}/photo.png"] * 2 + ["--prompt", PROMPT], "but 2 image(s) given"),
    ],
)
def test_bad_images_are_one_line(vlm_dir, capsys, argv, match):
    (vlm_dir / "broken.png").write_bytes(b"not a png")
    argv = [a.format(dir=vlm_dir) for a in argv]
    assert main(["--checkpoint", str(vlm_dir), *argv], out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and match in err


def test_images_need_a_text_prompt(vlm_dir, capsys):
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(vlm_dir), "--image", "x.png", "--prompt-ids", "1"])
    assert "--image: images go where <image> markers are" in capsys.readouterr().err


def test_a_llama_takes_no_images(tmp_path, capsys):
    torch.manual_seed(0)
    save_hf_llama(llama3_2(64, 1, 2, 1, 16, 32), tmp_path)
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path), "--image", "x.png", "--prompt", "hi"])
    assert "holds a text-only model (Llama), taking no images" in capsys.readouterr().err


def test_a_text_only_qwen3_5_takes_text_prompts_and_no_images(tmp_path, capsys):
    """A ``qwen3_5_text`` directory is text only too: its prompt is tokenized as text, and the
    tokens are transformers' greedy ones."""
    from transformers import Qwen3_5ForCausalLM

    from qwen3_helpers import write_qwen3_5_text_dir

    directory = write_qwen3_5_text_dir(tmp_path / "qwen3_5_text")
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(directory), "--image", "x.png", "--prompt", "hi"])
    error = capsys.readouterr().err
    assert "holds a text-only model (Qwen3.5 (text only)), taking no images" in error
    out = io.StringIO()
    argv = ["--checkpoint", str(directory), "--prompt", "Hello", "--print-ids"]
    argv += ["--max-new-tokens", "5", "--temperature", "0", "--ignore-eos"]
    assert main(argv, out=out) == 0
    printed = json.loads(out.getvalue())
    ids = torch.tensor([printed["prompt_ids"]])
    hf = Qwen3_5ForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert printed["new_ids"] == theirs[0, ids.size(1) :].tolist()
