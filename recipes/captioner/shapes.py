"""A captioned shapes dataset rendered with torch, deterministic from a seed: each image shows
one filled shape (circle, square, triangle, cross) of six colours, two sizes and nine places
on a dark, light or coloured background, plain or noisy, and its caption names the four, e.g.
``"a small red circle top left"`` (the ranges: docs/captioner.md, "What it knows")."""

import math
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
# Each colour also spans the line to Pillow's colour of that name ("red" is (255, 0, 0), "green"
# (0, 128, 0), "purple" (128, 0, 128)) and, for green, to (0, 255, 0): what a user draws with.
COLOUR_ANCHORS = {
    "red": ((1.0, 0.0, 0.0),),
    "green": ((0.0, 0.5, 0.0), (0.0, 1.0, 0.0)),
    "blue": ((0.0, 0.0, 1.0),),
    "yellow": ((1.0, 1.0, 0.0),),
    "purple": ((0.5, 0.0, 0.5),),
    "white": ((1.0, 1.0, 1.0),),
}
SIZES = {"small": 0.10, "large": 0.17}  # half-extent as a fraction of the image side
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "center", "right")
_COUNTS = (len(SHAPES), len(COLOURS), len(SIZES), len(ROWS), len(COLUMNS))  # of each attribute
_PLACE_FRACTIONS = (0.25, 0.5, 0.75)  # row/column centres as fractions of the image side
_SUPERSAMPLE = 2  # rendered at twice the size, then averaged: smooth edges for small shapes
SIZE_JITTER = 0.15  # a shape's half-extent is SIZES[size] * (1 +- SIZE_JITTER)
PLACE_JITTER = 0.06  # a shape's centre is within this of its place, in each direction
COLOUR_JITTER = 0.06  # then each channel moves by up to this
NOISE_LEVELS = (0.0, 0.03, 0.08)  # standard deviations of the pixel noise, one drawn per image
# Backgrounds are at least this far (RGB distance, channels in [0, 1]) from the shape's colour:
# a white shape on a white background shows nothing to caption.
MIN_CONTRAST = 0.45
_BACKGROUND_TRIES = 6


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
    """``images`` uint8 [n, 3, image_size, image_size], ``attributes`` int64 [n, 5] (shape,
    colour, size, row, column indices) and the ``captions`` they produce."""

    images: torch.Tensor
    attributes: torch.Tensor
    captions: list[str]

    def __len__(self) -> int:
        return len(self.captions)


def num_combinations() -> int:
    return math.prod(_COUNTS)


def combination_attributes(index: torch.Tensor) -> torch.Tensor:
    """Attribute indices [n, 5] of combination numbers [n] in ``[0, num_combinations())``."""
    return torch.stack(torch.unravel_index(index, _COUNTS), dim=1)


def caption(attributes: torch.Tensor) -> str:
    """The caption of one attribute row [5]."""
    shape, colour, size, row, column = attributes.tolist()
    return (
        f"a {list(SIZES)[size]} {list(COLOURS)[colour]} {SHAPES[shape]} {place_phrase(row, column)}"
    )


def _circle(dx: torch.Tensor, dy: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return dx**2 + dy**2 <= 1


def _square(dx: torch.Tensor, dy: torch.Tensor, form: torch.Tensor) -> torch.Tensor:
    # Half-side 0.78-0.92 of the half-extent: about a circle's area.
    return torch.maximum(dx.abs(), dy.abs()) <= 0.85 + 0.07 * form


def _triangle(dx: torch.Tensor, dy: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return (dy <= 1) & (dx.abs() <= (dy + 1) / 2)  # apex up, base as wide as the extent


def _cross(dx: torch.Tensor, dy: torch.Tensor, form: torch.Tensor) -> torch.Tensor:
    arm = 1 / 3 + 0.06 * form  # half-width of an arm: 0.27-0.39 of the half-extent
    adx, ady = dx.abs(), dy.abs()
    return ((adx <= arm) & (ady <= 1)) | ((ady <= arm) & (adx <= 1))  # an upright plus sign


# Inside-tests in units of the half-extent, one per entry of SHAPES; the third argument, in
# [-1, 1], varies the shape's proportions a little.
_INSIDE = (_circle, _square, _triangle, _cross)


def shape_colours(colour: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """RGB in [0, 1] [n, 3] for colour indices [n]: between two of the name's :data:`COLOURS`
    and :data:`COLOUR_ANCHORS`, each channel then moved by up to :data:`COLOUR_JITTER`."""
    anchors = [(COLOURS[name], *COLOUR_ANCHORS[name]) for name in COLOURS]
    most = max(len(a) for a in anchors)
    table = torch.tensor([[*a, *[a[-1]] * (most - len(a))] for a in anchors])  # [c, most, 3]
    counts = torch.tensor([len(a) for a in anchors])[colour]
    n = colour.size(0)
    ends = (torch.rand(n, 2, generator=generator) * counts[:, None]).long()  # [n, 2]
    first, second = table[colour[:, None], ends].unbind(1)  # each [n, 3]
    t = torch.rand(n, 1, generator=generator)
    jitter = (torch.rand(n, 3, generator=generator) - 0.5) * 2 * COLOUR_JITTER
    return (first + t * (second - first) + jitter).clamp(0, 1)


def backgrounds(colours: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One background colour [n, 3] in [0, 1] per shape colour [n, 3]: dark, light or any
    colour, each as likely, redrawn until :data:`MIN_CONTRAST` from the shape's (after a few
    tries, the shape colour's channel-wise opposite extreme)."""
    n, tries = colours.size(0), _BACKGROUND_TRIES
    kind = torch.randint(0, 3, (n, tries, 1), generator=generator)
    # Greys reach exact black and white a fifth of the time (clamped), as drawn images do.
    level = torch.rand(n, tries, 1, generator=generator) * 0.25
    tint = (torch.rand(n, tries, 3, generator=generator) - 0.5) * 0.06
    grey = torch.where(kind == 0, level - 0.05, 1.05 - level) + tint
    colour = torch.rand(n, tries, 3, generator=generator)
    candidates = torch.where(kind == 2, colour, grey).clamp(0, 1)  # [n, tries, 3]
    far = (candidates - colours[:, None]).norm(dim=-1) >= MIN_CONTRAST  # [n, tries]
    first = far.int().argmax(dim=1)  # the first far-enough try (0 if none: replaced below)
    chosen = candidates[torch.arange(n), first]
    opposite = (colours < 0.5).float()
    return torch.where(far.any(dim=1, keepdim=True), chosen, opposite)


def render(attributes: torch.Tensor, image_size: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 images [n, 3, image_size, image_size], one per row of ``attributes`` [n, 5]; the
    jitter, backgrounds and noise come from ``generator``."""
    n = attributes.size(0)
    shape, colour, size, row, column = attributes.unbind(1)
    jitter = (torch.rand(n, 4, generator=generator) - 0.5) * 2  # uniform in [-1, 1)
    places = torch.tensor(_PLACE_FRACTIONS)
    half = torch.tensor(list(SIZES.values()))[size] * (1 + SIZE_JITTER * jitter[:, 2])
    cy = places[row] + PLACE_JITTER * jitter[:, 0]
    cx = places[column] + PLACE_JITTER * jitter[:, 1]
    form = jitter[:, 3]

    side = image_size * _SUPERSAMPLE
    grid = (torch.arange(side) + 0.5) / side  # pixel centres in [0, 1]
    mask = torch.zeros(n, side, side)
    for index, inside in enumerate(_INSIDE):
        chosen = (shape == index).nonzero().flatten()  # host-side data generation
        scale = half[chosen, None, None]
        # Offsets from the shape's centre in units of its half-extent: [k, side, 1], [k, 1, side].
        dy = (grid[None, :, None] - cy[chosen, None, None]) / scale
        dx = (grid[None, None, :] - cx[chosen, None, None]) / scale
        mask[chosen] = inside(dx, dy, form[chosen, None, None]).float()
    mask = F.avg_pool2d(mask[:, None], _SUPERSAMPLE)  # [n, 1, s, s], anti-aliased coverage

    rgb = shape_colours(colour, generator)
    background = backgrounds(rgb, generator)[:, :, None, None]  # [n, 3, 1, 1]
    image = background + mask * (rgb[:, :, None, None] - background)
    noise = torch.tensor(NOISE_LEVELS)[
        torch.randint(0, len(NOISE_LEVELS), (n,), generator=generator)
    ]
    image = image + noise[:, None, None, None] * torch.randn(image.shape, generator=generator)
    return (image.clamp(0, 1) * 255).round().to(torch.uint8)


def make_splits(
    seed: int, num_train: int, num_heldout: int, image_size: int
) -> tuple[ShapesSplit, ShapesSplit]:
    """The train and held-out splits, deterministic from ``seed``: attribute combinations
    drawn uniformly; the held-out images are separate renders never seen in training. A
    non-positive count, or an image smaller than 8 pixels, is a ``ValueError``."""
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
