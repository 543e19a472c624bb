"""A run's data made ready (fusion.data.prepare): a file read and encoded whole with both
steps' skipped conversations kept, a one-line summary of what was dropped, and the pad id
checked against the model's vocabulary, naming the file the token comes from."""

import json
from types import SimpleNamespace

import pytest

from fusion.data import ConversationEncoder, DataError, EncodedData
from fusion.data.prepare import pad_token_id, read_encoded, skipped_summary


def conversation(answer: str = "Hi.", prompt: str = "Say hi") -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": prompt}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


def test_a_file_is_read_and_encoded_whole_with_both_steps_skips(model_dirs, tmp_path, write_jsonl):
    directory, _ = model_dirs["llama"]
    encoder = ConversationEncoder.from_directory(directory)
    # Line 2's prompt alone is longer than the limit (encoding refuses it), line 3 is no JSON
    # (reading refuses it), line 4's answer is cut.
    long = "word " * 40
    records = [conversation(), conversation(prompt=long), "{not json", conversation(long)]
    file = write_jsonl(tmp_path / "train.jsonl", [*records, conversation()])
    with pytest.raises(DataError, match=r"train\.jsonl:3: "):  # reading comes first
        read_encoded(encoder, file, max_seq_len=512)
    limit = len(read_encoded(encoder, file, max_seq_len=512, skip_bad=True).samples[0]) + 10
    with pytest.raises(DataError, match=r"ok\.jsonl:2: .* longer than max_seq_len"):
        read_encoded(encoder, write_jsonl(tmp_path / "ok.jsonl", records[:2]), max_seq_len=limit)
    data = read_encoded(encoder, file, max_seq_len=limit, truncate=True, skip_bad=True)
    assert len(data.samples) == 3 and data.truncated == 1
    # Reading's skipped conversation (line 3) first, then encoding's (line 2).
    assert [error.line for error in data.skipped] == [3, 2]
    summary = skipped_summary(data)
    assert summary is not None
    assert summary.startswith("3 conversations; skipped 2 bad ones, truncated 1 (first skipped: ")
    assert f"{file}:3: " in summary
    assert skipped_summary(EncodedData(data.samples[:1])) is None


class Tokens:
    """Stands in for a tokenizers.Tokenizer: ids of known tokens, None for others."""

    def __init__(self, ids: dict[str, int]) -> None:
        self.ids = ids

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)


def encoder(special: dict[str, str], ids: dict[str, int]) -> ConversationEncoder:
    template = SimpleNamespace(special_tokens=special)
    return SimpleNamespace(template=template, tokenizer=Tokens(ids))  # type: ignore[return-value]


def test_the_pad_token_else_eos_else_zero(tmp_path):
    ids = {"<pad>": 3, "</s>": 2}
    assert pad_token_id(encoder({"pad_token": "<pad>", "eos_token": "</s>"}, ids), 8, tmp_path) == 3
    assert pad_token_id(encoder({"eos_token": "</s>"}, ids), 8, tmp_path) == 2
    assert (
        pad_token_id(encoder({"pad_token": "<unknown>", "eos_token": "</s>"}, ids), 8, tmp_path)
        == 2
    )
    assert pad_token_id(encoder({}, ids), 8, tmp_path) == 0


@pytest.mark.parametrize(
    ("files", "source"),
    [
        ({"tokenizer_config.json": {"pad_token": "<pad>"}}, "tokenizer_config.json"),
        (
            {
                "tokenizer_config.json": {"bos_token": "<s>"},
                "special_tokens_map.json": {"pad_token": "<pad>"},
            },
            "special_tokens_map.json",
        ),
        ({"tokenizer_config.json": "[not an object"}, "the tokenizer's"),
    ],
)
def test_a_pad_token_outside_the_vocabulary_is_refused_naming_its_file(files, source, tmp_path):
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (tmp_path / name).write_text(text)
    outside = encoder({"pad_token": "<pad>", "eos_token": "</s>"}, {"<pad>": 130, "</s>": 2})
    message = (
        f"{source} pad_token '<pad>' is id 130 in tokenizer.json, outside the model's vocabulary "
        "[0, 128) (config.json vocab_size): no embedding row pads with it; set pad_token to a "
        "token of the vocabulary"
    )
    with pytest.raises(ValueError) as info:
        pad_token_id(outside, 128, tmp_path)  # the EOS token is not taken instead
    assert str(info.value) == message


@pytest.mark.parametrize("vocab_size", [0, -1, True, 2.0])
def test_a_bad_vocabulary_size_is_refused(vocab_size, tmp_path):
    with pytest.raises(ValueError, match="vocab_size: expected a positive integer"):
        pad_token_id(encoder({}, {}), vocab_size, tmp_path)
