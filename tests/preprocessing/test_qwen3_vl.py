"""Qwen3-VL preprocessing: the Qwen2-VL image processor with Qwen3-VL's settings (patch 16,
mean and std 0.5). Patches bitwise transformers' (its Pillow backend) and grids equal, with
the settings as the Hub publishes them and read as transformers 5.24 reads a file; ids from a
model directory equal transformers' ``Qwen3VLProcessor``'s; a directory without settings gets
Qwen3-VL's published ones; the same bounds as Qwen2-VL's."""

import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from fusion.families.qwen_vl.family import QWEN3_VL_SETTINGS
from fusion.families.qwen_vl.processor import read_qwen2_vl_layout
from fusion.preprocessing import (
    Qwen2VLImageProcessor,
    VisionLanguageProcessor,
    detect_model_kind,
    prepare_inputs,
)
from qwen3_helpers import QWEN3_PREPROCESSOR, TEXT_CONFIG, VISION_CONFIG
from vlm_helpers import (
    QWEN_IMAGE_MARKER,
    QWEN_SPECIAL_IDS,
    make_image,
    qwen_char_tokenizer,
    qwen_hf_tokenizer,
    without_torchvision_video,
)

MARKER = QWEN_IMAGE_MARKER
IMAGE_ID = QWEN_SPECIAL_IDS["<|image_pad|>"]
# Qwen/Qwen3-VL-*'s preprocessor_config.json, as published.
HUB_SETTINGS = {
    **QWEN3_PREPROCESSOR,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
}
# (height, width): odd, thin, tiny ones upscaled to 65536 pixels, one above the small range.
SIZES = [(37, 53), (300, 20), (1, 1), (5, 700), (400, 600)]
PROMPTS = [
    f"<|im_start|>user\n{MARKER}What is it?<|im_end|>\n<|im_start|>assistant\n",
    f"Compare {MARKER} and {MARKER}, please.",
    "No image here.",
]


def images(mode: str = "RGB") -> list[Image.Image]:
    out = []
    for i, (h, w) in enumerate(SIZES):
        image = Image.fromarray(make_image(h, w, i, 4 if mode == "RGBA" else 3))
        out.append(image.convert(mode) if mode in ("L", "P") else image)
    return out


def hf_outputs(processor, given) -> tuple[torch.Tensor, torch.Tensor]:
    out = processor(given)
    return (
        torch.from_numpy(np.array(out["pixel_values"])),
        torch.from_numpy(np.array(out["image_grid_thw"])),
    )


def hf_image_processor(settings: dict):
    from transformers import Qwen2VLImageProcessorPil

    settings = {k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}
    return Qwen2VLImageProcessorPil(**json.loads(json.dumps(settings)))  # it edits what it gets


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
@pytest.mark.parametrize("settings", [HUB_SETTINGS, QWEN3_PREPROCESSOR], ids=["hub", "small"])
def test_pixels_bitwise_with_qwen3_settings(settings, mode):
    hf = hf_image_processor(settings)
    given = images(mode)
    pixels, grids = hf_outputs(hf, given)
    ours = Qwen2VLImageProcessor.from_config(settings)
    out = ours(given)
    assert out.pixel_values.shape == (int(grids.prod(1).sum()), 3 * 2 * 16 * 16)
    assert torch.equal(out.image_grid_thw, grids)
    assert torch.equal(out.pixel_values, pixels)
    assert [ours.rows(h, w) for h, w in SIZES] == (grids.prod(1) // 4).tolist()
    if settings is HUB_SETTINGS:  # the tiny images were scaled up to 256 x 256 at least
        assert int(grids[2].prod()) == 256


def write_directory(tmp_path, settings: dict | None = QWEN3_PREPROCESSOR, **vision):
    """``config.json`` as transformers' ``Qwen3VLConfig`` saves it, the tokenizer and (unless
    None) ``preprocessor_config.json`` holding ``settings``."""
    from transformers import Qwen3VLConfig

    directory = tmp_path / "qwen3_vl"
    directory.mkdir(exist_ok=True)
    Qwen3VLConfig(
        text_config=dict(TEXT_CONFIG),
        vision_config=dict(VISION_CONFIG) | vision,
        image_token_id=IMAGE_ID,
        vision_start_token_id=QWEN_SPECIAL_IDS["<|vision_start|>"],
        vision_end_token_id=QWEN_SPECIAL_IDS["<|vision_end|>"],
    ).save_pretrained(directory)
    qwen_hf_tokenizer(qwen_char_tokenizer()).save_pretrained(directory)
    if settings is not None:
        (directory / "preprocessor_config.json").write_text(json.dumps(settings))
    return directory


def hf_processor(directory):
    from transformers import AutoProcessor

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        without_torchvision_video(patch)
        warnings.simplefilter("ignore")  # torchvision is missing: the Pillow backend
        return AutoProcessor.from_pretrained(directory)


def test_ids_pixels_and_grids_equal_qwen3_vl_processor(tmp_path):
    directory = write_directory(tmp_path)
    assert detect_model_kind(directory) == "qwen2_vl"  # the Qwen processor family
    layout = read_qwen2_vl_layout(directory)
    assert (layout.model_type, layout.patch_size, layout.image_token_id) == (
        "qwen3_vl",
        16,
        IMAGE_ID,
    )
    hf = hf_processor(directory)
    assert type(hf).__name__ == "Qwen3VLProcessor"
    given = [images()[0], images("L")[1], images()[4]]
    expected = hf(images=given, text=PROMPTS)
    ours = prepare_inputs(directory, PROMPTS, given)
    assert ours.ids == expected["input_ids"]
    assert torch.equal(ours.pixel_values, torch.from_numpy(np.array(expected["pixel_values"])))
    grids = torch.from_numpy(np.array(expected["image_grid_thw"]))
    assert ours.image_grid_thw is not None and torch.equal(ours.image_grid_thw, grids)
    rows = (grids.prod(1) // 4).tolist()
    assert [row.count(IMAGE_ID) for row in ours.ids] == [rows[0], rows[1] + rows[2], 0]
    for row, types in zip(ours.ids, expected["mm_token_type_ids"], strict=True):
        assert types == [int(t == IMAGE_ID) for t in row]
    image = ours.encoder_input()["image"]
    assert set(image) == {"pixel_values", "image_grid_thw"}
    text_only = prepare_inputs(directory, PROMPTS[2:], [])
    assert text_only.ids == hf(text=PROMPTS[2:])["input_ids"]
    assert text_only.pixel_values.shape == (0, 3 * 2 * 16 * 16) and text_only.encoder_input() == {}


def test_published_settings_without_a_settings_file(tmp_path):
    directory = write_directory(tmp_path, settings=None)
    given = images()[:3]
    with pytest.warns(UserWarning, match="using Qwen3-VL's published settings") as seen:
        first = prepare_inputs(directory, [MARKER * 3], given)
        prepare_inputs(directory, [MARKER], given[:1])
    assert len([w for w in seen if "settings" in str(w.message)]) == 1
    pixels, grids = hf_outputs(hf_image_processor(HUB_SETTINGS), given)
    assert first.image_grid_thw is not None and torch.equal(first.image_grid_thw, grids)
    assert torch.equal(first.pixel_values, pixels)
    processor = VisionLanguageProcessor.from_directory(directory).image_processor
    assert isinstance(processor, Qwen2VLImageProcessor)
    assert (processor.min_pixels, processor.max_pixels) == (65536, 16777216)
    assert processor.image_mean == processor.image_std == QWEN3_VL_SETTINGS["image_mean"]


def test_keys_a_file_omits_are_read_as_transformers_reads_them(tmp_path, monkeypatch):
    # transformers 5.24 gives Qwen3-VL directories Qwen2VLImageProcessor, whose own defaults
    # (CLIP's mean and std, 3136 to 1003520 pixels) fill what the file leaves out.
    settings = {"patch_size": 16, "image_processor_type": "Qwen2VLImageProcessor"}
    directory = write_directory(tmp_path, settings=settings)
    from transformers import AutoImageProcessor

    reference = AutoImageProcessor.from_pretrained(directory)
    given = images()
    pixels, grids = hf_outputs(reference, given)
    ours = prepare_inputs(directory, [MARKER * len(given)], given)
    assert ours.image_grid_thw is not None and torch.equal(ours.image_grid_thw, grids)
    assert torch.equal(ours.pixel_values, pixels)
    # Without patch_size the file would give 14-pixel patches, which the tower cannot take.
    (directory / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3}))
    with pytest.raises(ValueError, match=r"patch_size: 14, but the vision tower \(config.json"):
        VisionLanguageProcessor.from_directory(directory)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (
            {**HUB_SETTINGS, "size": {"shortest_edge": 65536, "longest_edge": 4096 * 4096 + 1}},
            "size.longest_edge: expected at most 16777216 pixels",
        ),
        ({**HUB_SETTINGS, "patch_size": 0}, r"patch_size: expected an integer in \[1, 256\]"),
        ({**HUB_SETTINGS, "image_std": [0.5, 0, 0.5]}, "image_std: expected three finite pos"),
        (
            {**HUB_SETTINGS, "image_processor_type": "CLIPImageProcessor"},
            r"image_processor_type: expected a Qwen2VLImageProcessor \(Qwen2-VL, Qwen2\.5-VL, Qw",
        ),
    ],
)
def test_bad_settings_are_refused_by_name(tmp_path, settings, match):
    directory = write_directory(tmp_path, settings=settings)
    with pytest.raises(ValueError, match=f"preprocessor_config.json: {match}"):
        prepare_inputs(directory, [MARKER], [torch.zeros(3, 32, 32, dtype=torch.uint8)])


def test_bad_images_and_prompts_and_caps(tmp_path):
    directory = write_directory(tmp_path)
    processor = VisionLanguageProcessor.from_directory(directory, max_image_rows=10)
    image = torch.zeros(3, 64, 96, dtype=torch.uint8)  # 6 rows
    with pytest.raises(ValueError, match=r"prompts\[0\]: holds '<\|video_pad\|>'.*videos are not"):
        processor(["<|vision_start|><|video_pad|><|vision_end|>"], [])
    with pytest.raises(ValueError, match=r"prompts: 2 image marker\(s\) .* but 1 image\(s\) given"):
        processor([MARKER + MARKER], [image])
    with pytest.raises(ValueError, match=r"images\[0\]: height, width: 1 x 201 pixels, an aspect"):
        processor([MARKER], [torch.zeros(3, 1, 201, dtype=torch.uint8)])
    with pytest.raises(ValueError, match=r"prompts\[0\]: its 2 image\(s\) would expand to 12 "):
        processor([MARKER + MARKER], [image, image])
    huge = torch.zeros((), dtype=torch.uint8).expand(3, 60_000, 60_000)  # one byte, no copy
    with pytest.raises(ValueError, match=r"images\[0\]: is 60000 x 60000 = 3600000000 pixels"):
        processor([MARKER], [huge])
    # Config sizes out of the processor's bounds are refused with the file and key.
    from fusion.checkpoint import CheckpointError

    write_directory(tmp_path, patch_size=10**4)
    with pytest.raises(CheckpointError, match=r"vision_config\.patch_size.*expected an integer <="):
        VisionLanguageProcessor.from_directory(directory)
