"""Images and model directories as found in the wild: decompression bombs, truncated or
special files, processor settings and configs asking for gigabytes. Each is answered by one
``ValueError`` naming the file (and key), before anything of that size is allocated; the
bounded cases run in a subprocess with a 2 GiB address space and a timeout."""

import io
import json
import os
import struct
import sys
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from fusion.media.images import PILLOW_MAX_PIXELS, default_max_pixels
from fusion.preprocessing import VisionLanguageProcessor, load_image
from helpers import run_bounded
from vlm_helpers import CLIP_CONFIG, IDEFICS3_VISION_CONFIG, IMAGE_ID, TEXT_CONFIG, make_image


def png_header(width: int, height: int) -> bytes:
    """A grayscale PNG declaring ``width`` x ``height`` pixels and holding none (~70 bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"")
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def gif_with_canvas(width: int, height: int) -> bytes:
    """A two-frame 4 x 4 GIF whose header declares a ``width`` x ``height`` canvas."""
    frames = [Image.fromarray(make_image(4, 4, seed)).convert("P") for seed in range(2)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    data = bytearray(buffer.getvalue())
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


def vlm_directory(path, kind: str, vision: dict | None = None, processor: dict | None = None):
    """A directory holding a tiny LLaVA or Idefics3 ``config.json`` (``vision`` overriding its
    vision config) and optionally ``preprocessor_config.json``."""
    from transformers import Idefics3Config, LlavaConfig

    path.mkdir()
    if kind == "llava":
        vision_config = {"model_type": "clip_vision_model", **CLIP_CONFIG, **(vision or {})}
        config = LlavaConfig(
            vision_config=vision_config, text_config=TEXT_CONFIG, image_token_index=IMAGE_ID
        )
    else:
        config = Idefics3Config(
            vision_config={**IDEFICS3_VISION_CONFIG, **(vision or {})},
            text_config=TEXT_CONFIG,
            image_token_id=IMAGE_ID,
        )
    config.save_pretrained(path)
    if processor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


# Run in the bounded subprocess: each case prints one JSON line, {"case", "error", "message"}.
CASES = r"""
import json, sys
import torch
from fusion.preprocessing import VisionLanguageProcessor, load_image, prepare_inputs

root = sys.argv[1]
encode = lambda text: [1, 5]
def case(name, run):
    try:
        run()
        result = {"case": name, "error": None, "message": ""}
    except BaseException as error:
        result = {"case": name, "error": type(error).__name__, "message": str(error)}
    print(json.dumps(result), flush=True)

case("bomb", lambda: load_image(f"{root}/bomb.png"))
case("header_12000", lambda: load_image(f"{root}/big.png"))
case("header_12000_allowed", lambda: load_image(f"{root}/big.png", max_pixels=150_000_000))
case("gif_canvas", lambda: load_image(f"{root}/canvas.gif"))
for name in ("llava_edge", "idefics3_tile", "image_size_with_processor",
             "image_size_without_processor"):
    case(name, lambda: VisionLanguageProcessor.from_directory(f"{root}/{name}", encode=encode))
def run(name, image):
    return lambda: prepare_inputs(f"{root}/{name}", "<image>", [image], encode=encode)
case("llava_resized_too_large", run("llava_4096", torch.zeros(3, 20, 30000, dtype=torch.uint8)))
case("idefics3_tiles", run("idefics3_4096", torch.zeros(3, 4096, 4096, dtype=torch.uint8)))
"""


def test_hostile_sizes_in_bounded_memory(tmp_path):
    (tmp_path / "bomb.png").write_bytes(png_header(60_000, 60_000))
    (tmp_path / "big.png").write_bytes(png_header(12_000, 12_000))
    assert len(png_header(12_000, 12_000)) < 120
    (tmp_path / "canvas.gif").write_bytes(gif_with_canvas(12_000, 12_000))
    llava_processor = {"size": {"shortest_edge": 60_000}, "crop_size": 16}
    vlm_directory(tmp_path / "llava_edge", "llava", processor=llava_processor)
    idefics3_processor = {"max_image_size": {"longest_edge": 60_000}}
    vlm_directory(tmp_path / "idefics3_tile", "idefics3", processor=idefics3_processor)
    huge = {"image_size": 10**6}
    vlm_directory(tmp_path / "image_size_with_processor", "llava", huge, {"crop_size": 16})
    vlm_directory(tmp_path / "image_size_without_processor", "llava", huge)
    llava_4096 = {"size": {"shortest_edge": 4096}, "crop_size": 16}
    vlm_directory(tmp_path / "llava_4096", "llava", processor=llava_4096)
    idefics3_4096 = {"size": {"longest_edge": 4096}, "max_image_size": {"longest_edge": 16}}
    vlm_directory(tmp_path / "idefics3_4096", "idefics3", processor=idefics3_4096)

    done = run_bounded(CASES, str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["case"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert len(results) == 10, done.stdout

    def refused(case: str, *parts: str) -> None:
        result = results[case]
        assert result["error"] in ("ValueError", "CheckpointError"), result
        for part in parts:
            assert part in result["message"], (part, result)

    refused("bomb", f"{tmp_path}/bomb.png", "max_pixels=", "decompression bomb")
    refused("header_12000", f"{tmp_path}/big.png", "12000 x 12000 = 144000000 pixels")
    refused("header_12000_allowed", f"{tmp_path}/big.png", "cannot be decoded", "truncated")
    refused("gif_canvas", f"{tmp_path}/canvas.gif", "12000 x 12000")
    refused("llava_edge", "llava_edge/preprocessor_config.json: size.shortest_edge:", "<= 4096")
    refused("idefics3_tile", "preprocessor_config.json: max_image_size.longest_edge:", "60000")
    for case in ("image_size_with_processor", "image_size_without_processor"):
        refused(case, f"{case}/config.json", "vision_config.image_size", "1000000")
    refused("llava_resized_too_large", "images[0]: would be processed to", "max_pixels=")
    refused("idefics3_tiles", "images[0]: 4096 x 4096 pixels would be split into 65537 tiles")


class TestImageFiles:
    def test_truncated_jpeg(self, tmp_path):
        buffer = io.BytesIO()
        Image.fromarray(make_image(64, 64)).save(buffer, "JPEG")
        (tmp_path / "cut.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        with pytest.raises(ValueError, match=r"cut\.jpg': cannot be decoded: .*truncated"):
            load_image(tmp_path / "cut.jpg")

    def test_directory_fifo_and_missing(self, tmp_path):
        with pytest.raises(ValueError, match="not a regular file"):
            load_image(tmp_path)
        os.mkfifo(tmp_path / "pipe.png")  # would block an open() without O_NONBLOCK
        with pytest.raises(ValueError, match=r"pipe\.png': not a regular file"):
            load_image(tmp_path / "pipe.png")
        with pytest.raises(ValueError, match=r"nothing\.png': no such file"):
            load_image(tmp_path / "nothing.png")

    def test_pixel_cap(self, tmp_path, monkeypatch):
        Image.fromarray(make_image(20, 30)).save(tmp_path / "photo.png")
        with pytest.raises(ValueError, match=r"photo\.png': 30 x 20 = 600 pixels, more than max_"):
            load_image(tmp_path / "photo.png", max_pixels=599)
        assert load_image(tmp_path / "photo.png", max_pixels=600).shape == (3, 20, 30)
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="max_pixels: expected a positive integer"):
                load_image(tmp_path / "photo.png", max_pixels=bad)
        assert default_max_pixels() == Image.MAX_IMAGE_PIXELS == PILLOW_MAX_PIXELS
        # Pillow's limit set lower: it is the default cap; a larger max_pixels lifts it for
        # this file only, and Pillow's DecompressionBombWarning never shows.
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
        with pytest.raises(ValueError, match=r"photo\.png.*more than max_pixels=100"):
            load_image(tmp_path / "photo.png")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert load_image(tmp_path / "photo.png", max_pixels=1000).shape == (3, 20, 30)
        assert Image.MAX_IMAGE_PIXELS == 100

    def test_animated_first_frame_within_the_cap(self, tmp_path):
        (tmp_path / "anim.gif").write_bytes(gif_with_canvas(4, 4))
        assert load_image(tmp_path / "anim.gif", max_pixels=16).shape[1:] == (4, 4)
        with pytest.raises(ValueError, match="4 x 4 = 16 pixels, more than max_pixels=15"):
            load_image(tmp_path / "anim.gif", max_pixels=15)


def test_rows_per_prompt_and_tensor_pixels_capped(tmp_path):
    from fusion.preprocessing import ClipImageProcessor

    processor = VisionLanguageProcessor(
        "llava",
        ClipImageProcessor.for_image_size(16),
        tokens_per_image=16,
        image_size=16,
        image_token_id=IMAGE_ID,
        encode=lambda text: [1, 2],
        max_image_rows=32,
        max_pixels=400,
    )
    image = torch.zeros(3, 8, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"prompts\[1\]: its 3 image\(s\) would expand to 48 "):
        processor(["<image>", "<image><image><image>"], [image] * 4)
    with pytest.raises(ValueError, match=r"images\[0\]: is 20 x 21 = 420 pixels, more than max_"):
        processor("<image>", [torch.zeros(3, 20, 21, dtype=torch.uint8)])
    pil = Image.fromarray(np.zeros((21, 20, 3), np.uint8))
    with pytest.raises(ValueError, match=r"images\[0\]: is 21 x 20 = 420 pixels"):
        processor("<image>", [pil])
    with pytest.raises(ValueError, match="max_image_rows: expected an integer >= 1, got 0"):
        VisionLanguageProcessor(
            "llava",
            ClipImageProcessor.for_image_size(16),
            tokens_per_image=16,
            image_size=16,
            image_token_id=IMAGE_ID,
            encode=list,
            max_image_rows=0,
        )
    assert sys.modules["PIL.Image"] is Image
