"""Our image processors give the ``pixel_values`` of Hugging Face's (their Pillow backend),
on images of several sizes, aspect ratios and modes, built from the same config."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from fusion.preprocessing import ClipImageProcessor, Idefics3ImageProcessor
from vlm_helpers import make_image

# (height, width): wide, tall, square, tiny, extreme, odd
SIZES = [(20, 30), (45, 13), (16, 16), (5, 7), (3, 64), (37, 36)]


def pil_images(channels: int = 3) -> list[Image.Image]:
    images = [Image.fromarray(make_image(h, w, i, channels)) for i, (h, w) in enumerate(SIZES)]
    images[1] = images[1].convert("L") if channels == 3 else images[1]
    return images


def config_of(processor) -> dict:
    """The config as ``preprocessor_config.json`` holds it."""
    return json.loads(processor.to_json_string())


@pytest.mark.parametrize(
    ("cls_name", "settings"),
    [
        (
            "CLIPImageProcessor",
            {"size": {"shortest_edge": 24}, "crop_size": {"height": 20, "width": 20}},
        ),
        ("LlavaImageProcessor", {"size": {"shortest_edge": 16}, "crop_size": 16, "do_pad": True}),
        (
            "CLIPImageProcessor",
            {"size": {"height": 18, "width": 22}, "crop_size": 16, "resample": 2},
        ),
        (
            "CLIPImageProcessor",
            {"do_resize": False, "crop_size": {"height": 32, "width": 24}, "do_normalize": False},
        ),
    ],
    ids=["clip", "llava-pad", "height-width-bilinear", "crop-pads-small-images"],
)
@pytest.mark.parametrize("channels", [3, 4], ids=["rgb+l", "rgba"])
def test_clip_pixel_values(cls_name, settings, channels):
    import transformers

    hf = getattr(transformers, cls_name)(**settings)
    ours = ClipImageProcessor.from_config(config_of(hf))
    images = pil_images(channels)
    theirs = torch.as_tensor(np.array(hf(images)["pixel_values"]))
    mine = ours(images)
    assert mine.shape == theirs.shape and mine.dtype == torch.float32
    assert (mine - theirs).abs().max() <= 1e-5
    assert ours.output_size(20, 30) == tuple(theirs.shape[2:])


@pytest.mark.parametrize(
    "settings",
    [
        {"size": {"longest_edge": 48}, "max_image_size": {"longest_edge": 16}},
        {"size": {"longest_edge": 40}, "max_image_size": {"longest_edge": 16}, "resample": 3},
        {
            "size": {"longest_edge": 48},
            "max_image_size": {"longest_edge": 16},
            "do_image_splitting": False,
        },
    ],
    ids=["split", "split-bicubic-uneven", "whole"],
)
def test_idefics3_tiles(settings):
    from transformers import Idefics3ImageProcessor as HFProcessor

    hf = HFProcessor(**settings)
    ours = Idefics3ImageProcessor.from_config(config_of(hf))
    images = pil_images(4)
    out = hf([[image] for image in images], return_row_col_info=True)
    theirs = torch.as_tensor(np.array(out["pixel_values"]))  # [image, max tiles, 3, s, s]
    tiled = ours(images)
    grids = set()
    for i, mine in enumerate(tiled):
        count = mine.tiles.shape[0]
        assert (mine.rows, mine.cols) == (out["rows"][i][0], out["cols"][i][0])
        assert count == (mine.rows * mine.cols + 1 if mine.rows else 1)
        assert (mine.tiles - theirs[i, :count]).abs().max() <= 1e-5
        assert not theirs[i, count:].any()  # only padding beyond
        grids.add((mine.rows, mine.cols))
    assert len(grids) >= (1 if settings.get("do_image_splitting") is False else 3)


def test_smolvlm_processor_is_the_same():
    from transformers import SmolVLMImageProcessor

    hf = SmolVLMImageProcessor(size={"longest_edge": 32}, max_image_size={"longest_edge": 16})
    ours = Idefics3ImageProcessor.from_config(config_of(hf))
    image = pil_images()[0]
    theirs = torch.as_tensor(np.array(hf([[image]])["pixel_values"]))[0]
    mine = ours([image])[0].tiles
    assert (mine - theirs[: mine.shape[0]]).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("cls", "config", "match"),
    [
        (ClipImageProcessor, {"size": {"longest_edge": 3}}, "size: expected shortest_edge"),
        (ClipImageProcessor, {"crop_size": {"height": 3}}, "crop_size: expected height and width"),
        (ClipImageProcessor, {"resample": 0}, "resample: expected one of"),
        (
            ClipImageProcessor,
            {"image_std": [0.5, 0, 0.5]},
            "image_std: expected three finite positive",
        ),
        (ClipImageProcessor, {"do_pad": "yes"}, "do_pad: expected true or false"),
        (
            Idefics3ImageProcessor,
            {"max_image_size": {"height": 3}},
            "max_image_size: expected longest_edge",
        ),
        (
            Idefics3ImageProcessor,
            {"size": {"longest_edge": -1}},
            r"size.longest_edge: expected a positive",
        ),
    ],
)
def test_bad_configs(cls, config, match):
    with pytest.raises(ValueError, match=match):
        cls.from_config(config)


def test_bad_images_are_named_by_index():
    processor = ClipImageProcessor.for_image_size(16)
    good = torch.zeros(3, 20, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"images\[1\]: expected 8-bit pixels"):
        processor([good, torch.rand(3, 20, 20)])
    with pytest.raises(ValueError, match=r"images\[0\]: Pillow mode 'F' cannot be taken"):
        Idefics3ImageProcessor.for_image_size(16)([Image.new("F", (4, 4))])


@pytest.mark.parametrize("resample", [1, 3])
def test_idefics3_rgb_pillow_images_resized_before_conversion_are_the_same(resample):
    # RGB Pillow images go to Pillow's resize as they are; tensors take the torch path.
    from transformers import Idefics3ImageProcessor as HFProcessor

    settings = {"size": {"longest_edge": 48}, "max_image_size": {"longest_edge": 16}}
    hf = HFProcessor(**settings, resample=resample)
    ours = Idefics3ImageProcessor.from_config(config_of(hf))
    for i, (h, w) in enumerate(SIZES):
        image = Image.fromarray(make_image(h, w, i))
        assert image.mode == "RGB"
        mine = ours.process(image).tiles
        theirs = torch.as_tensor(np.array(hf([[image]])["pixel_values"]))[0, : len(mine)]
        assert torch.equal(mine, theirs), (h, w)
        as_tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
        assert torch.equal(ours.process(as_tensor).tiles, mine), (h, w)
