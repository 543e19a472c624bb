"""Gemma 3's image processor and image text against transformers 5.24's
``Gemma3ImageProcessorPil`` and ``Gemma3Processor``: pixels bit for bit and crop counts equal,
pan-and-scan off and on, on images of odd sizes and modes; the prompt's ids equal the
processor's."""

import string

import numpy as np
import pytest
import torch
from PIL import Image

from fusion.families.gemma3.images import (
    END_OF_IMAGE,
    IMAGE_SOFT_TOKEN,
    START_OF_IMAGE,
    Gemma3ImageProcessor,
    Gemma3Processor,
    gemma3_image_text,
)

SIZE = 32  # the tower's square, small for speed (the published models: 896)
# (height, width): square, slightly wide, wide, tall, too short to crop, odd sides
SHAPES = [(40, 40), (50, 59), (300, 900), (1100, 400), (200, 700), (301, 997)]


def hf_image_processor(**settings):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE}, **settings)


PAN_AND_SCAN = {
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


def image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


@pytest.mark.parametrize("pan_and_scan", [False, True])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_pixels_and_crops_equal_transformers(pan_and_scan, mode):
    images = [image(h, w, mode, seed=i) for i, (h, w) in enumerate(SHAPES)]
    theirs = hf_image_processor(do_pan_and_scan=pan_and_scan, **PAN_AND_SCAN)(
        images, return_tensors="pt"
    )
    ours = Gemma3ImageProcessor(height=SIZE, width=SIZE, do_pan_and_scan=pan_and_scan)
    pixels, crops = ours(images)
    assert crops == theirs["num_crops"].tolist()
    assert pixels.dtype == theirs["pixel_values"].dtype
    assert torch.equal(pixels, theirs["pixel_values"])
    if pan_and_scan:  # the wide, tall and odd ones are cut; the square, barely wide and
        # too short (200 rows: crops under the 256-pixel minimum) ones are not
        assert [count > 0 for count in crops] == [False, False, True, True, False, True]
        for (height, width), count in zip(SHAPES, crops, strict=True):
            assert len(ours.crop_boxes(height, width)) == count
            assert len(ours.output_sizes(height, width)) == 1 + count


def test_from_a_published_config_with_null_pan_and_scan_settings():
    """The published preprocessor_config.json leaves the pan-and-scan settings null; the
    processor's defaults fill them, as Gemma3Processor passes them."""
    config = {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": SIZE, "width": SIZE},
        "resample": 2,
        "do_pan_and_scan": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 0.00392156862745098,
    }
    ours = Gemma3ImageProcessor.from_config(config)
    assert not ours.do_pan_and_scan and ours.pan_and_scan_max_num_crops == 4
    on = Gemma3ImageProcessor.from_config(config | {"do_pan_and_scan": True})
    wide = image(300, 900)
    theirs = hf_image_processor(do_pan_and_scan=True, **PAN_AND_SCAN)([wide], return_tensors="pt")
    assert torch.equal(on([wide])[0], theirs["pixel_values"])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("size", {"shortest_edge": 32}, "expected height and width"),
        ("pan_and_scan_max_num_crops", 1, r"an integer in \[2, 2\*\*31\)"),
        ("pan_and_scan_min_crop_size", 0, r"an integer in \[1, 2\*\*31\)"),
        ("pan_and_scan_min_ratio_to_activate", "x", "expected a finite number > 0"),
        ("do_pan_and_scan", "yes", "true or false"),
    ],
)
def test_bad_settings_are_refused_by_key(key, value, message):
    config = {"size": {"height": SIZE, "width": SIZE}, key: value}
    with pytest.raises(ValueError, match=rf"{key}.*{message}|{message}.*{key}"):
        Gemma3ImageProcessor.from_config(config, "preprocessor_config.json")


def test_images_past_the_pixel_bound_are_refused_before_work():
    ours = Gemma3ImageProcessor(height=SIZE, width=SIZE, max_pixels=100 * 100)
    with pytest.raises(ValueError, match=r"images\[1\]"):
        ours([image(40, 40), image(101, 100)])
    pixels, crops = ours([])
    assert pixels.shape == (0, 3, SIZE, SIZE) and crops == []


def tiny_gemma3_tokenizer():
    """A character-level tokenizer carrying Gemma 3's image markers as transformers' Gemma 3
    tokenizer does (``boi_token``, ``eoi_token``, ``image_token``)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", START_OF_IMAGE, END_OF_IMAGE, IMAGE_SOFT_TOKEN]
    vocab = {token: i for i, token in enumerate(specials + list(string.printable))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in specials])
    markers = {"boi_token": START_OF_IMAGE, "eoi_token": END_OF_IMAGE}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens=markers | {"image_token": IMAGE_SOFT_TOKEN},
    )


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_image_text_gives_the_processor_s_ids(pan_and_scan):
    from transformers import Gemma3Processor

    rows = 4
    tokenizer = tiny_gemma3_tokenizer()
    settings = {"do_pan_and_scan": pan_and_scan, **PAN_AND_SCAN}
    processor = Gemma3Processor(hf_image_processor(), tokenizer, image_seq_length=rows)
    images = [image(300, 900), image(40, 40, seed=1)]
    prompt = f"Look {START_OF_IMAGE} and {START_OF_IMAGE} now"
    theirs = processor(text=[prompt], images=[images], return_tensors="pt", **settings)
    _, crops = Gemma3ImageProcessor(height=SIZE, width=SIZE, do_pan_and_scan=pan_and_scan)(images)
    head, middle, tail = prompt.split(START_OF_IMAGE)
    text = head + gemma3_image_text(rows, crops[0]) + middle + gemma3_image_text(rows, crops[1])
    ours = tokenizer(text + tail)["input_ids"]
    assert ours == theirs["input_ids"][0].tolist()
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_SOFT_TOKEN)
    assert ours.count(image_id) == rows * (2 + sum(crops))
    assert (sum(crops) > 0) == pan_and_scan


# ------------------------------------------------------------------ the processor of a model


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "pan-and-scan"])
def gemma3_dir(request, tmp_path_factory):
    from gemma3_helpers import write_gemma3_dir

    root = tmp_path_factory.mktemp("gemma3")
    return write_gemma3_dir(root / "model", pan_and_scan=request.param), request.param


def test_the_processor_of_a_directory_gives_transformers_ids_pixels_and_logits(gemma3_dir):
    """``VisionLanguageProcessor.from_directory`` on a directory transformers saved: ids and
    pixels equal ``Gemma3Processor``'s, and the model's logits on them equal transformers'
    with its ``token_type_ids``. Pan-and-scan follows the directory's image processor
    settings; transformers' processor applies its own defaults over them (off), so it is
    given them at its call, the one way it takes them."""
    from fusion.checkpoint import load_hf_model
    from fusion.preprocessing import VisionLanguageProcessor
    from gemma3_helpers import hf_gemma3_processor, pan_and_scan_settings, tiny_hf_gemma3

    directory, pan_and_scan = gemma3_dir
    ours = VisionLanguageProcessor.from_directory(directory)
    assert isinstance(ours, Gemma3Processor)
    images = [image(40, 100, seed=1), image(32, 32, seed=2)]
    prompt = f"Look {START_OF_IMAGE} then {START_OF_IMAGE} ok"
    processor = hf_gemma3_processor(pan_and_scan=pan_and_scan)
    settings = pan_and_scan_settings() if pan_and_scan else {}
    theirs = processor(text=[prompt], images=[images], return_tensors="pt", **settings)
    if pan_and_scan:  # its saved settings alone: no crops
        plain = processor(text=[prompt], images=[images], return_tensors="pt")
        assert len(plain["pixel_values"]) == len(images)
    inputs = ours(prompt, images)
    assert inputs.ids == theirs["input_ids"].tolist()
    assert torch.equal(inputs.pixel_values, theirs["pixel_values"])
    assert (len(inputs.pixel_values) > 2) == pan_and_scan  # the wide image's crops
    tokens = torch.tensor(inputs.ids)
    model, hf = load_hf_model(directory).eval(), tiny_hf_gemma3()
    with torch.no_grad():
        expected = hf(**theirs).logits
        got = model(tokens, encoder_input=inputs.encoder_input())
    assert (got - expected).abs().max() <= 1e-4


def test_a_processor_config_at_odds_with_the_model_is_refused(gemma3_dir, tmp_path):
    import json
    import shutil

    from fusion.checkpoint import CheckpointError
    from fusion.preprocessing import VisionLanguageProcessor

    directory, _ = gemma3_dir
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    config_file = copy / "processor_config.json"
    config = json.loads(config_file.read_text())
    config["image_seq_length"] = 9
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"image_seq_length.*9, but the model gives 16"):
        VisionLanguageProcessor.from_directory(copy)
    config["image_seq_length"] = 16
    config["image_processor"]["size"] = {"height": 64, "width": 64}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"size: gives images of 64 x 64 pixels.* takes 32 x 32"):
        VisionLanguageProcessor.from_directory(copy)
