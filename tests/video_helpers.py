"""Tiny clips for the video tests, drawn and encoded here with PyAV (nothing downloaded), and
transformers' own video processors run on the same frames.

transformers' video processors need torchvision, which the project's environment leaves out
(transformers then gives the Pillow image processors the image tests compare with). The
Makefile installs torchvision into ``.venv/torchvision-ref``, a folder on no path, and
:func:`hf_video_outputs` runs transformers with it in a child process.
"""

import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

REFERENCE = Path(os.environ.get("FUSION_TORCHVISION_REF", Path(sys.prefix) / "torchvision-ref"))


def drawn_frames(t: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """uint8 [t, 3, h, w]: a square moving right and a disc growing over a gradient, a colour
    per frame, so every frame differs and every frame index can be told apart."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(height).view(-1, 1).float()
    x = torch.arange(width).view(1, -1).float()
    frames = torch.empty(t, 3, height, width, dtype=torch.uint8)
    for i in range(t):
        colour = torch.randint(40, 256, (3,), generator=gen)
        base = (x * 255 / max(width - 1, 1) * 0.5 + y * 255 / max(height - 1, 1) * 0.3).to(
            torch.uint8
        )
        frame = base.expand(3, -1, -1).clone()
        side = max(2, min(height, width) // 3)
        left = (i * 3) % max(width - side, 1)
        frame[:, height // 4 : height // 4 + side, left : left + side] = colour.view(3, 1, 1).to(
            torch.uint8
        )
        disc = (y - height / 2) ** 2 + (x - width / 2) ** 2 < (2 + i) ** 2
        frame[:, disc] = torch.tensor([255 - 20 * (i % 10), 30, 200], dtype=torch.uint8).view(3, 1)
        frames[i] = frame
    return frames


def write_clip(
    path: Path,
    frames: torch.Tensor,
    fps: float,
    codec: str = "libx264",
    pix_fmt: str = "yuv444p",
    options: dict[str, str] | None = None,
    container_options: dict[str, str] | None = None,
) -> Path:
    """Encode uint8 [t, 3, h, w] frames to ``path`` (container from its suffix) at ``fps``,
    with the encoder's ``options`` (e.g. ``{"g": "5"}``: a key frame every 5) and the
    container's (e.g. ``{"movflags": "faststart"}``: the MP4 index first)."""
    import av

    rate = Fraction(fps).limit_denominator(1001)
    _, _, height, width = frames.shape
    with av.open(str(path), mode="w", options=container_options or {}) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if options:
            stream.options = options
        for frame in frames:
            image = av.VideoFrame.from_ndarray(frame.permute(1, 2, 0).contiguous().numpy())
            for packet in stream.encode(image):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def hf_video_settings(settings: dict, sample: bool) -> dict:
    """Our video processor's settings as transformers' constructor takes them: the pixel
    range as ``size``, the per-frame cap off (transformers 5.24 warns without it), frames
    sampled there or not."""
    hf = {k: v for k, v in settings.items() if k not in ("min_pixels", "max_pixels")}
    if "min_pixels" in settings:
        hf["size"] = {
            "shortest_edge": settings["min_pixels"],
            "longest_edge": settings["max_pixels"],
        }
    hf.setdefault("cap_pixels_per_frame", False)
    return {**hf, "do_sample_frames": sample}


def hf_video_outputs(cases: list[dict], tmp_path: Path) -> list[dict]:
    """transformers' video processors on each case, in one child process with torchvision.

    Each case names its processor by ``"class"`` (``Qwen2VLVideoProcessor``,
    ``Qwen3VLVideoProcessor``) and ``"settings"`` (the constructor's), or by ``"directory"``
    (``AutoVideoProcessor.from_pretrained``). Then either ``"sample"``: a list of
    transformers ``VideoMetadata`` fields, each given to ``sample_frames`` as ``preprocess``
    calls it (returns
    ``"indices"``, a list, an entry None where transformers raised); or ``"frames"`` (uint8
    [t, 3, h, w]), ``"metadata"`` (fields or None) and ``"kwargs"`` (the call's): returns
    ``pixel_values_videos``, ``video_grid_thw``, ``frames_indices`` and ``sampled_fps``. Or a
    whole ``"processor"`` (``Qwen2VLProcessor``, ...) with that video processor, the tokenizer
    saved in ``"tokenizer"``, on ``"prompts"`` and ``"videos"`` (with ``"kwargs"``): returns
    ``input_ids``, ``video_grid_thw``, ``pixel_values_videos`` and ``second_per_grid_ts``.
    """
    if not (REFERENCE / "torchvision").is_dir():
        message = f"torchvision for the reference is not installed in {REFERENCE} (make)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    inputs = tmp_path / "hf_video_in.pt"
    outputs = tmp_path / "hf_video_out.pt"
    torch.save(cases, inputs)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REFERENCE), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", _REFERENCE_SCRIPT, str(inputs), str(outputs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(outputs)


# The CPU torch here has no torchvision C ops for torchvision's CUDA wheel to register meta
# kernels for: that module is skipped (resize and normalize are torch calls, not those ops).
_REFERENCE_SCRIPT = """
import sys, types, warnings
sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
import torch
import transformers
warnings.simplefilter("ignore")
transformers.logging.set_verbosity_error()
cases = torch.load(sys.argv[1])
results = []
for case in cases:
    if "processor" in case:  # a whole processor: its tokenizer saved in case["tokenizer"]
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(case["tokenizer"])
        processor = getattr(transformers, case["processor"])(
            image_processor=transformers.Qwen2VLImageProcessorPil(),
            tokenizer=tokenizer,
            video_processor=getattr(transformers, case["class"])(**case["settings"]),
        )
        out = processor(text=case["prompts"], videos=case["videos"], **case["kwargs"])
        results.append({
            "input_ids": out["input_ids"],
            "video_grid_thw": torch.as_tensor(out["video_grid_thw"]),
            "pixel_values_videos": torch.as_tensor(out["pixel_values_videos"]),
            "second_per_grid_ts": out.get("second_per_grid_ts"),
        })
        continue
    if "directory" in case:
        processor = transformers.AutoVideoProcessor.from_pretrained(case["directory"])
    else:
        processor = getattr(transformers, case["class"])(**case["settings"])
    if "sample" in case:
        # sample_frames with the arguments preprocess() gives it: every setting of the class
        kwargs = {k: getattr(processor, k, None) for k in processor.valid_kwargs.__annotations__}
        for k in ("input_data_format", "do_convert_rgb", "do_sample_frames", "device"):
            kwargs.pop(k, None)
        kwargs.pop("video_metadata", None)
        indices = []
        for fields in case["sample"]:
            try:
                metadata = transformers.video_utils.VideoMetadata(**fields)
                chosen = processor.sample_frames(metadata=metadata, **kwargs)
                indices.append([int(i) for i in chosen])
            except (ValueError, ZeroDivisionError, TypeError):
                indices.append(None)
        results.append({"indices": indices})
        continue
    kwargs = dict(case["kwargs"])
    if case["metadata"] is not None:
        kwargs["video_metadata"] = [case["metadata"]]
    out = processor(videos=[case["frames"]], return_metadata=True, return_tensors="pt", **kwargs)
    metadata = out["video_metadata"][0]
    results.append({
        "pixel_values_videos": out["pixel_values_videos"],
        "video_grid_thw": out["video_grid_thw"],
        "frames_indices": [int(i) for i in metadata.frames_indices],
        "sampled_fps": metadata.sampled_fps,
        "type": type(processor).__name__,
    })
torch.save(results, sys.argv[2])
"""


# Video conversations for the fine-tuning tests: a clip, a list of frame files and an image,
# mixed in conversations (write_media writes the files the records name).
CLIP_FRAMES, CLIP_FPS = 5, 7.0  # an odd count: the last frame repeated for the temporal patch


def user(*content) -> dict:
    return {"role": "user", "content": list(content)}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def answer(value: str) -> dict:
    return {"role": "assistant", "content": [text(value)]}


def video(source) -> dict:
    return {"type": "video", "video": source}


FRAMES = ["frames/f0.png", "frames/f1.png", "frames/f2.png"]
RECORDS = [
    {"messages": [user(video("clip.mp4"), text("What moves?")), answer("a square")]},
    {
        "messages": [
            user({"type": "image", "path": "img.png"}, video(FRAMES), text("Same?")),
            answer("no"),
        ]
    },
    {
        "messages": [
            user(text("Watch.")),
            answer("ok"),
            user(video("clip.mp4"), {"type": "image", "path": "img.png"}, video(FRAMES)),
            answer("a disc grows"),
        ]
    },
    {"messages": [user(text("Say hi.")), answer("hi")]},
]


def write_media(root: Path) -> None:
    """What :data:`RECORDS` name, in ``root``: a clip (5 frames of 40 x 60 at 7 fps, the MP4
    index first), three frame files (30 x 44), an image (40 x 60)."""
    import numpy as np
    from PIL import Image

    write_clip(
        root / "clip.mp4",
        drawn_frames(CLIP_FRAMES, 40, 60, seed=1),
        CLIP_FPS,
        container_options={"movflags": "faststart"},
    )
    (root / "frames").mkdir()
    for i, frame in enumerate(drawn_frames(3, 30, 44, seed=2)):
        Image.fromarray(frame.permute(1, 2, 0).numpy()).save(root / FRAMES[i])
    pixels = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "img.png")
