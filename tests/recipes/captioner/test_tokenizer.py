import pytest

from recipes.captioner.shapes import caption_words
from recipes.captioner.tokenizer import CaptionTokenizer


@pytest.fixture
def tokenizer() -> CaptionTokenizer:
    return CaptionTokenizer(caption_words())


def test_round_trip_and_ids(tokenizer):
    text = "a large blue cross bottom right"
    ids = tokenizer.encode(text)
    assert len(ids) == 6 and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.pad_id == 0
    assert len({tokenizer.pad_id, tokenizer.eos_id, tokenizer.prompt_id}) == 3


def test_image_placeholder_is_outside_the_text_vocabulary(tokenizer):
    assert tokenizer.image_id == tokenizer.vocab_size
    with pytest.raises(ValueError, match="ids"):
        tokenizer.decode([tokenizer.image_id])


def test_decode_stops_at_eos_and_keeps_other_specials(tokenizer):
    ids = tokenizer.encode("a small red circle")
    assert tokenizer.decode([*ids, tokenizer.eos_id, *ids]) == "a small red circle"
    assert tokenizer.decode([tokenizer.pad_id, *ids]) == "<pad> a small red circle"


def test_unknown_words_are_named(tokenizer):
    with pytest.raises(ValueError, match=r"\['hexagon'\]"):
        tokenizer.encode("a small red hexagon")


@pytest.mark.parametrize("words", [["a", "a"], ["two words"], ["<eos>"], [""]])
def test_bad_vocabularies(words):
    with pytest.raises(ValueError, match="words"):
        CaptionTokenizer(words)
