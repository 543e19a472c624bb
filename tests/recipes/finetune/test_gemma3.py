"""The recipe on Gemma 3 (issue 38, item 6): its chat template as its directories carry it,
rendered as transformers renders it (a system message folded into the first user turn,
``model`` turns), a conversation whose roles do not alternate refused by the template with
the sample named; every ``--train`` mode on a vision directory, packed as padded, and the
full fine-tune's ``final/`` loaded by transformers with our logits. The first loss against
transformers' is the family suite's (``tests/families/test_recipe.py``)."""

import json

import pytest
import torch

from fusion.data import ChatTemplate, ConversationEncoder, DataError, read_conversations
from gemma3_helpers import gemma3_tokenizer, write_gemma3_text_dir
from recipes.finetune import main

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": " And then? "}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Bye."}]},
]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return write_gemma3_text_dir(tmp_path_factory.mktemp("gemma3") / "model")


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_renders_as_transformers(directory, generation_prompt):
    messages = CONVERSATION[:-1] if generation_prompt else CONVERSATION
    theirs = gemma3_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    ours = ChatTemplate.from_directory(directory).render(
        messages, add_generation_prompt=generation_prompt
    )
    assert ours == theirs
    assert ours.startswith("<bos><start_of_turn>user\nBe brief.\n\nHi there.<end_of_turn>\n")


def test_the_labels_are_the_model_turns(directory):
    encoder = ConversationEncoder.from_directory(directory)
    sample = encoder.encode(CONVERSATION)
    targets = sample.labels[sample.labels >= 0].tolist()
    tokenizer = gemma3_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    expected = [*tokenizer.encode("Hello.", add_special_tokens=False), end]
    expected += [*tokenizer.encode("Bye.", add_special_tokens=False), end]
    assert targets == expected


def test_roles_that_do_not_alternate_are_refused_naming_the_sample(directory, tmp_path, ft, capsys):
    records = [
        {"messages": CONVERSATION[1:3]},
        {"messages": [CONVERSATION[1], CONVERSATION[3], CONVERSATION[2]]},  # user, user
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    encoder = ConversationEncoder.from_directory(directory)
    conversations = read_conversations(data).conversations
    encoder.encode_conversation(conversations[0])
    with pytest.raises(DataError, match=r"train\.jsonl:2: .*roles must alternate"):
        encoder.encode_conversation(conversations[1])
    capsys.readouterr()
    assert main(ft.recipe_args(directory, data, tmp_path / "run", "--steps", "1")) != 0
    error = capsys.readouterr().err
    assert f"--data: {data}:2: chat template: TemplateError: Conversation roles must" in error
    assert not (tmp_path / "run" / "final").exists()


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory):
    """A Gemma 3 vision directory and three image conversations."""
    import numpy as np
    from PIL import Image

    from gemma3_helpers import write_gemma3_dir

    root = tmp_path_factory.mktemp("gemma3_vision")
    directory = write_gemma3_dir(root / "model")
    records = []
    for i in range(3):
        pixels = np.random.default_rng(i).integers(0, 256, (24, 40, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"img{i}.png")
        question = [{"type": "image", "path": f"img{i}.png"}, {"type": "text", "text": "What?"}]
        answer = [{"type": "text", "text": f"thing {i}"}]
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        records.append({"messages": turns})
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory, data, root


@pytest.mark.parametrize("train", ["full", "lora", "projector"])
def test_every_train_mode_trains_packed_as_padded(vision_run, ft, train):
    directory, data, root = vision_run
    losses = []
    for packing in ([], ["--no-packing"]):
        out = root / f"{train}{len(packing)}"
        argv = ft.recipe_args(directory, data, out, "--steps", "2", "--train", train, *packing)
        assert main(argv) == 0
        losses.append(ft.metrics(out)["losses"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[0][1] < losses[0][0]
    if train != "full":
        return
    from transformers import Gemma3ForConditionalGeneration

    from fusion.checkpoint import load_hf_model
    from fusion.preprocessing import VisionLanguageProcessor, load_image

    final = root / "full0" / "final"
    hf = Gemma3ForConditionalGeneration.from_pretrained(final).eval()
    before = Gemma3ForConditionalGeneration.from_pretrained(directory).eval()
    inputs = VisionLanguageProcessor.from_directory(final)(
        "What <start_of_image>?", [load_image(root / "img0.png")]
    )
    tokens = torch.tensor(inputs.ids)
    image_id = hf.config.image_token_index
    theirs = {"pixel_values": inputs.pixel_values, "token_type_ids": (tokens == image_id).long()}
    with torch.no_grad():
        ours = load_hf_model(final).eval()(tokens, encoder_input=inputs.encoder_input())
        expected = hf(input_ids=tokens, **theirs).logits
        untrained = before(input_ids=tokens, **theirs).logits
    assert (ours - expected).abs().max() <= 1e-4
    assert (untrained - expected).abs().max() > 1e-3
