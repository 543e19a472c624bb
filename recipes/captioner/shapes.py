"""A captioned shapes dataset rendered with torch: no files, deterministic from a seed.

Each image shows one shape (circle, square, triangle, cross) in one of several colours, in one
of two sizes, at one of nine places, with a little jitter in position and size and some pixel
noise. Its caption names those four attributes, e.g. ``"a small red circle top left"``.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = {
    "red": (0.90, 0.12, 0.12),
    "green": (0.12, 0.75, 0.20),
    "blue": (0.15, 0.35, 0.95),
    "yellow": (0.95, 0.88, 0.15),
    "purple": (0.60, 0.20, 0.80),
    "white": (0.95, 0.95, 0.95),
}
SIZES = {"small": 0.10, "large": 0.17}  # half-extent as a fraction of the image side
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "center", "right")
_PLACE_FRACTIONS = (0.25, 0.5, 0.75)  # row/column centres as fractions of the image side
_SUPERSAMPLE = 2  # rendered at twice the size, then averaged: smooth edges for small shapes


def place_phrase(row: int, column: int) -> str:
    """``"top left"``, ..., with the middle of the image simply ``"center"``."""
    if ROWS[row] == "middle" and COLUMNS[column] == "center":
        return "center"
    return f"{ROWS[row]} {COLUMNS[column]}"


def caption_words() -> list[str]:
    """Every word a caption can contain, in a fixed order."""
    words = ["a", *SIZES, *COLOURS, *SHAPES]
    for row in range(len(ROWS)):
        for column in range(len(COLUMNS)):
            words += [w for w in place_phrase(row, column).split() if w not in words]
    return words


def max_caption_words() -> int:
    return max(
        4 + len(place_phrase(r, c).split()) for r in range(len(ROWS)) for c in range(len(COLUMNS))
    )


@dataclass(frozen=True)
class ShapesSplit:
    """One split: ``images`` uint8 [n, 3, image_size, image_size], ``attributes`` int64 [n, 5]
    (shape, colour, size, row, column indices) and the ``captions`` they produce."""

    images: torch.Tensor
    attributes: torch.Tensor
    captions: list[str]

    def __len__(self) -> int:
        return len(self.captions)


def num_combinations() -> int:
    return len(SHAPES) * len(COLOURS) * len(SIZES) * len(ROWS) * len(COLUMNS)


def combination_attributes(index: torch.Tensor) -> torch.Tensor:
    """Attribute indices [n, 5] of combination numbers [n] in ``[0, num_combinations())``."""
    sizes = (len(SHAPES), len(COLOURS), len(SIZES), len(ROWS), len(COLUMNS))
    columns = []
    for n in reversed(sizes):
        columns.append(index % n)
        index = index // n
    return torch.stack(columns[::-1], dim=1)


def caption(attributes: torch.Tensor) -> str:
    """The caption of one attribute row [5]."""
    shape, colour, size, row, column = attributes.tolist()
    return (
        f"a {list(SIZES)[size]} {list(COLOURS)[colour]} {SHAPES[shape]} {place_phrase(row, column)}"
    )


def _circle(dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return dx**2 + dy**2 <= 1


def _square(dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return torch.maximum(dx.abs(), dy.abs()) <= 0.85  # about a circle's area


def _triangle(dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return (dy <= 1) & (dx.abs() <= (dy + 1) / 2)  # apex up


def _cross(dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    adx, ady = dx.abs(), dy.abs()
    return ((adx <= 1 / 3) & (ady <= 1)) | ((ady <= 1 / 3) & (adx <= 1))


# Inside-tests in units of the half-extent, one per entry of SHAPES.
_INSIDE = (_circle, _square, _triangle, _cross)


def render(attributes: torch.Tensor, image_size: int, generator: torch.Generator) -> torch.Tensor:
    """Render one image per attribute row.

    Args:
        attributes: int64 [n, 5] (shape, colour, size, row, column indices).
        image_size: side of the square images, in pixels.
        generator: the source of the jitter and noise.

    Returns:
        uint8 images [n, 3, image_size, image_size].
    """
    n = attributes.size(0)
    shape, colour, size, row, column = attributes.unbind(1)
    jitter = (torch.rand(n, 3, generator=generator) - 0.5) * 2  # uniform in [-1, 1)
    places = torch.tensor(_PLACE_FRACTIONS)
    half = torch.tensor(list(SIZES.values()))[size] * (1 + 0.1 * jitter[:, 2])
    cy = places[row] + 0.03 * jitter[:, 0]
    cx = places[column] + 0.03 * jitter[:, 1]

    side = image_size * _SUPERSAMPLE
    grid = (torch.arange(side) + 0.5) / side  # pixel centres in [0, 1]
    mask = torch.zeros(n, side, side)
    for index, inside in enumerate(_INSIDE):
        chosen = (shape == index).nonzero().flatten()  # host-side data generation
        scale = half[chosen, None, None]
        # Offsets from the shape's centre in units of its half-extent: [k, side, 1], [k, 1, side].
        dy = (grid[None, :, None] - cy[chosen, None, None]) / scale
        dx = (grid[None, None, :] - cx[chosen, None, None]) / scale
        mask[chosen] = inside(dx, dy).float()
    mask = F.avg_pool2d(mask[:, None], _SUPERSAMPLE)  # [n, 1, s, s], anti-aliased coverage

    rgb = torch.tensor(list(COLOURS.values()))[colour][:, :, None, None]  # [n, 3, 1, 1]
    background = 0.08 + 0.04 * torch.rand(n, 3, 1, 1, generator=generator)
    image = background + mask * (rgb - background)
    image = image + 0.03 * torch.randn(image.shape, generator=generator)
    return (image.clamp(0, 1) * 255).round().to(torch.uint8)


def make_splits(
    seed: int, num_train: int, num_heldout: int, image_size: int
) -> tuple[ShapesSplit, ShapesSplit]:
    """The train and held-out splits, deterministic from ``seed``.

    Attribute combinations are drawn uniformly for each sample; the held-out images are
    separate renders (their own jitter and noise) never seen in training.

    Raises:
        ValueError: a non-positive count, or an image smaller than 8 pixels.
    """
    for name, value in (("num_train", num_train), ("num_heldout", num_heldout)):
        if value <= 0:
            raise ValueError(f"{name}: expected a positive number of samples, got {value}")
    if image_size < 8:
        raise ValueError(f"image_size: expected at least 8 pixels, got {image_size}")
    generator = torch.Generator().manual_seed(seed)
    splits = []
    for count in (num_train, num_heldout):
        combos = torch.randint(0, num_combinations(), (count,), generator=generator)
        attributes = combination_attributes(combos)
        images = render(attributes, image_size, generator)
        splits.append(ShapesSplit(images, attributes, [caption(a) for a in attributes]))
    return splits[0], splits[1]
