"""Model directories as ``transformers`` 5 writes them: ``processor.save_pretrained`` keeps the
image processor's settings inside ``processor_config.json`` (no ``preprocessor_config.json``).
Our ids and pixels from such a directory equal the processor's own, for LLaVA, Idefics3 and
SmolVLM; files that cannot be read, or that disagree with the model, are refused by name."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from fusion.checkpoint import CheckpointError
from fusion.preprocessing import VisionLanguageProcessor, prepare_inputs
from vlm_helpers import (
    CLIP_CONFIG,
    IDEFICS3_TOKENS,
    IDEFICS3_VISION_CONFIG,
    IMAGE_ID,
    TEXT_CONFIG,
    char_tokenizer,
    hf_tokenizer,
    make_image,
)

PROMPTS = ["Hi <image> what is it?", "<image>and<image> compare"]
SIZES = [(20, 30), (45, 13), (16, 16)]


def images() -> list[Image.Image]:
    return [Image.fromarray(make_image(h, w, i)) for i, (h, w) in enumerate(SIZES)]


def llava_processor():
    from transformers import LlavaImageProcessor, LlavaProcessor

    # do_pad and bilinear resampling differ from CLIP's defaults: both must be read.
    image_processor = LlavaImageProcessor(
        size={"shortest_edge": 16}, crop_size=16, do_pad=True, resample=2
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=hf_tokenizer(char_tokenizer()),
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def idefics3_processor(smolvlm: bool, monkeypatch):
    # A longest edge of 3 tiles, where the defaults for the tower (16) would take 4.
    settings = {"size": {"longest_edge": 48}, "max_image_size": {"longest_edge": 16}}
    tokenizer = hf_tokenizer(char_tokenizer())
    if not smolvlm:
        from transformers import Idefics3ImageProcessor, Idefics3Processor

        image_processor = Idefics3ImageProcessor(**settings)
        return Idefics3Processor(
            image_processor=image_processor, tokenizer=tokenizer, image_seq_len=IDEFICS3_TOKENS
        )
    import transformers.models.smolvlm.processing_smolvlm as smolvlm_processing
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor
    from transformers.processing_utils import ProcessorMixin
    from transformers.utils import PushToHubMixin

    class NoVideo(PushToHubMixin):
        """SmolVLM's video processor needs torchvision, absent here; images do not use it."""

        _auto_class = None

        def to_dict(self) -> dict:
            return {}

    monkeypatch.setattr(smolvlm_processing, "num2words", str, raising=False)  # video only
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None)
    return SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(**settings),
        tokenizer=tokenizer,
        video_processor=NoVideo(),
        image_seq_len=IDEFICS3_TOKENS,
    )


def write_config(directory, kind: str) -> None:
    from transformers import Idefics3Config, LlavaConfig, SmolVLMConfig

    if kind == "llava":
        vision = {"model_type": "clip_vision_model", **CLIP_CONFIG}
        config = LlavaConfig(vision_config=vision, text_config=TEXT_CONFIG, image_token_index=4)
    else:
        config_cls = SmolVLMConfig if kind == "smolvlm" else Idefics3Config
        config = config_cls(
            vision_config=IDEFICS3_VISION_CONFIG, text_config=TEXT_CONFIG, image_token_id=4
        )
    config.save_pretrained(directory)


@pytest.fixture(params=["llava", "idefics3", "smolvlm"])
def saved(request, tmp_path, monkeypatch):
    """A directory with config.json and what ``processor.save_pretrained`` writes; and the
    processor."""
    kind = request.param
    if kind == "llava":
        processor = llava_processor()
    else:
        processor = idefics3_processor(kind == "smolvlm", monkeypatch)
    processor.save_pretrained(tmp_path)
    write_config(tmp_path, kind)
    return kind, processor, tmp_path


def test_ids_and_pixels_equal_the_processors(saved):
    kind, processor, directory = saved
    assert not (directory / "preprocessor_config.json").exists()
    assert "image_processor" in json.loads((directory / "processor_config.json").read_text())
    if kind == "llava":
        expected = processor(images=images(), text=PROMPTS)
        pixels = torch.as_tensor(np.array(expected["pixel_values"]))
    else:
        expected = processor(images=[images()[:1], images()[1:]], text=PROMPTS)
        padded = torch.as_tensor(np.array(expected["pixel_values"])).flatten(0, 1)
        pixels = padded[padded.flatten(1).any(1)]
    ours = prepare_inputs(directory, PROMPTS, images())
    assert ours.ids == expected["input_ids"]
    assert ours.pixel_values.shape == pixels.shape
    assert (ours.pixel_values - pixels).abs().max() <= 1e-5
    assert sum(row.count(IMAGE_ID) for row in ours.ids) > 0


def test_nested_settings_take_precedence(saved):
    # transformers reads the nested object first; a stale preprocessor_config.json is ignored.
    kind, processor, directory = saved
    stale = {"crop_size": 99} if kind == "llava" else {"max_image_size": {"longest_edge": 99}}
    (directory / "preprocessor_config.json").write_text(json.dumps(stale))
    built = VisionLanguageProcessor.from_directory(directory)
    settings = processor.image_processor
    if kind == "llava":
        assert built.image_processor.do_pad and built.image_processor.resample == 2
        # CLIP's processor writes do_pad but never pads (transformers ignores it there).
        clip = {**json.loads((directory / "processor_config.json").read_text())}
        clip["image_processor"] |= {"image_processor_type": "CLIPImageProcessor"}
        (directory / "processor_config.json").write_text(json.dumps(clip))
        assert not VisionLanguageProcessor.from_directory(directory).image_processor.do_pad
    else:
        assert built.image_processor.longest_edge == settings.size["longest_edge"] == 48


def test_files_that_cannot_be_read_or_disagree(saved):
    kind, _, directory = saved
    file = directory / "processor_config.json"
    good = json.loads(file.read_text())
    file.write_text('{"image_processor": ')
    with pytest.raises(CheckpointError, match=r"processor_config\.json"):
        VisionLanguageProcessor.from_directory(directory)
    file.write_text(json.dumps(good | {"image_processor": [1, 2]}))
    with pytest.raises(CheckpointError, match="key 'image_processor': expected an object"):
        VisionLanguageProcessor.from_directory(directory)
    nested = good["image_processor"]
    if kind == "llava":
        file.write_text(json.dumps(good | {"patch_size": 2}))
        match = "key 'patch_size': 2 .* gives 64 rows per image, but the model gives 16"
        with pytest.raises(CheckpointError, match=match):
            VisionLanguageProcessor.from_directory(directory)
        bad = nested | {"crop_size": {"height": 16, "width": 24}}
        match = r"image_processor: crop_size: gives images of 16 x 24 pixels"
    else:
        bad = nested | {"max_image_size": {"longest_edge": 32}}
        match = r"image_processor: max_image_size\.longest_edge: gives images of 32 x 32"
    file.write_text(json.dumps(good | {"image_processor": bad}))
    with pytest.raises(ValueError, match=match):
        VisionLanguageProcessor.from_directory(directory)


def test_defaults_said_once_when_no_settings(saved, tmp_path_factory):
    kind, _, directory = saved
    bare = tmp_path_factory.mktemp("bare")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(directory / name, bare / name)
    family = "llava" if kind == "llava" else "idefics3"
    with pytest.warns(UserWarning, match=f"using the {family} defaults .* 16-pixel images") as seen:
        VisionLanguageProcessor.from_directory(bare)
        VisionLanguageProcessor.from_directory(bare)
    assert len([w for w in seen if "defaults" in str(w.message)]) == 1


def test_tokenizer_json_is_read_bounded_and_named(saved, monkeypatch):
    # tokenizer.json is untrusted text: its size is bounded before it is read.
    _, _, directory = saved
    import fusion.hf.files as files

    size = (directory / "tokenizer.json").stat().st_size
    monkeypatch.setattr(files, "MAX_TOKENIZER_BYTES", size - 1)
    with pytest.raises(CheckpointError, match=rf"tokenizer\.json.*larger than {size - 1} bytes"):
        VisionLanguageProcessor.from_directory(directory)
    monkeypatch.setattr(files, "MAX_TOKENIZER_BYTES", size)
    assert VisionLanguageProcessor.from_directory(directory).encode("a") != []
    (directory / "tokenizer.json").rename(directory / "moved.json")
    try:
        with pytest.raises(CheckpointError, match="missing: text prompts need the model's tok"):
            VisionLanguageProcessor.from_directory(directory)
    finally:
        (directory / "moved.json").rename(directory / "tokenizer.json")
