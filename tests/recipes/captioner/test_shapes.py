import pytest
import torch

from recipes.captioner.shapes import (
    COLOURS,
    SHAPES,
    caption,
    caption_words,
    combination_attributes,
    make_splits,
    max_caption_words,
    num_combinations,
    render,
)


def test_splits_are_deterministic_from_the_seed():
    train_a, heldout_a = make_splits(3, 40, 10, 16)
    train_b, heldout_b = make_splits(3, 40, 10, 16)
    other, _ = make_splits(4, 40, 10, 16)
    assert torch.equal(train_a.images, train_b.images)
    assert torch.equal(heldout_a.images, heldout_b.images)
    assert train_a.captions == train_b.captions and heldout_a.captions == heldout_b.captions
    assert not torch.equal(train_a.images, other.images)


def test_split_shapes_and_captions():
    train, heldout = make_splits(0, 50, 20, 24)
    assert train.images.shape == (50, 3, 24, 24) and train.images.dtype == torch.uint8
    assert len(train) == 50 and len(heldout) == 20
    vocabulary = set(caption_words())
    for attributes, text in zip(train.attributes, train.captions, strict=True):
        assert text == caption(attributes)
        words = text.split()
        assert set(words) <= vocabulary and len(words) <= max_caption_words()
        assert words[0] == "a" and words[3] in SHAPES and words[2] in COLOURS


def test_combinations_cover_every_attribute_tuple_once():
    attributes = combination_attributes(torch.arange(num_combinations()))
    assert len({tuple(a) for a in attributes.tolist()}) == num_combinations()
    assert len({caption(a) for a in attributes}) == num_combinations()  # captions identify them


def _one(shape: int, colour: int, size: int, row: int, column: int) -> torch.Tensor:
    attributes = torch.tensor([[shape, colour, size, row, column]])
    return render(attributes, 48, torch.Generator().manual_seed(0))[0].float() / 255


def test_the_image_shows_the_caption():
    red = list(COLOURS).index("red")
    image = _one(SHAPES.index("circle"), red, size=1, row=0, column=0)  # large, top left
    foreground = image.sum(0) > 1.0  # the background is dark, red sums to about 1.2
    ys, xs = foreground.nonzero().float().unbind(1)
    assert foreground.sum() > 50
    assert ys.mean() < 48 / 3 and xs.mean() < 48 / 3  # top left third
    colour = image[:, foreground].mean(1)
    assert colour[0] > 0.7 and colour[1] < 0.3 and colour[2] < 0.3


def test_shapes_and_sizes_differ():
    masks = [(_one(s, 0, 1, 1, 1).sum(0) > 1.0) for s in range(len(SHAPES))]
    for i in range(len(masks)):
        for j in range(i + 1, len(masks)):
            assert (masks[i] ^ masks[j]).sum() > 10, (SHAPES[i], SHAPES[j])
    small = _one(0, 0, 0, 1, 1).sum(0) > 1.0
    assert small.sum() < 0.6 * masks[0].sum()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_train": 0}, "num_train"),
        ({"num_heldout": -1}, "num_heldout"),
        ({"image_size": 4}, "image_size"),
    ],
)
def test_bad_arguments(kwargs, name):
    args = {"seed": 0, "num_train": 4, "num_heldout": 4, "image_size": 16, **kwargs}
    with pytest.raises(ValueError, match=name):
        make_splits(**args)
