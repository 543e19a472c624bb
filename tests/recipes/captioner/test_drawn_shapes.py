"""Shapes drawn with Pillow, as a user would draw them (any background, any resolution, fill
colours by name), are captioned right by a trained captioner."""

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from recipes.captioner import main
from recipes.captioner.caption import caption
from recipes.captioner.config import TrainConfig
from recipes.captioner.shapes import place_phrase
from recipes.captioner.state import load_train_state

# Training the captioner to its accuracy costs `make run`'s steps (minutes of CPU time), too
# much for every test run: set CAPTIONER_CHECKPOINT to a checkpoint directory of make run (its
# last one, runs/<name>/checkpoints/step_<steps>), or FUSION_SLOW_TESTS=1 to train one here
# with the default configuration.
CHECKPOINT = os.environ.get("CAPTIONER_CHECKPOINT")
TRAIN = os.environ.get("FUSION_SLOW_TESTS") == "1"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of the default configuration trained for the default number of steps."""
    if CHECKPOINT:
        return Path(CHECKPOINT)
    if not TRAIN:
        pytest.skip("needs a trained captioner: CAPTIONER_CHECKPOINT=DIR or FUSION_SLOW_TESTS=1")
    out = tmp_path_factory.mktemp("drawn") / "run"
    argv = ["--num-heldout", "16", "--no-progress", "--num-samples", "0", "--output-dir", str(out)]
    threads = torch.get_num_threads()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    torch.set_num_threads(threads)
    return Path(json.loads((out / "metrics.json").read_text())["checkpoint"])


def draw(shape, fill, extent, row, column, background, side=128, offset=(0.0, 0.0)):
    """A ``side`` x ``side`` Pillow image of one filled shape ``extent`` (a fraction of the
    side) across, centred at a quarter, half or three quarters (``row``, ``column`` in 0-2)
    plus ``offset``; a square's side is 0.85 of the extent (a circle's area)."""
    image = Image.new("RGB", (side, side), background)
    pen = ImageDraw.Draw(image)
    cx = (0.25 + 0.25 * column + offset[0]) * side
    cy = (0.25 + 0.25 * row + offset[1]) * side
    r = extent * side / 2
    if shape == "circle":
        pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        h = 0.85 * r
        pen.rectangle([cx - h, cy - h, cx + h, cy + h], fill=fill)
    elif shape == "triangle":
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:  # an upright cross, arms a third of the extent wide
        w = r / 3
        pen.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
        pen.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
    return image


# (shape, fill, extent, row, column, background, side, offset): every shape, colour, size and
# background kind (white, black, a colour, a light grey); several places and resolutions.
DRAWINGS = [
    ("circle", "red", 0.36, 0, 0, "white", 128, (0.0, 0.0)),
    ("circle", "blue", 0.2, 1, 1, "white", 256, (0.03, -0.02)),
    ("square", "green", 0.34, 2, 2, "white", 64, (0.0, 0.0)),
    ("triangle", "purple", 0.2, 0, 2, "white", 100, (-0.02, 0.02)),
    ("cross", "yellow", 0.32, 1, 0, "black", 128, (0.0, 0.0)),
    ("triangle", "white", 0.34, 2, 1, "black", 96, (0.0, 0.0)),
    ("square", "red", 0.2, 0, 1, "black", 128, (0.02, 0.0)),
    ("cross", "blue", 0.2, 2, 0, "white", 128, (0.0, 0.0)),
    ("circle", "yellow", 0.32, 1, 2, (40, 90, 160), 128, (0.0, 0.0)),
    ("triangle", "red", 0.34, 1, 1, (200, 230, 200), 128, (0.0, 0.0)),
    ("square", "white", 0.2, 2, 0, (150, 60, 40), 160, (0.0, 0.0)),
    ("cross", "purple", 0.35, 0, 0, (230, 230, 230), 128, (0.0, 0.0)),
]


def expected_caption(shape, fill, extent, row, column, *_):
    size = "small" if extent < 0.26 else "large"
    return f"a {size} {fill} {shape} {place_phrase(row, column)}"


def test_drawn_shapes_are_captioned_right(checkpoint, tmp_path):
    """The default configuration, trained, captions each drawing right."""
    config = load_train_state(checkpoint).config
    defaults = TrainConfig()
    for group in ("data", "model", "optim"):
        assert config.group(group) == defaults.group(group), group
    assert config.steps == defaults.steps
    files = []
    for i, drawing in enumerate(DRAWINGS):
        files.append(tmp_path / f"drawn-{i}.png")
        draw(*drawing).save(files[-1])
    expected = [expected_caption(*drawing) for drawing in DRAWINGS]
    got = caption(checkpoint, files)
    wrong = [f"{g!r} for {e!r}" for g, e in zip(got, expected, strict=True) if g != e]
    assert not wrong
