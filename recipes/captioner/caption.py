"""Caption images with a checkpoint of the main job: ``python -m recipes.captioner.caption
--checkpoint DIR a.png b.png`` prints ``<file>: <caption>`` per image, in order, and one line on
stderr per file it cannot read (the others are still captioned; the exit status is then 1)."""

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from fusion.preprocessing import as_uint8_image, load_image, resize, to_rgb
from fusion.training import TrainingError, checkpoint_dir, flat, one_line, resolve_device
from fusion.training.config import OneLineParser, positive_int
from recipes.captioner.model import greedy_captions
from recipes.captioner.state import load_model, load_train_state

PROG = "python -m recipes.captioner.caption"


def _pixels(image: Any, name: str, image_size: int) -> torch.Tensor:
    """One image (a path, a Pillow image or a uint8 tensor [c, h, w]) as uint8 RGB [3, s, s]."""
    if isinstance(image, (str, os.PathLike)):
        name = f"image {os.fspath(image)!r}"
        decoded = load_image(image)
    else:
        decoded = as_uint8_image(image, name)
    height, width = decoded.shape[1:]
    if height != width:
        raise ValueError(
            f"{name}: expected a square image (the model reads {image_size}x{image_size} "
            f"pixels; stretching would distort the shape), got {width}x{height}"
        )
    rgb = to_rgb(decoded)
    return resize(rgb, (image_size, image_size)) if height != image_size else rgb


def caption(
    checkpoint: str | os.PathLike,
    images: Sequence[Any],
    *,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
) -> list[str]:
    """Greedy captions of ``images`` by the model of ``checkpoint`` (a ``step_<N>`` directory of
    ``python -m recipes.captioner``), in order, ``batch_size`` at a time on ``device``. An
    image is a file (which needs Pillow), a Pillow image or a uint8 tensor [1, 3 or 4, h, w],
    square; each is checked before the model loads, then taken as the training images are: RGB
    (grayscale repeated, transparency over white), resized to the model's side (bicubic).

    Raises:
        TypeError, ValueError: a bad argument, or an image not square or that cannot be taken.
        ImportError, OSError: an image file without Pillow installed, or that cannot be read.
        TrainingError: ``checkpoint`` is not an intact checkpoint directory.
    """
    if not isinstance(images, (list, tuple)):
        raise TypeError(
            "images: expected a list of image files, Pillow images or uint8 tensors, got "
            f"{type(images).__name__} (a single image goes in a list)"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
    path = checkpoint_dir(checkpoint, "checkpoint")
    size = load_train_state(path).config.image_size
    pixels = [_pixels(image, f"images[{i}]", size) for i, image in enumerate(images)]
    if not pixels:
        return []
    model, _ = load_model(path)
    return greedy_captions(model.to(device), torch.stack(pixels), batch_size)


def main(argv: list[str] | None = None) -> int:
    """Caption the command line's images; returns the exit status: 1 if an image cannot be
    read (the others are captioned) or nothing can be, 2 for a bad command line (argparse's)."""
    parser = OneLineParser(
        prog=PROG,
        description=(
            "Caption image files with a checkpoint of python -m recipes.captioner; prints "
            "'<file>: <caption>' per image. Images are square; other sizes than the model's "
            "are resized to it. Needs Pillow: pip install -e '.[vision]'."
        ),
    )
    parser.add_argument(
        "--checkpoint", required=True, metavar="DIR",
        help="a checkpoint directory, e.g. runs/x/checkpoints/step_00002000",
    )  # fmt: skip
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...)")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="cpu",
        help="where the model runs (default: cpu)",
    )  # fmt: skip
    parser.add_argument(
        "--batch-size", type=positive_int, default=256, help="images per batch (default: 256)"
    )
    args = parser.parse_args(argv)

    def report(error: BaseException) -> None:
        print(f"{PROG}: error: {flat(one_line(error))}", file=sys.stderr)

    try:
        path = checkpoint_dir(args.checkpoint, "--checkpoint")
        device = resolve_device(args.device, 0)
        image_size = load_train_state(path).config.image_size
        readable, pixels = [], []
        for file in args.images:
            try:
                pixels.append(_pixels(file, file, image_size))
                readable.append(file)
            except (ValueError, TypeError, OSError) as error:
                report(error)
        captions = caption(path, pixels, batch_size=args.batch_size, device=device)
    except (TrainingError, ValueError, TypeError, ImportError, OSError) as error:
        report(error)
        return 1
    for file, text in zip(readable, captions, strict=True):
        print(f"{file}: {text}")
    return 0 if len(readable) == len(args.images) else 1


if __name__ == "__main__":
    sys.exit(main())
