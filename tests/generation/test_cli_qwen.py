"""``python -m fusion.generation --image`` on Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5
directories as the Hub carries them: the prompts' ids are transformers' processor's
(``Qwen3VLProcessor``...), and the greedy tokens (``--print-ids``, and as text) are
transformers' ``generate``'s on the same inputs, for one prompt and for a left-padded batch of
prompts with one and two images."""

import io
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from fusion.families import FAMILIES
from fusion.generation.cli import main
from qwen3_helpers import write_qwen3_5_dir, write_qwen3_dir
from qwen_helpers import PAD, write_qwen_dir
from vlm_helpers import QWEN_IMAGE_MARKER, without_torchvision_video

NEW = 6
PROMPTS = [
    f"{QWEN_IMAGE_MARKER}Describe.",
    f"<|im_start|>user\n{QWEN_IMAGE_MARKER}and {QWEN_IMAGE_MARKER}?<|im_end|>\n",
]
SIZES = [(90, 70), (40, 60), (50, 130)]  # (height, width): odd sizes, a few rows each
PROCESSORS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_5": "Qwen3VLProcessor",
}


@pytest.fixture(scope="module", params=list(PROCESSORS))
def qwen(request, tmp_path_factory):
    """A directory, its image files, and transformers' model and processor of it."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_type = request.param
    directory = tmp_path_factory.mktemp(model_type) / model_type
    if model_type == "qwen3_vl":
        write_qwen3_dir(directory, seed=5)
    elif model_type == "qwen3_5":
        write_qwen3_5_dir(directory, seed=5)
    else:
        write_qwen_dir(directory, model_type, seed=5)
    files = []
    for i, (height, width) in enumerate(SIZES):
        pixels = np.random.default_rng(i).integers(0, 256, (height, width, 3), dtype=np.uint8)
        files.append(directory / f"photo{i}.png")
        Image.fromarray(pixels).save(files[-1])
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        without_torchvision_video(patch)
        warnings.simplefilter("ignore")  # torchvision is missing: the Pillow backend
        processor = AutoProcessor.from_pretrained(directory)
    assert type(processor).__name__ == PROCESSORS[model_type]
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(directory).eval()
    return directory, files, model, processor


def transformers_greedy(model, processor, prompts, files) -> tuple[list[list[int]], torch.Tensor]:
    """Each prompt's ids (unpadded) and transformers' greedy new tokens [b, NEW]."""
    images = [Image.open(file) for file in files]
    inputs = processor(text=prompts, images=images, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=None
        )
    ids = [
        row[mask.bool()].tolist()
        for row, mask in zip(inputs["input_ids"], inputs["attention_mask"], strict=True)
    ]
    return ids, out[:, inputs["input_ids"].size(1) :]


def cli(directory, prompts, files, *extra) -> str:
    argv = ["--checkpoint", str(directory), "--max-new-tokens", str(NEW), "--temperature", "0"]
    argv += ["--ignore-eos", *extra]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    for file in files:
        argv += ["--image", str(file)]
    out = io.StringIO()
    assert main(argv, out=out) == 0
    return out.getvalue()


@pytest.mark.parametrize("batch", ["one", "padded"])
def test_ids_and_text_equal_transformers(qwen, batch):
    directory, files, model, processor = qwen
    prompts, files = (PROMPTS[:1], files[:1]) if batch == "one" else (PROMPTS, files)
    expected_ids, expected_new = transformers_greedy(model, processor, prompts, files)
    printed = cli(directory, prompts, files, "--print-ids").splitlines()
    lines = [json.loads(line) for line in printed]
    assert [line["prompt_ids"] for line in lines] == expected_ids
    assert [line["new_ids"] for line in lines] == expected_new.tolist()
    assert len(set(expected_new[0].tolist())) > 1  # not one token over and over
    # As text: one line per prompt, the new tokens decoded.
    expected = [processor.tokenizer.decode(row, skip_special_tokens=True) for row in expected_new]
    assert cli(directory, prompts, files).splitlines() == expected


def test_the_help_names_qwen_s_image_marker(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"{QWEN_IMAGE_MARKER} for qwen2_vl, qwen2_5_vl, " in help_text
    assert "<image> for llava, idefics3, smolvlm;" in help_text
    for family in FAMILIES:  # the registry's model types, text-only ones too
        assert all(model_type in help_text for model_type in family.model_types)
