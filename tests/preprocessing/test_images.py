"""Decoding and colour: every 8-bit Pillow mode ends as the RGB pixels Hugging Face's
processors compute from it; what cannot be taken is refused by name."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from fusion.preprocessing import (
    as_uint8_image,
    from_pil,
    load_image,
    normalize,
    rescale,
    to_rgb,
)
from vlm_helpers import as_tensor, make_image


def hf_rgb(image: Image.Image) -> torch.Tensor:
    from transformers.image_transforms import convert_to_rgb

    return as_tensor(convert_to_rgb(image, return_numpy=True))


def images_of_every_mode() -> dict[str, Image.Image]:
    rgba = Image.fromarray(make_image(9, 13, 0, channels=4))
    rgb = rgba.convert("RGB")
    palette = rgb.quantize(16)
    transparent = palette.copy()
    transparent.info["transparency"] = 3
    return {
        "RGB": rgb,
        "RGBA": rgba,
        "L": rgb.convert("L"),
        "LA": rgba.convert("LA"),
        "P": palette,
        "P+transparency": transparent,
        "1": rgb.convert("1"),
        "CMYK": rgb.convert("CMYK"),
        "YCbCr": rgb.convert("YCbCr"),
    }


@pytest.mark.parametrize("mode", list(images_of_every_mode()))
def test_modes_give_the_rgb_transformers_computes(mode):
    image = images_of_every_mode()[mode]
    tensor = from_pil(image)
    assert tensor.dtype == torch.uint8 and tensor.shape[1:] == (9, 13)
    assert torch.equal(to_rgb(tensor), hf_rgb(image))


def test_alpha_is_composited_over_white_not_dropped():
    rgba = make_image(9, 13, 0, channels=4)
    rgba[0, 0, 3], rgba[0, 1, 3] = 0, 255
    rgb = to_rgb(as_tensor(rgba))
    assert rgb[:, 0, 0].tolist() == [255, 255, 255]
    assert rgb[:, 0, 1].tolist() == rgba[0, 1, :3].tolist()
    assert torch.equal(rgb, hf_rgb(Image.fromarray(rgba)))


@pytest.mark.parametrize("mode", ["I;16", "I", "F"])
def test_wide_modes_are_refused(mode):
    image = Image.fromarray(np.full((4, 5), 300, dtype=np.uint16)).convert(mode)
    with pytest.raises(ValueError, match=f"image: Pillow mode '{mode}' cannot be taken"):
        from_pil(image)


def test_load_image_applies_exif_orientation(tmp_path):
    image = Image.fromarray(make_image(6, 10, 1))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees
    image.save(tmp_path / "rotated.png", exif=exif)
    loaded = load_image(tmp_path / "rotated.png")
    with Image.open(tmp_path / "rotated.png") as opened:
        expected = as_tensor(np.array(ImageOps.exif_transpose(opened)))
    assert loaded.shape == (3, 10, 6) and torch.equal(loaded, expected)
    Image.fromarray(make_image(4, 4, 2, channels=4)).save(tmp_path / "alpha.png")
    assert load_image(tmp_path / "alpha.png").shape == (4, 4, 4)


def test_load_image_errors(tmp_path):
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ValueError, match="not an image Pillow can decode"):
        load_image(tmp_path / "text.png")
    with pytest.raises(ValueError, match=r"missing\.png': no such file"):
        load_image(tmp_path / "missing.png")
    Image.fromarray(np.zeros((4, 4), dtype=np.uint16)).save(tmp_path / "deep.png")
    with pytest.raises(ValueError, match="mode 'I;16' cannot be taken"):
        load_image(tmp_path / "deep.png")


@pytest.mark.parametrize(
    ("image", "error", "match"),
    [
        (torch.rand(3, 4, 4), ValueError, "expected 8-bit pixels"),
        (torch.zeros(2, 4, 4, dtype=torch.uint8), ValueError, r"got shape \[2, 4, 4\]"),
        (torch.zeros(5, 4, 4, dtype=torch.uint8), ValueError, "1, 3 or 4 channels"),
        (torch.zeros(4, 4, dtype=torch.uint8), ValueError, "expected 8-bit pixels"),
        (torch.zeros(3, 0, 4, dtype=torch.uint8), ValueError, "at least one pixel"),
        (np.zeros((4, 4, 3), np.uint8), TypeError, "or a Pillow image, got ndarray"),
    ],
)
def test_tensors_that_cannot_be_taken(image, error, match):
    with pytest.raises(error, match=match):
        as_uint8_image(image)


@pytest.mark.parametrize("normalise", [True, False])
def test_rescale_normalize_in_one_pass_equals_the_two_steps(normalise):
    from fusion.media.images import CLIP_MEAN, CLIP_STD, rescale_normalize

    generator = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (5, 3, 17), dtype=torch.uint8, generator=generator)
    image = image.permute(1, 0, 2)  # [3, 5, 17], not contiguous, as decoded images come
    image[:, 0, :5] = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    mean, std = (CLIP_MEAN, CLIP_STD) if normalise else (None, None)
    fused = rescale_normalize(image, 1 / 255, mean, std)
    expected = rescale(image, 1 / 255)
    if normalise:
        expected = normalize(expected, CLIP_MEAN, CLIP_STD)
    assert fused.dtype == torch.float32 and fused.is_contiguous()
    assert torch.equal(fused, expected)  # the same bits, not only close
    batch = torch.full((2, 3, 5, 17), float("nan"))
    assert (
        rescale_normalize(image, 1 / 255, mean, std, out=batch[1]).data_ptr() == batch[1].data_ptr()
    )
    assert torch.equal(batch[1], expected) and batch[0].isnan().all()
