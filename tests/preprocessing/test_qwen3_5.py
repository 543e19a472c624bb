"""Qwen3.5 preprocessing: transformers gives it Qwen3-VL's processor (the Qwen2-VL image
processor, patch 16) with Qwen3.5's own ids. From a directory ``Qwen3_5Config`` writes, ids,
patches and grids equal transformers' processor's; its ids come from the family, not Qwen2's."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from fusion.families.qwen_vl.processor import read_qwen2_vl_layout
from fusion.preprocessing import detect_model_kind, prepare_inputs
from qwen3_helpers import (
    QWEN3_5_SPECIAL_IDS,
    QWEN3_PREPROCESSOR,
    VISION_CONFIG,
    qwen3_5_byte_tokenizer,
)
from qwen_helpers import hf_processor
from vlm_helpers import QWEN_IMAGE_MARKER, make_image

MARKER = QWEN_IMAGE_MARKER
PROMPTS = [
    f"<|im_start|>user\n{MARKER}What is it?<|im_end|>\n<|im_start|>assistant\n",
    f"Compare {MARKER} and {MARKER}, please.",
    "No image here.",
]
SIZES = [(37, 53), (300, 20), (400, 600)]  # (height, width): odd, thin, above the small range

SPECIAL_IDS = QWEN3_5_SPECIAL_IDS
IMAGE_ID = SPECIAL_IDS["<|image_pad|>"]
TEXT_CONFIG = {
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


def write_directory(tmp_path, ids: bool = True):
    """``config.json`` as transformers' ``Qwen3_5Config`` saves it (with the tokenizer's ids,
    or with its own defaults when ``ids`` is False), the tokenizer and the settings."""
    from transformers import Qwen3_5Config

    directory = tmp_path / "qwen3_5"
    directory.mkdir(exist_ok=True)
    special = (
        {
            "image_token_id": IMAGE_ID,
            "vision_start_token_id": SPECIAL_IDS["<|vision_start|>"],
            "vision_end_token_id": SPECIAL_IDS["<|vision_end|>"],
        }
        if ids
        else {}
    )
    vision = {k: v for k, v in VISION_CONFIG.items() if k != "deepstack_visual_indexes"}
    Qwen3_5Config(text_config=dict(TEXT_CONFIG), vision_config=vision, **special).save_pretrained(
        directory
    )
    qwen3_5_byte_tokenizer().save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN3_PREPROCESSOR))
    return directory


def test_ids_pixels_and_grids_equal_transformers_processor(tmp_path):
    directory = write_directory(tmp_path)
    assert detect_model_kind(directory) == "qwen2_vl"  # the Qwen processor
    layout = read_qwen2_vl_layout(directory)
    assert (layout.model_type, layout.patch_size, layout.image_token_id) == (
        "qwen3_5",
        16,
        IMAGE_ID,
    )
    hf = hf_processor(directory)
    assert type(hf).__name__ == "Qwen3VLProcessor"
    given = [Image.fromarray(make_image(h, w, i, 3)) for i, (h, w) in enumerate(SIZES)]
    given[1] = given[1].convert("L")
    expected = hf(images=given, text=PROMPTS)
    ours = prepare_inputs(directory, PROMPTS, given)
    assert ours.ids == expected["input_ids"]
    assert torch.equal(ours.pixel_values, torch.from_numpy(np.array(expected["pixel_values"])))
    grids = torch.from_numpy(np.array(expected["image_grid_thw"]))
    assert ours.image_grid_thw is not None and torch.equal(ours.image_grid_thw, grids)
    assert sum(row.count(IMAGE_ID) for row in ours.ids) == int(grids.prod(1).sum()) // 4


def test_ids_a_config_leaves_out_are_qwen3_5s(tmp_path):
    layout = read_qwen2_vl_layout(write_directory(tmp_path, ids=False))
    ids = layout.image_token_id, layout.vision_start_token_id, layout.vision_end_token_id
    assert ids == (248_056, 248_053, 248_054)  # transformers' Qwen3_5Config, not Qwen2-VL's


def test_a_prompt_with_more_images_than_given_is_refused(tmp_path):
    directory = write_directory(tmp_path)
    with pytest.raises(ValueError, match="image"):
        prepare_inputs(directory, [MARKER * 2], [Image.fromarray(make_image(8, 8, 0, 3))])


# ---------------------------------------------------------------------- the chat template

THINK_END = "\n</think>\n\n"  # what closes a thinking block before the answer


def conversations() -> dict[str, list[dict]]:
    """Conversations in the forms Qwen3.5's template reads: reasoning inline or in
    ``reasoning_content``, several turns (earlier ones lose their reasoning), a system
    prompt, an image in a list of parts."""
    return {
        "inline": [
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "<think>\nsky\n</think>\n\nblue"},
        ],
        "field": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "It?"}]},
            {"role": "assistant", "content": "a fox", "reasoning_content": " red, small "},
        ],
        "turns": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "<think>greet</think>hello"},
            {"role": "user", "content": "And?"},
            {"role": "assistant", "content": "", "reasoning_content": "old"},
            {"role": "user", "content": "Bye."},
            {"role": "assistant", "content": "bye", "reasoning_content": "end"},
        ],
        "no-reasoning": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "hello"},
        ],
    }


# case -> each assistant turn's targets as text (with its <|im_end|>): the last turn its
# reasoning, the block's end and its answer (the prompt ends in "<think>\n"), earlier turns
# their answer alone.
TARGETS = {
    "inline": ["sky" + THINK_END + "blue<|im_end|>"],
    "field": ["red, small" + THINK_END + "a fox<|im_end|>"],
    "turns": ["hello<|im_end|>", "<|im_end|>", "end" + THINK_END + "bye<|im_end|>"],
    "no-reasoning": [THINK_END + "hello<|im_end|>"],
}


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    from qwen3_helpers import write_qwen3_5_dir

    return write_qwen3_5_dir(tmp_path_factory.mktemp("qwen3_5") / "model")


@pytest.mark.parametrize("case", list(TARGETS))
def test_the_chat_template_renders_as_transformers(qwen3_5_dir, case):
    from fusion.data import ChatTemplate

    template = ChatTemplate.from_directory(qwen3_5_dir)
    hf = hf_processor(qwen3_5_dir)
    messages = conversations()[case]
    assert template.render(messages) == hf.apply_chat_template(messages, tokenize=False)
    prompt = messages[:-1]
    for variables in ({}, {"enable_thinking": False}):
        ours = template.render(prompt, add_generation_prompt=True, **variables)
        theirs = hf.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **variables
        )
        assert ours == theirs
        assert ours.endswith("<think>\n" + ("\n</think>\n\n" if variables else ""))


@pytest.mark.parametrize("case", list(TARGETS))
def test_conversation_labels_are_each_turns_answer_as_rendered(qwen3_5_dir, case):
    from fusion.data import IGNORE_INDEX, ConversationEncoder

    encoder = ConversationEncoder.from_directory(qwen3_5_dir)
    messages = conversations()[case]
    images = [Image.fromarray(make_image(40, 60, 0, 3))] if case == "field" else []
    sample = encoder.encode(messages, images)
    hf = hf_processor(qwen3_5_dir)
    text = hf.apply_chat_template(messages, tokenize=False)
    assert sample.tokens.tolist() == hf(text=[text], images=images or None)["input_ids"][0]
    tokenizer = encoder.tokenizer
    expected = [t for text in TARGETS[case] for t in tokenizer.encode(text).ids]
    assert sample.labels[sample.labels != IGNORE_INDEX].tolist() == expected
    # each target is the next token, and the prompt's "<think>\n" is never one
    targets = (sample.labels != IGNORE_INDEX).nonzero().flatten()
    assert torch.equal(sample.labels[targets], sample.tokens[targets + 1])
    if case == "turns":  # earlier turns lost their reasoning, as the template writes them
        assert "greet" not in text and "old" not in text


def test_without_thinking_the_empty_thinking_block_is_prompt_not_target(qwen3_5_dir):
    """``enable_thinking=False`` (``template_variables``): the template renders a training
    conversation as before, but a prompt then ends with the empty thinking block, so the
    answer alone is trained, as the model is prompted at inference without thinking."""
    from fusion.data import IGNORE_INDEX, ConversationEncoder

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "It?"}]},
        {"role": "assistant", "content": "a fox"},
    ]
    images = [Image.fromarray(make_image(40, 60, 0, 3))]
    off = {"enable_thinking": False}
    encoder = ConversationEncoder.from_directory(qwen3_5_dir, template_variables=off)
    sample = encoder.encode(messages, images)
    hf = hf_processor(qwen3_5_dir)
    text = hf.apply_chat_template(messages, tokenize=False, **off)
    assert text == hf.apply_chat_template(messages, tokenize=False)  # the render is the same
    assert sample.tokens.tolist() == hf(text=[text], images=images)["input_ids"][0]
    tokenizer = encoder.tokenizer
    expected = tokenizer.encode("hello<|im_end|>a fox<|im_end|>").ids
    assert sample.labels[sample.labels != IGNORE_INDEX].tolist() == expected
    # the last prompt, as transformers writes it without thinking, is what precedes the answer
    prompt = hf.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True, **off
    )
    assert prompt.endswith("<think>\n\n</think>\n\n") and text.startswith(prompt)
    with_thinking = ConversationEncoder.from_directory(qwen3_5_dir).encode(messages, images)
    assert torch.equal(with_thinking.tokens, sample.tokens)
    assert with_thinking.num_targets > sample.num_targets  # there the block's end is trained


WORDS = st.text(alphabet="ab01 ", max_size=6).map(str.strip)  # probe-like edges: 0 and 1


@st.composite
def turns(draw) -> tuple[list[dict], list[str]]:
    """A conversation of 1 to 4 user / assistant turns, each answer's reasoning inline, in
    ``reasoning_content`` or absent, and each answer's targets as Qwen3.5's template
    renders them (the last with its thinking block, the earlier without reasoning)."""
    messages: list[dict] = [{"role": "system", "content": "S"}] if draw(st.booleans()) else []
    targets = []
    count = draw(st.integers(1, 4))
    for i in range(count):
        messages.append({"role": "user", "content": draw(WORDS) or "q"})
        answer, reasoning = draw(WORDS), draw(WORDS)
        form = draw(st.sampled_from(["none", "inline", "field"]))
        message = {"role": "assistant", "content": answer}
        if form == "inline":
            message["content"] = f"<think>\n{reasoning}\n</think>\n\n{answer}"
        elif form == "field":
            message["reasoning_content"] = reasoning
        else:
            reasoning = ""
        messages.append(message)
        last = i == count - 1
        targets.append((reasoning + THINK_END if last else "") + answer + "<|im_end|>")
    return messages, targets


@settings(max_examples=60, deadline=None)
@given(conversation=turns())
def test_spans_of_random_conversations_are_each_answer_as_rendered(conversation):
    from fusion.data import ChatTemplate
    from qwen3_helpers import QWEN3_5_CHAT_TEMPLATE

    messages, targets = conversation
    rendered = ChatTemplate(QWEN3_5_CHAT_TEMPLATE).render_with_spans(messages)
    assert [rendered.text[a:b] for a, b in rendered.spans] == targets
