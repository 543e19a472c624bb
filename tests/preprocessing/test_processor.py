"""From prompts and image files to tokens and pixels: our ``prepare_inputs`` on a model
directory gives the ``input_ids`` and ``pixel_values`` of Hugging Face's processors, and
generation from them gives the tokens ``transformers`` generates."""

import numpy as np
import pytest
import torch
from PIL import Image

from fusion import generate
from fusion.checkpoint import CheckpointError
from fusion.checkpoint.hf_vlm import load_hf_vlm
from fusion.preprocessing import (
    VisionInputs,
    VisionLanguageProcessor,
    detect_model_kind,
    expand_markers,
    idefics3_image_text,
    load_image,
    prepare_inputs,
)
from vlm_helpers import (
    IDEFICS3_TOKENS,
    IMAGE_ID,
    LLAVA_TOKENS,
    PAD,
    char_tokenizer,
    hf_tokenizer,
    make_image,
    tiny_hf_idefics3,
    tiny_hf_llava,
)

PROMPTS = ["Hi <image> what is it?", "<image>and<image> compare"]
SIZES = [(20, 30), (45, 13), (16, 16)]


def images() -> list[Image.Image]:
    return [Image.fromarray(make_image(h, w, i)) for i, (h, w) in enumerate(SIZES)]


def hf_mask(tokens: torch.Tensor) -> torch.Tensor:
    return (tokens != PAD).long()


@pytest.fixture(scope="module")
def llava_setup(tmp_path_factory):
    from transformers import CLIPImageProcessor, LlavaProcessor

    directory = tmp_path_factory.mktemp("llava")
    hf = tiny_hf_llava()
    hf.save_pretrained(directory)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size=16)
    image_processor.save_pretrained(directory)
    tokenizer = char_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=hf_tokenizer(tokenizer),
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return hf, processor, directory


@pytest.fixture(scope="module")
def idefics3_setup(tmp_path_factory):
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    directory = tmp_path_factory.mktemp("idefics3")
    hf = tiny_hf_idefics3()
    hf.save_pretrained(directory)
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": 48}, max_image_size={"longest_edge": 16}
    )
    image_processor.save_pretrained(directory)
    tokenizer = char_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=hf_tokenizer(tokenizer),
        image_seq_len=IDEFICS3_TOKENS,
    )
    return hf, processor, directory


def test_llava_ids_pixels_and_generation(llava_setup):
    hf, processor, directory = llava_setup
    assert detect_model_kind(directory) == "llava"
    expected = processor(images=images(), text=PROMPTS)
    ours = prepare_inputs(directory, PROMPTS, images())
    assert ours.ids == expected["input_ids"]
    assert [row.count(IMAGE_ID) for row in ours.ids] == [LLAVA_TOKENS, 2 * LLAVA_TOKENS]
    pixels = torch.as_tensor(np.array(expected["pixel_values"]))
    assert (ours.pixel_values - pixels).abs().max() <= 1e-5

    tokens = ours.tokens(PAD)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = hf.generate(
            input_ids=tokens,
            attention_mask=hf_mask(tokens),
            pixel_values=pixels,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=PAD,
        )
    model = load_hf_vlm(directory).eval()
    mine = generate(
        model,
        tokens,
        encoder_input=ours.encoder_input(),
        max_new_tokens=6,
        temperature=0,
        pad_id=PAD,
    )
    assert mine.tolist() == theirs.tolist()


def test_idefics3_ids_pixels_and_generation(idefics3_setup):
    hf, processor, directory = idefics3_setup
    assert detect_model_kind(directory) == "idefics3"
    expected = processor(images=[images()[:1], images()[1:]], text=PROMPTS)
    ours = prepare_inputs(directory, PROMPTS, images())
    assert ours.ids == expected["input_ids"]
    pixels = torch.as_tensor(np.array(expected["pixel_values"]))
    real = pixels.flatten(0, 1)[pixels.flatten(0, 1).flatten(1).any(1)]
    assert ours.pixel_values.shape == real.shape == (21, 3, 16, 16)  # 7, 4 and 10 tiles
    assert (ours.pixel_values - real).abs().max() <= 1e-5

    tokens = ours.tokens(PAD)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = hf.generate(
            input_ids=tokens,
            attention_mask=hf_mask(tokens),
            pixel_values=pixels,
            pixel_attention_mask=torch.as_tensor(np.array(expected["pixel_attention_mask"])),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=PAD,
        )
    model = load_hf_vlm(directory).eval()
    mine = generate(
        model,
        tokens,
        encoder_input=ours.encoder_input(),
        max_new_tokens=6,
        temperature=0,
        pad_id=PAD,
    )
    assert mine.tolist() == theirs.tolist()


def test_image_files_and_defaults_without_preprocessor_config(tmp_path, llava_setup):
    _, _, directory = llava_setup
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(directory / name)
    Image.fromarray(make_image(30, 20, 5, channels=4)).save(tmp_path / "cat.png")
    ours = prepare_inputs(tmp_path, "<image>\nWhat is this?", [load_image(tmp_path / "cat.png")])
    assert ours.pixel_values.shape == (1, 3, 16, 16)  # CLIP's defaults for the tower's size
    assert ours.ids[0][:2] == [1, IMAGE_ID] and len(ours.ids[0]) == 1 + LLAVA_TOKENS + 14
    text_only = prepare_inputs(tmp_path, ["no image", "none here"])
    assert text_only.pixel_values.shape[0] == 0 and text_only.encoder_input() == {}
    assert text_only.ids == [char_tokenizer().encode(t).ids for t in ("no image", "none here")]


def test_idefics3_expansion_text():
    assert idefics3_image_text(0, 0, 2) == (
        "<fake_token_around_image><global-img><image><image><fake_token_around_image>"
    )
    text = idefics3_image_text(1, 2, 1)
    assert text == (
        "<fake_token_around_image><row_1_col_1><image>"
        "<fake_token_around_image><row_1_col_2><image>\n"
        "\n<fake_token_around_image><global-img><image><fake_token_around_image>"
    )


class TestBadInput:
    def test_markers_that_do_not_match_the_images(self, llava_setup):
        _, _, directory = llava_setup
        with pytest.raises(
            ValueError,
            match=r"2 image marker\(s\) '<image>' \(per prompt: \[0, 2\]\), but 3 image\(s\)",
        ):
            prepare_inputs(directory, ["no image here", "<image><image>"], images())
        with pytest.raises(ValueError, match=r"1 image marker\(s\).*but 0 image\(s\)"):
            prepare_inputs(directory, "<image> describe", [])
        with pytest.raises(ValueError, match="write one '<image>' where each image goes"):
            expand_markers(["a"], ["x"])

    def test_image_of_a_mode_that_cannot_be_taken(self, idefics3_setup):
        _, _, directory = idefics3_setup
        wide = Image.fromarray(np.zeros((8, 8), dtype=np.uint16))
        with pytest.raises(ValueError, match=r"images\[1\]: Pillow mode 'I;16' cannot be taken"):
            prepare_inputs(directory, "<image><image>", [images()[0], wide])
        with pytest.raises(ValueError, match=r"images\[0\]: expected 8-bit pixels"):
            prepare_inputs(directory, "<image>", [torch.zeros(2, 8, 8, dtype=torch.uint8)])

    def test_tokenizer_without_the_image_token(self, llava_setup):
        _, _, directory = llava_setup
        tokenizer = char_tokenizer()

        def encode(text: str) -> list[int]:  # splits "<image>" into characters
            return tokenizer.encode(text.replace("<image>", "[image]")).ids

        with pytest.raises(
            ValueError, match=r"hold 0 placeholder ids \(4\), but the images give 16"
        ):
            prepare_inputs(directory, "<image>", images()[:1], encode=encode)
        # A prompt holding the placeholder id itself (here: added by the tokenizer).
        processor = VisionLanguageProcessor.from_directory(
            directory, encode=lambda text: [1, IMAGE_ID, *tokenizer.encode(text).ids]
        )
        with pytest.raises(ValueError, match="prompts must not hold it otherwise"):
            processor(["<image>"], images()[:1])

    def test_directory_problems(self, tmp_path, llava_setup, idefics3_setup):
        _, _, directory = llava_setup
        for name in ("config.json", "model.safetensors"):
            (tmp_path / name).symlink_to(directory / name)
        with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing"):
            prepare_inputs(tmp_path, "<image>", images()[:1])
        _, _, idefics3_dir = idefics3_setup
        (tmp_path / "idefics3").mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (tmp_path / "idefics3" / name).symlink_to(idefics3_dir / name)
        (tmp_path / "idefics3" / "processor_config.json").write_text('{"image_seq_len": 169}')
        with pytest.raises(CheckpointError, match="'image_seq_len': 169, but the model gives 16"):
            prepare_inputs(tmp_path / "idefics3", "<image>", images()[:1])
        (tmp_path / "idefics3" / "processor_config.json").unlink()
        (tmp_path / "idefics3" / "preprocessor_config.json").write_text(
            '{"max_image_size": {"longest_edge": 32}, "size": {"longest_edge": 64}}'
        )
        with pytest.raises(
            ValueError,
            match=r"preprocessor_config\.json: max_image_size\.longest_edge: gives images of 32 x "
            r"32 pixels, but the vision tower \(config\.json, vision_config\.image_size\) takes 16",
        ):
            prepare_inputs(tmp_path / "idefics3", "<image>", images()[:1])


def test_no_images():
    inputs = VisionInputs([[1, 5, 6]], torch.empty(0, 3, 16, 16))
    assert inputs.encoder_input() == {}
    assert inputs.tokens(PAD).tolist() == [[1, 5, 6]]


def test_processor_arguments():
    from fusion.preprocessing import ClipImageProcessor, Idefics3ImageProcessor

    clip = ClipImageProcessor.for_image_size(16)
    ok = {"tokens_per_image": 16, "image_size": 16, "image_token_id": 4, "encode": list}
    with pytest.raises(
        ValueError, match=r"kind: expected one of \['gemma3', 'idefics3', 'llava', 'qwen2_vl'\]"
    ):
        VisionLanguageProcessor("qwen", clip, **ok)
    with pytest.raises(ValueError, match="image_processor: expected a Idefics3ImageProcessor"):
        VisionLanguageProcessor("idefics3", clip, **ok)
    with pytest.raises(ValueError, match="tokens_per_image: expected an integer >= 1, got 0"):
        VisionLanguageProcessor("llava", clip, **{**ok, "tokens_per_image": 0})
    with pytest.raises(TypeError, match="encode: expected a callable"):
        VisionLanguageProcessor("llava", clip, **{**ok, "encode": None})
    assert VisionLanguageProcessor("idefics3", Idefics3ImageProcessor(), **ok).kind == "idefics3"
