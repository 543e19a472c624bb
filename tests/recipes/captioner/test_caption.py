"""Captioning image files with a trained checkpoint: ``caption()`` and
``python -m recipes.captioner.caption``."""

import json
import sys
from pathlib import Path

import numpy
import pytest
import torch
from PIL import Image

import recipes.captioner.caption as captioning
from fusion.preprocessing import resize
from recipes.captioner import TrainingError
from recipes.captioner.caption import caption, main
from recipes.captioner.shapes import make_splits
from recipes.captioner.state import load_train_state

PROG = "python -m recipes.captioner.caption: "


def save_png(image: torch.Tensor, path: Path, mode: str = "RGB") -> Path:
    """uint8 [3, h, w] as a PNG file (lossless), converted to ``mode``."""
    Image.fromarray(image.permute(1, 2, 0).numpy()).convert(mode).save(path)
    return path


@pytest.fixture(scope="module")
def trained(finished_run) -> tuple[Path, torch.Tensor, list[str]]:
    """The tiny run's last checkpoint, its first held-out images (rendered again from the
    seed, as the run rendered them) and the captions its report printed for them."""
    out, _ = finished_run
    metrics = json.loads((out / "metrics.json").read_text())
    checkpoint = Path(metrics["checkpoint"])
    config = load_train_state(checkpoint).config
    _, heldout = make_splits(config.seed, config.num_train, config.num_heldout, config.image_size)
    predicted = [sample["predicted"] for sample in metrics["samples"]]
    return checkpoint, heldout.images[: len(predicted)], predicted


def test_png_files_caption_as_the_report_did(trained, tmp_path):
    checkpoint, images, reported = trained
    files = [save_png(image, tmp_path / f"shape-{i}.png") for i, image in enumerate(images)]
    assert len(files) == 2
    assert caption(checkpoint, files) == reported
    assert caption(str(checkpoint), [str(f) for f in reversed(files)]) == reported[::-1]
    # A file, a Pillow image and a tensor of the same pixels caption alike.
    with Image.open(files[0]) as opened:
        assert caption(checkpoint, [files[0], opened, images[0]], batch_size=2) == [reported[0]] * 3
    assert caption(checkpoint, []) == []


def test_grayscale_transparent_and_larger_images(trained, tmp_path):
    checkpoint, images, _ = trained
    image = images[0]
    gray = save_png(image, tmp_path / "gray.png", mode="L")
    with Image.open(gray) as opened:
        gray_pixels = torch.from_numpy(numpy.asarray(opened).copy())  # [16, 16]
    assert caption(checkpoint, [gray]) == caption(checkpoint, [gray_pixels.expand(3, -1, -1)])
    opaque = torch.cat([image, torch.full((1, 16, 16), 255, dtype=torch.uint8)])
    assert caption(checkpoint, [opaque]) == caption(checkpoint, [image])
    # A square image of another side is resized to the model's 16 pixels.
    pixels = image.repeat_interleave(4, 1).repeat_interleave(4, 2)  # [3, 64, 64]
    large = save_png(pixels, tmp_path / "big.png")
    assert caption(checkpoint, [large]) == caption(checkpoint, [resize(pixels, (16, 16))])


def test_bad_input_is_refused_before_the_model_is_loaded(trained, tmp_path, monkeypatch):
    checkpoint, images, _ = trained
    loads = []
    monkeypatch.setattr(captioning, "load_model", lambda *a: loads.append(a))
    wide = save_png(torch.zeros(3, 16, 24, dtype=torch.uint8), tmp_path / "wide.png")
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    cases = [
        ([wide], ValueError, f"image '{wide}': expected a square image"),
        ([text], ValueError, f"image '{text}': not an image Pillow can decode"),
        ([tmp_path / "missing.png"], (OSError, ValueError), "missing.png"),
        ([images[0].float()], ValueError, "images[0]: expected 8-bit pixels"),
        ([images[0], 7], TypeError, "images[1]: expected a uint8 tensor"),
        (images[0], TypeError, "images: expected a list of image files"),
        (str(wide), TypeError, "got str (a single image goes in a list)"),
    ]
    for argument, kind, message in cases:
        with pytest.raises(kind) as error:
            caption(checkpoint, argument)
        assert message in str(error.value)
    with pytest.raises(ValueError, match=r"^batch_size: expected a positive integer, got 0"):
        caption(checkpoint, [wide], batch_size=0)
    with pytest.raises(TrainingError, match=r"^checkpoint: expected a checkpoint directory"):
        caption(tmp_path / "nowhere", [wide])
    assert loads == []


def test_without_pillow_files_need_the_vision_extra(trained, tmp_path, monkeypatch, capsys):
    checkpoint, images, reported = trained
    png = save_png(images[0], tmp_path / "shape.png")
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL: ImportError
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    assert caption(checkpoint, [images[0]]) == reported[:1]  # tensors need no Pillow
    assert main(["--checkpoint", str(checkpoint), str(png)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(PROG + "error: decoding images needs Pillow")
    assert "[vision]" in err


def test_the_command_line(trained, job, tmp_path, capsys):
    checkpoint, images, reported = trained
    files = [save_png(image, tmp_path / f"shape {i}.png") for i, image in enumerate(images)]
    run = job.run(
        "--checkpoint", str(checkpoint), *map(str, files), module="recipes.captioner.caption",
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        f"{f}: {text}" for f, text in zip(files, reported, strict=True)
    ]

    for argv, message in (
        ([str(checkpoint), str(tmp_path / "missing.png")], "missing.png"),
        ([str(tmp_path), str(files[0])], f"--checkpoint: {tmp_path} is not a checkpoint dir"),
    ):
        assert main(["--checkpoint", *argv]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(PROG + "error: ") and message in err
    for argv, message in (
        ([str(files[0])], "the following arguments are required: --checkpoint"),
        (["--checkpoint", str(checkpoint)], "the following arguments are required: IMAGE"),
        (["--checkpoint", str(checkpoint), "--batch-size", "0", str(files[0])], "positive"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err


def test_the_command_line_captions_every_file_it_can(trained, tmp_path, capsys):
    """Bad files are reported one per line; every other file is still captioned, in order;
    the status is 1."""
    checkpoint, images, reported = trained
    good = [save_png(image, tmp_path / f"good-{i}.png") for i, image in enumerate(images)]
    wide = save_png(torch.zeros(3, 16, 24, dtype=torch.uint8), tmp_path / "wide.png")
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    missing = tmp_path / "missing.png"
    files = [wide, good[0], text, missing, good[1]]
    assert main(["--checkpoint", str(checkpoint), *map(str, files)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{f}: {c}" for f, c in zip(good, reported, strict=True)]
    errors = err.splitlines()
    assert len(errors) == 3 and all(line.startswith(PROG + "error: ") for line in errors)
    assert f"image '{wide}': expected a square image" in errors[0]
    assert f"image '{text}': not an image Pillow can decode" in errors[1]
    assert str(missing) in errors[2]
    # Nothing readable: every file reported, nothing captioned, the model never loaded.
    assert main(["--checkpoint", str(checkpoint), str(wide), str(text)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 2
