import pytest
import torch

from recipes.captioner.shapes import (
    COLOUR_ANCHORS,
    COLOURS,
    MIN_CONTRAST,
    SHAPES,
    backgrounds,
    caption,
    caption_words,
    combination_attributes,
    make_splits,
    max_caption_words,
    num_combinations,
    render,
    shape_colours,
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


def _foreground(image: torch.Tensor) -> torch.Tensor:
    """Pixels far from the image's median colour (its background)."""
    background = image.flatten(1).median(1).values[:, None, None]
    return (image - background).norm(dim=0) > 0.3


def test_the_image_shows_the_caption():
    red = list(COLOURS).index("red")
    image = _one(SHAPES.index("circle"), red, size=1, row=0, column=0)  # large, top left
    foreground = _foreground(image)
    ys, xs = foreground.nonzero().float().unbind(1)
    assert foreground.sum() > 50
    assert ys.mean() < 48 / 3 and xs.mean() < 48 / 3  # top left third
    colour = image[:, foreground].mean(1)
    assert colour[0] > 0.7 and colour[1] < 0.3 and colour[2] < 0.3


def test_shapes_and_sizes_differ():
    masks = [_foreground(_one(s, 0, 1, 1, 1)) for s in range(len(SHAPES))]
    for i in range(len(masks)):
        for j in range(i + 1, len(masks)):
            assert (masks[i] ^ masks[j]).sum() > 10, (SHAPES[i], SHAPES[j])
    small = _foreground(_one(0, 0, 0, 1, 1))
    assert small.sum() < 0.6 * masks[0].sum()


def test_backgrounds_vary_and_always_contrast_with_the_shape():
    generator = torch.Generator().manual_seed(0)
    colours = shape_colours(torch.arange(6).repeat(500), generator)
    chosen = backgrounds(colours, generator)
    assert bool(((chosen - colours).norm(dim=1) >= MIN_CONTRAST).all())
    grey = (chosen.max(1).values - chosen.min(1).values) < 0.1
    assert (grey & (chosen.mean(1) < 0.2)).sum() > 500  # dark
    assert (grey & (chosen.mean(1) > 0.8)).sum() > 500  # light
    assert (chosen == 0).all(1).sum() > 50 and (chosen == 1).all(1).sum() > 50  # black, white
    assert (~grey).sum() > 500  # coloured
    # White shapes get no light grey background; every colour covers Pillow's colour of its
    # name.
    assert not bool((grey & (chosen.mean(1) > 0.8))[5::6].any())
    assert bool((colours[5::6] > 0.85).all())
    for index, name in enumerate(COLOURS):
        near = (colours[index::6] - torch.tensor(COLOUR_ANCHORS[name][0])).norm(dim=1)
        assert near.min() < 0.1, name


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
