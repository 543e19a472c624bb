"""Gemma 3's chat template as its directories carry it (issue 38, item 6): rendered as
transformers renders it (a system message folded into the first user turn, ``model`` turns),
and a conversation whose roles do not alternate refused by the template, the error naming the
sample; the recipe's first loss on Gemma 3 1B-style directories is the family suite's
(``tests/families/test_recipe.py``)."""

import json

import pytest

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
