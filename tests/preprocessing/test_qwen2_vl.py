"""Qwen2-VL and Qwen2.5-VL preprocessing: our patches are bitwise transformers' (its Pillow
backend, what ``AutoImageProcessor`` gives without torchvision), grids and sizes equal, on odd
sizes and modes and with the settings in every form transformers 5.24 reads; ids from a model
directory equal ``AutoProcessor``'s; bad settings, images and prompts are refused by name
before anything is allocated."""

import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from fusion.checkpoint import CheckpointError
from fusion.families.qwen_vl.images import MAX_IMAGE_PIXELS
from fusion.families.qwen_vl.processor import read_qwen2_vl_layout
from fusion.preprocessing import (
    Qwen2VLImageProcessor,
    VisionLanguageProcessor,
    detect_model_kind,
    prepare_inputs,
    qwen2_vl_image_text,
    smart_resize,
)
from helpers import run_bounded
from vlm_helpers import (
    QWEN_IMAGE_MARKER,
    QWEN_SPECIAL_IDS,
    as_tensor,
    make_image,
    qwen_char_tokenizer,
    qwen_hf_tokenizer,
    without_torchvision_video,
)

MARKER = QWEN_IMAGE_MARKER
PAD_ID = QWEN_SPECIAL_IDS["<|endoftext|>"]
IMAGE_ID = QWEN_SPECIAL_IDS["<|image_pad|>"]
START_ID = QWEN_SPECIAL_IDS["<|vision_start|>"]
END_ID = QWEN_SPECIAL_IDS["<|vision_end|>"]
# (height, width): odd, tall and thin, tiny ones upscaled to min_pixels, an aspect ratio of
# exactly 200 (the largest taken), a large one capped by max_pixels.
SIZES = [(37, 53), (300, 20), (1, 1), (2, 3), (1, 200), (5, 700), (1000, 1500)]
# A small pixel range keeps the patches few; min_pixels above one 28 x 28 square so that
# tiny images are scaled up.
SMALL = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64}


def hf_image_processor(**settings):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**json.loads(json.dumps(settings)))  # it edits what it gets


def hf_outputs(processor, images) -> tuple[torch.Tensor, torch.Tensor]:
    out = processor(images)
    return (
        torch.from_numpy(np.array(out["pixel_values"])),
        torch.from_numpy(np.array(out["image_grid_thw"])),
    )


def config_of(processor) -> dict:
    """The settings as transformers 5.24 saves them (``size``, no ``min_pixels``)."""
    return json.loads(processor.to_json_string())


def images_of_modes(mode: str) -> list[Image.Image]:
    channels = 4 if mode in ("RGBA", "LA", "P+transparency") else 3
    images = []
    for i, (h, w) in enumerate(SIZES):
        image = Image.fromarray(make_image(h, w, i, channels))
        if mode in ("L", "LA", "P"):
            image = image.convert(mode)
        elif mode == "P+transparency":
            image = image.convert("RGB").quantize(16)
            image.info["transparency"] = 3
        images.append(image)
    return images


def test_smart_resize_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as hf_smart_resize,
    )

    sizes = [
        (h, w)
        for h in (1, 2, 13, 14, 27, 28, 29, 41, 55, 99, 333, 1000, 4001)
        for w in (1, 3, 28, 42, 56, 70, 97, 500, 2048, 7000)
    ]
    ranges = [(3136, 1003520), (3136, 12845056), (100, 784), (784, 784), (4096, 65536)]
    for factor in (28, 32, 14):
        for low, high in ranges:
            for h, w in sizes:
                if max(h, w) / min(h, w) > 200:
                    continue
                expected = hf_smart_resize(h, w, factor, low, high)
                assert smart_resize(h, w, factor, low, high) == expected, (h, w, factor, low, high)
    assert smart_resize(1, 200) == hf_smart_resize(1, 200)
    with pytest.raises(ValueError, match=r"1 x 201 pixels, an aspect ratio of 201\.0, above"):
        smart_resize(1, 201)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="factor: expected an integer in"):
            smart_resize(10, 10, bad)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "P+transparency"])
def test_pixels_bitwise_across_modes_and_sizes(mode):
    hf = hf_image_processor(**SMALL)
    ours = Qwen2VLImageProcessor.from_config(config_of(hf))
    images = images_of_modes(mode)
    pixels, grids = hf_outputs(hf, images)
    mine = ours(images)
    assert mine.pixel_values.dtype == torch.float32 and mine.image_grid_thw.dtype == torch.int64
    assert mine.pixel_values.shape == (int(grids.prod(1).sum()), 3 * 2 * 14 * 14)
    assert torch.equal(mine.image_grid_thw, grids)
    assert torch.equal(mine.pixel_values, pixels)
    # Tensors [c, h, w] give the same bits as the Pillow images they come from.
    from fusion.preprocessing import from_pil

    assert torch.equal(ours([from_pil(image) for image in images]).pixel_values, pixels)


@pytest.mark.parametrize(
    "settings",
    [
        {},  # transformers' defaults: the large image capped at 1003520 pixels
        {"size": {"shortest_edge": 3136, "longest_edge": 28 * 28 * 300}},
        {**SMALL, "resample": 2, "do_normalize": False},
        {**SMALL, "do_rescale": False, "image_mean": [0.5, 0.25, 0.125], "image_std": 0.5},
        {"min_pixels": 128 * 128, "max_pixels": 256 * 256, "patch_size": 16, "merge_size": 2},
        {**SMALL, "temporal_patch_size": 3, "merge_size": 1, "resample": 1},
    ],
    ids=["defaults", "size", "bilinear-unnormalised", "unscaled", "patch-16", "t3-m1-lanczos"],
)
def test_pixels_bitwise_across_settings(settings):
    hf = hf_image_processor(**settings)
    images = images_of_modes("RGB")
    pixels, grids = hf_outputs(hf, images)
    # The settings as given (legacy min_pixels / max_pixels where so) and as saved (size).
    for config in (settings, config_of(hf)):
        mine = Qwen2VLImageProcessor.from_config(config)
        out = mine(images)
        assert torch.equal(out.image_grid_thw, grids)
        assert torch.equal(out.pixel_values, pixels)
        rows = [mine.rows(h, w) for h, w in SIZES]
        merge = settings.get("merge_size", 2)
        assert rows == (grids.prod(1) // merge**2).tolist()


def test_without_resize_sides_must_be_multiples():
    hf = hf_image_processor(do_resize=False)
    images = [Image.fromarray(make_image(56, 84, 0)), Image.fromarray(make_image(28, 28, 1))]
    pixels, grids = hf_outputs(hf, images)
    ours = Qwen2VLImageProcessor.from_config(config_of(hf))
    assert torch.equal(ours(images).pixel_values, pixels)
    assert ours(images).image_grid_thw.tolist() == grids.tolist() == [[1, 4, 6], [1, 2, 2]]
    with pytest.raises(ValueError, match=r"images\[0\]: 37 x 53 pixels with do_resize false"):
        ours([Image.fromarray(make_image(37, 53, 0))])


def test_without_rgb_conversion_only_rgb_is_taken():
    hf = hf_image_processor(**SMALL, do_convert_rgb=False)
    rgb = Image.fromarray(make_image(37, 53, 0))
    transparent = rgb.copy()
    transparent.info["transparency"] = (1, 2, 3)  # ignored when nothing is converted
    pixels, _ = hf_outputs(hf, [rgb, transparent])
    ours = Qwen2VLImageProcessor.from_config(config_of(hf))
    assert torch.equal(ours([rgb, transparent]).pixel_values, pixels)
    with pytest.raises(ValueError, match=r"images\[1\]: Pillow mode 'L' with do_convert_rgb"):
        ours([rgb, rgb.convert("L")])
    four = torch.zeros(4, 28, 28, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"images\[0\]: 4 channel\(s\) with do_convert_rgb"):
        ours([four])


# ---------------------------------------------------------------- model directories


def write_config(directory, model_type: str = "qwen2_vl", **overrides) -> None:
    """A tiny ``config.json`` as transformers' ``Qwen2VLConfig`` / ``Qwen2_5_VLConfig`` save
    it, with the tokenizer's ids."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    config_class = Qwen2VLConfig if model_type == "qwen2_vl" else Qwen2_5_VLConfig
    text = {
        "vocab_size": 160,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "bos_token_id": None,
        "eos_token_id": QWEN_SPECIAL_IDS["<|im_end|>"],
    }
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2}
    vision |= {"embed_dim": 16} if model_type == "qwen2_vl" else {"out_hidden_size": 32}
    config = config_class(
        text_config=text,
        vision_config=vision | overrides.pop("vision", {}),
        image_token_id=IMAGE_ID,
        vision_start_token_id=START_ID,
        vision_end_token_id=END_ID,
        **overrides,
    )
    config.save_pretrained(directory)


def model_directory(tmp_path, model_type: str = "qwen2_vl", settings: dict | None = SMALL):
    """A directory of ``config.json``, the tokenizer and (unless None) the image processor's
    ``preprocessor_config.json`` holding ``settings`` as given."""
    directory = tmp_path / model_type
    directory.mkdir()
    write_config(directory, model_type)
    qwen_hf_tokenizer(qwen_char_tokenizer()).save_pretrained(directory)
    if settings is not None:
        kind = {"image_processor_type": "Qwen2VLImageProcessor"}
        (directory / "preprocessor_config.json").write_text(json.dumps(kind | settings))
    return directory


def hf_processor(directory, monkeypatch):
    """transformers' own ``AutoProcessor.from_pretrained(directory)`` (without torchvision)."""
    from transformers import AutoProcessor

    without_torchvision_video(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision is missing: the Pillow backend, said once
        return AutoProcessor.from_pretrained(directory)


PROMPTS = [
    f"<|im_start|>user\n{MARKER}What is it?<|im_end|>\n<|im_start|>assistant\n",
    f"Compare {MARKER} and {MARKER}, please.",
    "No image here.",
]


def batch_images() -> list[Image.Image]:
    images = images_of_modes("RGB")
    return [images[0], images[1].convert("L"), images[3]]


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_ids_pixels_and_grids_equal_the_processors(model_type, tmp_path, monkeypatch):
    directory = model_directory(tmp_path, model_type)
    assert detect_model_kind(directory) == "qwen2_vl"
    hf = hf_processor(directory, monkeypatch)
    assert (
        type(hf).__name__
        == {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}[model_type]
    )
    images = batch_images()
    expected = hf(images=images, text=PROMPTS)
    ours = prepare_inputs(directory, PROMPTS, images)
    assert ours.ids == expected["input_ids"]
    assert torch.equal(ours.pixel_values, torch.from_numpy(np.array(expected["pixel_values"])))
    grids = torch.from_numpy(np.array(expected["image_grid_thw"]))
    assert ours.image_grid_thw is not None and torch.equal(ours.image_grid_thw, grids)
    rows = (grids.prod(1) // 4).tolist()
    assert [row.count(IMAGE_ID) for row in ours.ids] == [rows[0], rows[1] + rows[2], 0]
    # mm_token_type_ids (what transformers' M-RoPE reads) is the placeholders, nothing more.
    for row, types in zip(ours.ids, expected["mm_token_type_ids"], strict=True):
        assert types == [int(t == IMAGE_ID) for t in row]

    # One image, and text alone.
    for prompts, given in ((PROMPTS[:1], images[:1]), (PROMPTS[2:], [])):
        theirs = hf(images=given or None, text=prompts)
        mine = prepare_inputs(directory, prompts, given)
        assert mine.ids == theirs["input_ids"]
        if not given:
            assert mine.pixel_values.shape == (0, 3 * 2 * 14 * 14)
            assert mine.image_grid_thw is not None and mine.image_grid_thw.shape == (0, 3)
            assert mine.encoder_input() == {}


def test_tokens_and_encoder_input(tmp_path):
    directory = model_directory(tmp_path)
    inputs = prepare_inputs(directory, PROMPTS, batch_images())
    tokens = inputs.tokens(PAD_ID)
    longest = max(len(row) for row in inputs.ids)
    assert tokens.shape == (3, longest) and tokens.dtype == torch.int64
    for row, ids in zip(tokens.tolist(), inputs.ids, strict=True):  # padded on the left
        assert row == [PAD_ID] * (longest - len(ids)) + ids
    encoder_input = inputs.encoder_input(dtype=torch.bfloat16)
    assert set(encoder_input) == {"image"}
    image = encoder_input["image"]
    assert set(image) == {"pixel_values", "image_grid_thw"}
    assert image["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(image["pixel_values"], inputs.pixel_values.to(torch.bfloat16))
    assert image["image_grid_thw"] is inputs.image_grid_thw  # int64, on the CPU
    assert image["image_grid_thw"].device.type == "cpu"
    assert qwen2_vl_image_text(2) == "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"


def test_settings_found_where_transformers_looks(tmp_path, monkeypatch):
    from transformers import AutoImageProcessor

    # Both forms in one file: the legacy top-level keys win over size, as in transformers.
    both = {"size": {"shortest_edge": 100, "longest_edge": 200_000}, **SMALL}
    directory = model_directory(tmp_path, settings=both)
    images = batch_images()
    reference = AutoImageProcessor.from_pretrained(directory)
    assert type(reference).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision here
    pixels, grids = hf_outputs(reference, images)
    ours = prepare_inputs(directory, PROMPTS, images)
    assert torch.equal(ours.pixel_values, pixels) and torch.equal(ours.image_grid_thw, grids)

    # processor_config.json's "image_processor" (transformers 5's save_pretrained) comes first.
    nested = {"size": {"shortest_edge": 28 * 28 * 20, "longest_edge": 28 * 28 * 40}}
    config = {"image_processor": nested, "processor_class": "Qwen2VLProcessor"}
    (directory / "processor_config.json").write_text(json.dumps(config))
    hf = hf_processor(directory, monkeypatch)
    expected = hf(images=images, text=PROMPTS)
    ours = prepare_inputs(directory, PROMPTS, images)
    assert ours.ids == expected["input_ids"]
    assert torch.equal(ours.pixel_values, torch.from_numpy(np.array(expected["pixel_values"])))
    assert not torch.equal(ours.image_grid_thw, grids)  # the nested settings were taken


def test_published_config_layouts(tmp_path):
    # Qwen2-VL-7B-Instruct's config.json: text settings flat at the top, rope_scaling of type
    # mrope, vision_config without the defaults it does not change.
    published = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": 3584,
        "vocab_size": 152064,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_token_id": 151654,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "embed_dim": 1280, "in_chans": 3, "spatial_patch_size": 14},
    }
    (tmp_path / "config.json").write_text(json.dumps(published))
    layout = read_qwen2_vl_layout(tmp_path)
    assert (layout.image_token_id, layout.vision_start_token_id, layout.vision_end_token_id) == (
        151655,
        151652,
        151653,
    )
    assert (layout.patch_size, layout.spatial_merge_size, layout.temporal_patch_size) == (14, 2, 2)
    del published["vision_config"]
    published["model_type"] = "qwen2_5_vl"
    (tmp_path / "config.json").write_text(json.dumps(published))
    assert read_qwen2_vl_layout(tmp_path).patch_size == 14
    assert detect_model_kind(tmp_path) == "qwen2_vl"


def test_defaults_said_once_without_settings(tmp_path, monkeypatch):
    directory = model_directory(tmp_path, settings=None)
    images = [Image.fromarray(make_image(37, 53, 0))]
    with pytest.warns(UserWarning, match="using transformers' Qwen2-VL defaults") as seen:
        first = prepare_inputs(directory, [MARKER], images)
        prepare_inputs(directory, [MARKER], images)
    assert len([w for w in seen if "defaults" in str(w.message)]) == 1
    pixels, grids = hf_outputs(hf_image_processor(), images)
    assert torch.equal(first.pixel_values, pixels) and torch.equal(first.image_grid_thw, grids)


# ---------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"max_pixels": 10**12}, f"max_pixels: expected at most {MAX_IMAGE_PIXELS} pixels"),
        (
            {"size": {"shortest_edge": 3136, "longest_edge": 10**9}},
            "size.longest_edge: expected at",
        ),
        ({"patch_size": 0}, r"patch_size: expected an integer in \[1, 256\], got 0"),
        ({"patch_size": -14}, r"patch_size: expected an integer in \[1, 256\], got -14"),
        ({"patch_size": "14"}, "patch_size: expected an integer, got '14'"),
        ({"merge_size": 2.0}, "merge_size: expected an integer, got 2.0"),
        ({"temporal_patch_size": 10**6}, r"temporal_patch_size: expected an integer in \[1, 8\]"),
        ({"min_pixels": 3136.5}, "min_pixels: expected a positive integer, got 3136.5"),
        ({"min_pixels": 0}, "min_pixels: expected a positive integer, got 0"),
        ({"min_pixels": 10_000, "max_pixels": 5_000}, "min_pixels: expected at most max_pixels"),
        ({"min_pixels": 10, "max_pixels": 500}, r"max_pixels: expected at least \(patch_size"),
        ({"size": {"shortest_edge": 3136}}, "size.longest_edge: missing"),
        # transformers 5.24 no longer reads the pixel range from these keys of size.
        ({"size": {"min_pixels": 3136, "max_pixels": 50176}}, "size.shortest_edge: missing"),
        ({"size": [3136, 50176]}, "size: expected an object"),
        ({"resample": 0}, "resample: expected one of"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std: expected three finite positive numbers"),
        ({"do_resize": "yes"}, "do_resize: expected true or false"),
        (
            {"image_processor_type": "CLIPImageProcessor"},
            "image_processor_type: expected a Qwen2VLImage",
        ),
    ],
)
def test_hostile_settings_are_refused_by_name(settings, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        Qwen2VLImageProcessor.from_config(settings, "preprocessor_config.json")
    directory = model_directory(tmp_path, settings=settings)
    with pytest.raises(ValueError, match=f"preprocessor_config.json: {match}"):
        prepare_inputs(directory, [MARKER], [torch.zeros(3, 28, 28, dtype=torch.uint8)])


def test_settings_that_contradict_the_tower(tmp_path):
    directory = model_directory(tmp_path, settings={**SMALL, "patch_size": 16})
    with pytest.raises(ValueError, match=r"patch_size: 16, but the vision tower \(config.json, v"):
        VisionLanguageProcessor.from_directory(directory)
    write_config(directory, vision={"spatial_merge_size": 1})
    (directory / "preprocessor_config.json").write_text(json.dumps(SMALL))
    with pytest.raises(ValueError, match=r"merge_size: 2, but .*vision_config\.spatial_merge_size"):
        VisionLanguageProcessor.from_directory(directory)
    for key, value, match in (
        ("patch_size", [14, 14], r"vision_config.patch_size.*expected an integer in \[1, 2\*\*31"),
        ("patch_size", 10**4, "vision_config.patch_size.*expected an integer <= 256"),
    ):
        config = json.loads((directory / "config.json").read_text())
        config["vision_config"][key] = value
        (directory / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=match):
            VisionLanguageProcessor.from_directory(directory)
    config["image_token_id"] = -1
    config["vision_config"]["patch_size"] = 14
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"image_token_id.*expected an integer in"):
        VisionLanguageProcessor.from_directory(directory)


def test_bad_images_and_prompts(tmp_path):
    processor = VisionLanguageProcessor.from_directory(model_directory(tmp_path))
    image = torch.zeros(3, 30, 40, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"prompts: 2 image marker\(s\) .* but 1 image\(s\) given"):
        processor([MARKER + MARKER], [image])
    with pytest.raises(ValueError, match=r"prompts: 0 image marker\(s\)"):
        processor(["<|image_pad|> alone"], [image])
    with pytest.raises(ValueError, match=r"prompts\[1\]: holds '<\|image_pad\|>' outside the"):
        processor([MARKER, "x <|image_pad|>"], [image])
    with pytest.raises(ValueError, match=r"prompts\[0\]: holds '<\|video_pad\|>'.*videos are not"):
        processor(["<|vision_start|><|video_pad|><|vision_end|>"], [])
    thin = torch.zeros(3, 1, 201, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"images\[1\]: height, width: 1 x 201 pixels, an aspect"):
        processor([MARKER + MARKER], [image, thin])
    wide = Image.fromarray(np.full((4, 5), 300, dtype=np.uint16)).convert("I;16")
    with pytest.raises(ValueError, match=r"images\[0\]: Pillow mode 'I;16' cannot be taken"):
        processor([MARKER], [wide])
    with pytest.raises(ValueError, match=r"images\[0\]: expected 8-bit pixels"):
        processor([MARKER], [image.float()])
    small_directory = model_directory(tmp_path, "qwen2_5_vl")
    small = VisionLanguageProcessor.from_directory(
        small_directory, max_image_rows=10, max_pixels=5000
    )
    with pytest.raises(ValueError, match=r"prompts\[0\]: its 2 image\(s\) would expand to 12 "):
        small([MARKER + MARKER], [image, image])  # 6 rows each
    with pytest.raises(ValueError, match=r"images\[0\]: is 60 x 90 = 5400 pixels, more than max_"):
        small([MARKER], [torch.zeros(3, 60, 90, dtype=torch.uint8)])
    with pytest.raises(ValueError, match=r"images\[0\]: would be processed to 56 x 84 = 4704 "):
        VisionLanguageProcessor.from_directory(small_directory, max_pixels=4000)([MARKER], [image])


def test_tokenizer_that_disagrees_with_the_config(tmp_path):
    directory = model_directory(tmp_path)
    image = torch.zeros(3, 30, 40, dtype=torch.uint8)  # 6 rows
    tokenizer = qwen_char_tokenizer()

    def no_start(text: str) -> list[int]:  # a tokenizer with another id for <|vision_start|>
        return [7 if i == START_ID else i for i in tokenizer.encode(text).ids]

    with pytest.raises(ValueError, match=r"prompts\[0\]: .*runs of \[6\] .*not all between the s"):
        prepare_inputs(directory, [MARKER], [image], encode=no_start)
    with pytest.raises(ValueError, match=r"prompts\[0\]: .*runs of \[6, 1\] placeholder ids"):
        prepare_inputs(
            directory, [MARKER + "x"], [image], encode=lambda t: [*no_start(t), IMAGE_ID]
        )


def test_constructor_arguments_per_kind():
    common = {"image_token_id": IMAGE_ID, "encode": list}
    with pytest.raises(ValueError, match="tokens_per_image: not taken by qwen2_vl"):
        VisionLanguageProcessor("qwen2_vl", Qwen2VLImageProcessor(), tokens_per_image=16, **common)
    with pytest.raises(ValueError, match="vision_start_token_id: expected an integer >= 0, got No"):
        VisionLanguageProcessor("qwen2_vl", Qwen2VLImageProcessor(), **common)
    with pytest.raises(
        ValueError, match="image_processor: expected a ClipImageProcessor for llava"
    ):
        VisionLanguageProcessor("llava", Qwen2VLImageProcessor(), **common)
    processor = VisionLanguageProcessor(
        "qwen2_vl",
        Qwen2VLImageProcessor(**SMALL),
        vision_start_token_id=START_ID,
        vision_end_token_id=END_ID,
        max_pixels=10_000,
        **common,
    )
    # The safety cap goes to pixel_limit; Qwen2-VL's own max_pixels is kept.
    assert processor.image_processor.max_pixels == SMALL["max_pixels"]
    assert processor.image_processor.pixel_limit == 10_000  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"max_pixels: expected an integer in \[1, 16777216\]"):
        Qwen2VLImageProcessor(max_pixels=MAX_IMAGE_PIXELS + 1)


# Run in the bounded subprocess: images of gigabytes as stand-ins of one byte (stride 0), each
# to be refused from its size before anything of that size is allocated.
CASES = r"""
import json, sys
import torch
from fusion.preprocessing import prepare_inputs

root = sys.argv[1]
marker = "<|vision_start|><|image_pad|><|vision_end|>"
def case(name, image):
    try:
        prepare_inputs(root, [marker], [image], encode=lambda text: [1])
        result = {"case": name, "error": None, "message": ""}
    except BaseException as error:
        result = {"case": name, "error": type(error).__name__, "message": str(error)}
    print(json.dumps(result), flush=True)

case("huge", torch.zeros((), dtype=torch.uint8).expand(3, 60_000, 60_000))
case("thin", torch.zeros((), dtype=torch.uint8).expand(3, 30, 30_000_000))
"""


def test_huge_and_thin_images_in_bounded_memory(tmp_path):
    directory = model_directory(tmp_path)
    done = run_bounded(CASES, str(directory))
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["case"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert results["huge"]["error"] == "ValueError", results
    assert (
        "images[0]: is 60000 x 60000 = 3600000000 pixels, more than" in results["huge"]["message"]
    )
    assert results["thin"]["error"] == "ValueError", results
    assert "an aspect ratio of 1000000.0, above Qwen2-VL's limit" in results["thin"]["message"]


def test_pixels_from_tensors_and_pillow_images_agree():
    rgba = make_image(41, 29, 3, channels=4)
    ours = Qwen2VLImageProcessor(**SMALL)
    from_tensor = ours([as_tensor(rgba)]).pixel_values
    assert torch.equal(from_tensor, ours([Image.fromarray(rgba)]).pixel_values)
