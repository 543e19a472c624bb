import pytest
import torch

from fusion.training import EpochSampler
from recipes.captioner.batching import (
    IGNORE_INDEX,
    CaptionDataset,
    encode_captions,
    sequence_length,
)
from recipes.captioner.shapes import caption_words, make_splits, max_caption_words
from recipes.captioner.tokenizer import CaptionTokenizer

T = 4  # image tokens per image


@pytest.fixture
def tokenizer() -> CaptionTokenizer:
    return CaptionTokenizer(caption_words())


def test_sequences_and_loss_masks(tokenizer):
    captions = ["a small red circle center", "a large blue cross bottom right"]
    tokens, labels = encode_captions(tokenizer, captions, T)
    assert tokens.shape == labels.shape == (2, sequence_length(T))
    assert (tokens[:, :T] == tokenizer.image_id).all()
    assert (tokens[:, T] == tokenizer.prompt_id).all()
    for row, text in enumerate(captions):
        target = [*tokenizer.encode(text), tokenizer.eos_id]
        counted = labels[row] != IGNORE_INDEX
        # Loss only on the caption words and <eos>, read from the prompt's last token on.
        assert counted.nonzero().flatten().tolist() == list(range(T, T + len(target)))
        assert labels[row, counted].tolist() == target
        # Each counted label is the next input token (teacher forcing).
        assert tokens[row, T + 1 : T + len(target)].tolist() == target[:-1]
        # Then <eos> (its prediction is not counted) and right padding.
        rest = tokens[row, T + len(target) :].tolist()
        assert rest == ([tokenizer.eos_id] + [tokenizer.pad_id] * len(rest))[: len(rest)]
    assert len(rest) == 0  # the second caption is the longest: nothing after its <eos> target


def test_longest_caption_fits_exactly(tokenizer):
    longest = "a large purple triangle bottom center"
    assert len(longest.split()) == max_caption_words()
    tokens, labels = encode_captions(tokenizer, [longest], T)
    assert labels[0, -1] == tokenizer.eos_id and (tokens != tokenizer.pad_id).all()


def test_too_long_caption_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="captions"):
        encode_captions(tokenizer, ["a large purple triangle bottom center left"], T)


def test_dataset_batch(tokenizer):
    train, _ = make_splits(0, 12, 2, 16)
    dataset = CaptionDataset(train, tokenizer, T)
    indices = torch.tensor([5, 0, 7])
    batch = dataset.batch(indices)
    assert batch.images.dtype == torch.float32 and batch.images.shape == (3, 3, 16, 16)
    assert 0 <= batch.images.min() and batch.images.max() <= 1
    assert torch.equal(batch.tokens, dataset.tokens[indices])
    assert batch.num_targets == int((batch.labels != IGNORE_INDEX).sum())
    assert batch.num_targets == dataset.count_targets(indices)
    expected = sum(len(train.captions[i].split()) + 1 for i in indices.tolist())
    assert batch.num_targets == expected


def test_sampler_epochs_are_permutations_and_positions_compose():
    sampler = EpochSampler(10, seed=1)
    whole = sampler.indices(0, 30)
    for epoch in range(3):
        assert sorted(whole[epoch * 10 : (epoch + 1) * 10].tolist()) == list(range(10))
    assert not torch.equal(whole[:10], whole[10:20])
    # Any position can be read on its own: a resumed run reads what it would have read.
    pieces = torch.cat([EpochSampler(10, 1).indices(s, 7) for s in range(0, 28, 7)])
    assert torch.equal(pieces, whole[:28])
    assert torch.equal(EpochSampler(10, 1).indices(13, 9), whole[13:22])
    assert not torch.equal(EpochSampler(10, 2).indices(0, 10), whole[:10])


def test_sampler_bad_arguments():
    with pytest.raises(ValueError, match="num_samples"):
        EpochSampler(0, seed=0)
    with pytest.raises(ValueError, match="start"):
        EpochSampler(4, seed=0).indices(-1, 2)
