"""Conversations -> samples: ids and pixels equal to transformers' ``apply_chat_template`` with
the model's processor (LLaVA, Idefics3, SmolVLM) or tokenizer (Llama), labels on the
assistant's tokens and end-of-turn token only."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusion.data import (
    IGNORE_INDEX,
    ChatTemplate,
    ChatTemplateError,
    ConversationEncoder,
    DataError,
    Sample,
    encode_conversations,
    fit_sample,
    read_conversations,
)
from vlm_helpers import CHARS, IMAGE_ID

VLMS = ("llava", "idefics3", "smolvlm")
ANSWERS = ("A cat.", "A dog, twice!")


def image_conversation(names):
    return {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "content": [{"type": "image", "path": names[0]}, {"type": "text", "text": "What?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[0]}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "And these"},
                    {"type": "image", "path": names[1]},
                    {"type": "image", "path": names[2]},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[1]}]},
        ]
    }


def text_conversation():
    return {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
        ]
    }


def targets(sample: Sample) -> list[int]:
    """The ids the labels ask for, in order."""
    return sample.labels[sample.labels != IGNORE_INDEX].tolist()


def target_positions(sample: Sample) -> list[int]:
    """Positions of the tokens that are targets."""
    return [t + 1 for t in range(len(sample)) if sample.labels[t] != IGNORE_INDEX]


@pytest.fixture
def data_file(tmp_path, write_images, write_jsonl):
    names = write_images(tmp_path, [(20, 30), (45, 13), (16, 16)])
    return write_jsonl(tmp_path / "train.jsonl", [image_conversation(names), text_conversation()])


@pytest.mark.parametrize("family", VLMS)
def test_vlm_ids_pixels_and_labels_equal_transformers(model_dirs, family, data_file):
    directory, processor = model_dirs[family]
    encoder = ConversationEncoder.from_directory(directory)
    conversations = read_conversations(data_file).conversations
    llava = family == "llava"  # its template marks the assistant with {% generation %}
    for conversation in conversations:
        sample = encoder.encode_conversation(conversation)
        expected = processor.apply_chat_template(
            conversation.messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=llava,
        )
        ids = np.asarray(expected["input_ids"]).reshape(-1).tolist()
        assert sample.tokens.tolist() == ids
        assert sample.source == conversation.source
        images = len(conversation.images)
        assert (sample.tokens == IMAGE_ID).sum() == (16 * len(sample.pixel_values))
        if images:
            pixels = torch.as_tensor(np.asarray(expected["pixel_values"]))
            pixels = pixels.flatten(0, -4)
            pixels = pixels[pixels.flatten(1).any(1)]  # Idefics3 pads tiles per image
            assert sample.pixel_values.shape == pixels.shape
            assert (sample.pixel_values - pixels).abs().max() <= 1e-5
        else:
            assert sample.pixel_values.shape[0] == 0
        tokenizer = processor.tokenizer
        if llava:  # transformers' own assistant mask
            mask = np.asarray(expected["assistant_masks"]).reshape(-1)
            assert target_positions(sample) == np.flatnonzero(mask).tolist()
        else:  # the assistant's text after the header "Assistant:", and <end_of_utterance>
            answers = [
                m["content"][0]["text"] for m in conversation.messages if m["role"] == "assistant"
            ]
            expected_targets = [
                i
                for answer in answers
                for i in tokenizer.encode(f" {answer}<end_of_utterance>", add_special_tokens=False)
            ]
            assert targets(sample) == expected_targets
        assert IMAGE_ID not in targets(sample)
        assert sample.labels[-1] == IGNORE_INDEX


def test_llava_labels_are_answers_and_eos(model_dirs, data_file):
    directory, processor = model_dirs["llava"]
    encoder = ConversationEncoder.from_directory(directory)
    sample = encoder.encode_conversation(read_conversations(data_file).conversations[0])
    text = processor.tokenizer.decode(targets(sample)).replace(" ", "")
    assert text == "".join(f"{a}</s>" for a in ANSWERS).replace(" ", "")


def test_llama_tokenizer_only(model_dirs):
    directory, tokenizer = model_dirs["llama"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": " Bye! "},
    ]
    encoder = ConversationEncoder.from_directory(directory)
    assert encoder.processor is None and encoder.placeholder_ids == ()
    sample = encoder.encode(messages)
    expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
    assert sample.tokens.tolist() == list(expected["input_ids"])
    assert sample.tokens[0] == tokenizer.bos_token_id  # the template's, not added again
    expected_targets = tokenizer.encode("Hello.<|eot_id|>Bye!<|eot_id|>", add_special_tokens=False)
    assert targets(sample) == expected_targets
    assert sample.pixel_values.numel() == 0
    with pytest.raises(ValueError, match="1 given, but the model is text-only"):
        encoder.encode(messages, [torch.zeros(3, 4, 4, dtype=torch.uint8)])


def test_llava_format_file_equals_messages_format(model_dirs, tmp_path, write_images, write_jsonl):
    directory, processor = model_dirs["idefics3"]
    names = write_images(tmp_path, [(20, 30)])
    llava = {
        "image": names[0],
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"},
            {"from": "gpt", "value": "A cat."},
        ],
    }
    file = write_jsonl(tmp_path / "llava.jsonl", [llava])
    (conversation,) = read_conversations(file).conversations
    sample = ConversationEncoder.from_directory(directory).encode_conversation(conversation)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": str(tmp_path / names[0])},
                {"type": "text", "text": "What is it?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    ]
    expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True)
    assert sample.tokens.tolist() == np.asarray(expected["input_ids"]).reshape(-1).tolist()


def test_encode_conversations_fits_truncates_and_skips(
    model_dirs, tmp_path, write_images, write_jsonl
):
    directory, _ = model_dirs["llava"]
    names = write_images(tmp_path, [(20, 30)])
    long_answer = "word " * 40
    records = [
        text_conversation(),
        {
            "image": names[0],
            "conversations": [
                {"from": "human", "value": "<image>Describe."},
                {"from": "gpt", "value": long_answer},
            ],
        },
    ]
    file = write_jsonl(tmp_path / "train.jsonl", records)
    conversations = read_conversations(file).conversations
    encoder = ConversationEncoder.from_directory(directory)
    full = encoder.encode_conversation(conversations[1])
    limit = len(full) - 20
    with pytest.raises(
        DataError, match=rf"train\.jsonl:2: {len(full)} tokens, longer than max_seq_len={limit}"
    ):
        encode_conversations(encoder, conversations, max_seq_len=limit)
    data = encode_conversations(encoder, conversations, max_seq_len=limit, truncate=True)
    assert data.truncated == 1 and not data.skipped
    cut = data.samples[1]
    assert cut.truncated and len(cut) == limit
    assert torch.equal(cut.tokens, full.tokens[:limit])
    assert torch.equal(cut.labels[:-1], full.labels[: limit - 1])
    assert cut.labels[-1] == IGNORE_INDEX
    assert torch.equal(encoder.load_pixels([cut])[0].pixel_values, full.pixel_values)
    data = encode_conversations(encoder, conversations, max_seq_len=limit, skip_bad=True)
    assert len(data.samples) == 1 and len(data.skipped) == 1
    assert data.skipped[0].line == 2
    # A cut through the image placeholders, or leaving no answer token, is refused.
    with pytest.raises(ValueError, match="would cut image placeholders"):
        fit_sample(full, 10, truncate=True, placeholder_ids=[IMAGE_ID])
    prompt_end = target_positions(full)[0]
    with pytest.raises(ValueError, match="leaves no answer token"):
        fit_sample(full, prompt_end, truncate=True, placeholder_ids=[IMAGE_ID])
    with pytest.raises(ValueError, match="max_seq_len: expected an integer >= 2"):
        fit_sample(full, 1)
    with pytest.raises(ValueError, match="max_seq_len: expected an integer >= 2, got '8'"):
        encode_conversations(encoder, [], max_seq_len="8")


def test_conversation_problems_found_at_encoding(model_dirs, tmp_path, write_images, write_jsonl):
    directory, _ = model_dirs["llava"]
    names = write_images(tmp_path, [(20, 30)])
    file = write_jsonl(tmp_path / "bad.jsonl", [text_conversation(), image_conversation(names * 3)])
    conversations = read_conversations(file).conversations
    encoder = ConversationEncoder.from_directory(directory)
    special = encoder.template.special_tokens
    # A template that drops the assistant's turns: nothing to train on.
    encoder.template = ChatTemplate(
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['role'] }}: "
        "{{ m['content'][0]['text'] }}{% endif %}{% endfor %}",
        special_tokens=special,
    )
    with pytest.raises(DataError, match=r"bad\.jsonl:1: chat template: renders no assistant turn"):
        encoder.encode_conversation(conversations[0])
    # A template that shows no image: the markers do not match the images.
    encoder.template = ChatTemplate(
        "{% for m in messages %}{{ m['role'] }}{% for c in m['content'] %}"
        "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}",
        special_tokens=special,
    )
    with pytest.raises(
        DataError, match=r"bad\.jsonl:2: prompts: 0 image marker\(s\).*3 image\(s\)"
    ):
        encoder.encode_conversation(conversations[1])
    data = encode_conversations(encoder, conversations, max_seq_len=512, skip_bad=True)
    assert [e.line for e in data.skipped] == [2] and len(data.samples) == 1
    with pytest.raises(DataError, match=r"bad\.jsonl: no usable conversation \(first: .*:2: "):
        encode_conversations(encoder, conversations[1:], max_seq_len=512, skip_bad=True)


def test_missing_tokenizer(tmp_path, model_dirs):
    from fusion.checkpoint import CheckpointError

    directory, _ = model_dirs["llama"]
    for name in ("config.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing"):
        ConversationEncoder.from_directory(tmp_path)
    os.mkfifo(tmp_path / "tokenizer.json")  # would block a plain open
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a regular file"):
        ConversationEncoder.from_directory(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: unreadable tokenizer"):
        ConversationEncoder.from_directory(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ConversationEncoder.from_directory(tmp_path)


TEXT = st.text(alphabet=CHARS, max_size=12)


@st.composite
def chats(draw, list_content: bool):
    """Alternating user / assistant turns of random text (spaces and newlines included)."""
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        for role in ("user", "assistant"):
            text = draw(TEXT)
            content = [{"type": "text", "text": text}] if list_content else text
            messages.append({"role": role, "content": content})
    return messages


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=chats(list_content=True))
def test_random_llava_chats_equal_transformers(model_dirs, messages):
    directory, processor = model_dirs["llava"]
    sample = ConversationEncoder.from_directory(directory).encode(messages)
    expected = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert sample.tokens.tolist() == np.asarray(expected["input_ids"]).reshape(-1).tolist()
    mask = np.asarray(expected["assistant_masks"]).reshape(-1)
    assert target_positions(sample) == np.flatnonzero(mask).tolist()


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=chats(list_content=False))
def test_random_llama_chats_equal_transformers(model_dirs, messages):
    directory, tokenizer = model_dirs["llama"]
    sample = ConversationEncoder.from_directory(directory).encode(messages)
    expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
    assert sample.tokens.tolist() == list(expected["input_ids"])
    # The template trims each message: the targets are each trimmed answer and <|eot_id|>.
    answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    expected_targets = [
        i
        for answer in answers
        for i in tokenizer.encode(answer + "<|eot_id|>", add_special_tokens=False)
    ]
    assert targets(sample) == expected_targets


def test_packed_idefics3_samples_equal_alone(
    model_dirs, tmp_path, write_images, write_jsonl, one_thread
):
    """Samples encoded from a real directory (tiles of several sizes) and packed: each one's
    logits are those it gets alone, so its images' rows landed at its own placeholders."""
    from fusion.checkpoint import load_hf_vlm
    from fusion.data import collate_packed, pack_samples
    from vlm_helpers import tiny_hf_idefics3

    directory, _ = model_dirs["idefics3"]
    model_dir = tmp_path / "model"
    shutil.copytree(directory, model_dir)
    tiny_hf_idefics3().save_pretrained(model_dir)
    names = write_images(tmp_path, [(20, 30), (45, 13), (16, 16)])
    file = write_jsonl(tmp_path / "train.jsonl", [image_conversation(names), text_conversation()])
    file.write_text(file.read_text() + json.dumps(hf_one_image(names[1])) + "\n")
    encoder = ConversationEncoder.from_directory(model_dir)
    samples = [encoder.encode_conversation(c) for c in read_conversations(file).conversations]
    model = load_hf_vlm(model_dir).eval()
    rows = pack_samples(samples, max_seq_len=512)
    # [486, 31, 103] tokens: the text-only sample, then the one-image one, share row 1.
    assert [[len(s) for s in row] for row in rows] == [[486], [31, 103]]
    batch = collate_packed(rows, pad_id=0)
    pixels = torch.cat([s.pixel_values for s in samples if len(s.pixel_values)])
    assert torch.equal(batch.encoder_input["image"]["pixel_values"], pixels)
    with torch.no_grad():
        packed = model(**batch.model_inputs())
        for r, row in enumerate(rows):
            start = 0
            for sample in row:
                images = {"image": {"pixel_values": sample.pixel_values}}
                alone = model(
                    sample.tokens[None], encoder_input=images if len(sample.pixel_values) else None
                )[0]
                torch.testing.assert_close(
                    packed[r, start : start + len(sample)], alone, atol=1e-5, rtol=0
                )
                start += len(sample)


def hf_one_image(name):
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "path": name}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Tall."}]},
        ]
    }


def test_processor_must_use_the_encoders_encode(model_dirs):
    from fusion.preprocessing import VisionLanguageProcessor

    directory, _ = model_dirs["llava"]
    built = ConversationEncoder.from_directory(directory)
    foreign = VisionLanguageProcessor.from_directory(directory)  # tokenizes on its own
    encoder = ConversationEncoder(built.template, built.tokenizer, processor=foreign)
    with pytest.raises(RuntimeError, match="its encode is not this encoder's"):
        encoder.encode(text_conversation()["messages"])


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_encode_conversations_keeps_no_pixels(
    model_dirs, family, tmp_path, write_images, write_jsonl, monkeypatch
):
    """Encoding N image samples processes no image and keeps no pixels (only paths and
    sizes); load_pixels makes exactly one batch's pixels, bitwise those encode makes, and a
    file changed since the check is refused by name."""
    import fusion.preprocessing

    directory, _ = model_dirs[family]
    sizes = [(20, 30), (45, 13), (16, 16), (33, 70), (8, 9), (64, 40)]
    names = write_images(tmp_path, sizes)
    file = write_jsonl(tmp_path / "train.jsonl", [hf_one_image(n) for n in names])
    conversations = read_conversations(file).conversations
    encoder = ConversationEncoder.from_directory(directory)
    processed, decoded = [], []
    image_processor = type(encoder.processor.image_processor)
    process = image_processor.process
    load_image = fusion.preprocessing.load_image

    def counting_process(self, image, name="image"):
        processed.append(name)
        return process(self, image, name)

    monkeypatch.setattr(image_processor, "process", counting_process)

    def counting_load(path, **kwargs):
        decoded.append(path)
        return load_image(path, **kwargs)

    monkeypatch.setattr(fusion.preprocessing, "load_image", counting_load)
    data = encode_conversations(encoder, conversations, max_seq_len=1024)
    assert not processed  # no image processed ...
    assert len(decoded) == len(sizes)  # ... each decoded once, to check it
    assert all(s.pixel_values.numel() == 0 and not s.pixels_loaded for s in data.samples)
    assert [(r.height, r.width) for s in data.samples for r in s.images] == sizes
    from fusion.data import collate_packed

    with pytest.raises(
        ValueError, match=r"rows\[0\]\[0\]: .*train\.jsonl:1 has images or videos whose"
    ):
        collate_packed([data.samples[:1]], pad_id=0)
    decoded.clear()
    batch = encoder.load_pixels(data.samples[2:4])
    assert len(processed) == 2 and len(decoded) == 2  # that batch's images only
    for conversation, lazy, loaded in zip(
        conversations[2:4], data.samples[2:4], batch, strict=True
    ):
        eager = encoder.encode_conversation(conversation)
        assert torch.equal(lazy.tokens, eager.tokens) and torch.equal(lazy.labels, eager.labels)
        assert torch.equal(loaded.pixel_values, eager.pixel_values)
        assert sum(r.tiles for r in lazy.images) == eager.pixel_values.size(0)
    with pytest.raises(ValueError, match="images: expected a tuple of ImageRef, got list"):
        Sample(lazy.tokens, lazy.labels, lazy.pixel_values, images=list(lazy.images))
    write_images(tmp_path, [(10, 10)])  # img0.png replaced by an image of another size
    with pytest.raises(ValueError, match=r"train\.jsonl:1: image .*img0\.png.* now 10 x 10"):
        encoder.load_pixels(data.samples[:1])


@pytest.mark.parametrize("family", ["idefics3", "llama"])
def test_one_encoder_from_several_threads_equals_one_by_one(model_dirs, family):
    """Encoding is a function of its inputs: one encoder, no guard, different conversations
    (answers, image counts and sizes, BOS or not) encoded from four threads at once give
    exactly the samples encoding them one by one gives."""
    import sys
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from vlm_helpers import make_image

    rounds = 20

    directory, _ = model_dirs[family]
    encoder = ConversationEncoder.from_directory(directory)
    vlm = family != "llama"
    cases = []
    for i in range(12):
        answer = "xy z." * (1 + i % 4) if i % 3 else "Hi!"
        images = [
            torch.from_numpy(make_image(9 + 7 * k + i, 30 - k - i, i + k)).permute(2, 0, 1)
            for k in range(i % 3 if vlm else 0)
        ]
        question = [{"type": "text", "text": f"Q{i}?"}] + [{"type": "image"} for _ in images]
        if not vlm:
            question = f"Q{i}?"
        reply = [{"type": "text", "text": answer}] if vlm else answer
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        cases.append((messages, images))
    alone = [encoder.encode(m, images, str(i)) for i, (m, images) in enumerate(cases)]
    start = threading.Barrier(4)

    def encode_all(shift):
        start.wait()  # all at once
        order = [(i + shift) % len(cases) for i in range(len(cases))] * rounds
        return [(i, encoder.encode(*cases[i], str(i))) for i in order]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: races show
    try:
        with ThreadPoolExecutor(4) as pool:
            results = [r for done in pool.map(encode_all, (0, 3, 6, 9)) for r in done]
    finally:
        sys.setswitchinterval(interval)
    assert len(results) == 4 * rounds * len(cases)
    for i, sample in results:
        assert torch.equal(sample.tokens, alone[i].tokens)
        assert torch.equal(sample.labels, alone[i].labels)
        assert torch.equal(sample.pixel_values, alone[i].pixel_values)
        assert sample.source == alone[i].source
