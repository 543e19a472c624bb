"""The prompt text of videos: ids equal to transformers' ``Qwen2VLProcessor``,
``Qwen2_5_VLProcessor`` (with its ``second_per_grid_ts``) and ``Qwen3VLProcessor`` (a
``<t seconds>`` timestamp before every temporal patch's rows, from the frames actually
sampled), on clips written here at several frame rates, sampled and decoded by fusion and
by transformers from the same file."""

from pathlib import Path

import pytest
import torch
from video_helpers import drawn_frames, hf_video_outputs, hf_video_settings, write_clip

from fusion.families.qwen_vl.images import QWEN2_VL_VIDEO_MARKER
from fusion.families.qwen_vl.processor import expand_video_pads
from fusion.families.qwen_vl.video import (
    Qwen2VLVideoProcessor,
    Qwen3VLVideoProcessor,
)
from fusion.media.video import VideoMetadata, load_video
from vlm_helpers import CHARS, QWEN_SPECIAL_IDS, qwen_hf_tokenizer

MARKER = QWEN2_VL_VIDEO_MARKER
PROMPTS = [
    f"<|im_start|>user\n{MARKER}Describe it.<|im_end|>\n<|im_start|>assistant\n",
    f"First {MARKER} then {MARKER}, compare.",
    "No video here.",
]
# (transformers' processor, our video processor and its settings)
CASES = [
    (
        "Qwen2VLProcessor",
        Qwen2VLVideoProcessor,
        {"max_pixels": 28 * 28 * 12, "min_pixels": 784, "fps": 2.0},
    ),
    (
        "Qwen2_5_VLProcessor",
        Qwen2VLVideoProcessor,
        {"max_pixels": 28 * 28 * 12, "min_pixels": 784, "fps": 1.5},
    ),
    ("Qwen3VLProcessor", Qwen3VLVideoProcessor, {"max_pixels": 1024 * 40, "min_pixels": 1024}),
    (
        "Qwen3VLProcessor",
        Qwen3VLVideoProcessor,
        {"max_pixels": 1024 * 40, "min_pixels": 1024, "fps": 3.3},
    ),
]


def char_tokenizer():
    """One token per character (with the timestamps' < and >), Qwen's special tokens added."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    chars = CHARS + "<>"
    vocab = dict(QWEN_SPECIAL_IDS) | {c: 4 + i for i, c in enumerate(chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.add_special_tokens([t for t in QWEN_SPECIAL_IDS if t != "<unk>"])
    return tokenizer


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[Path]:
    """Clips at 7, 29.97 and 12.5 frames a second, of odd sizes."""
    folder = tmp_path_factory.mktemp("clips")
    return [
        write_clip(folder / "a.mp4", drawn_frames(23, 29, 37, seed=1), 7.0, options={"g": "6"}),
        write_clip(
            folder / "b.mkv", drawn_frames(31, 18, 26, seed=2), 30000 / 1001, pix_fmt="yuv420p"
        ),
        write_clip(folder / "c.avi", drawn_frames(9, 24, 32, seed=3), 12.5, "mjpeg", "yuvj444p"),
    ]


@pytest.fixture(scope="module")
def reference(clips, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    qwen_hf_tokenizer(char_tokenizer()).save_pretrained(folder)
    full = [load_video(path) for path in clips]
    cases = []
    for processor, ours, settings in CASES:
        cases.append(
            {
                "processor": processor,
                "class": ours.hf_class,
                "settings": hf_video_settings(settings, True),
                "tokenizer": str(folder),
                "prompts": PROMPTS,
                "videos": [video.frames for video in full],  # the whole clips, sampled there
                "kwargs": {"video_metadata": [video.metadata.as_transformers() for video in full]},
            }
        )
    # Frames already kept, without metadata: transformers takes them at 24 frames a second.
    cases.append(
        {
            "processor": "Qwen3VLProcessor",
            "class": "Qwen3VLVideoProcessor",
            "settings": hf_video_settings(CASES[2][2], False),
            "tokenizer": str(folder),
            "prompts": PROMPTS[:1],
            "videos": [drawn_frames(5, 20, 30)],
            "kwargs": {},
        }
    )
    return hf_video_outputs(cases, tmp_path_factory.mktemp("hf"))


def our_ids(processor, prompts, videos) -> tuple[list[list[int]], object]:
    patched = processor(videos)
    texts = [
        processor.video_text(grid, metadata)
        for grid, metadata in zip(patched.video_grid_thw.tolist(), patched.metadata, strict=True)
    ]
    tokenizer = char_tokenizer()
    return [tokenizer.encode(p).ids for p in expand_video_pads(prompts, texts)], patched


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_ids_pixels_and_grids_equal_transformers_processor(reference, clips, index):
    _, kind, settings = CASES[index]
    processor = kind(**{**settings, "do_sample_frames": True})
    videos = [load_video(path, sampler=processor.sampler) for path in clips]
    ids, patched = our_ids(processor, PROMPTS, videos)
    hf = reference[index]
    assert ids == hf["input_ids"]
    assert torch.equal(patched.video_grid_thw, hf["video_grid_thw"])
    assert torch.equal(patched.pixel_values_videos, hf["pixel_values_videos"])
    if hf["second_per_grid_ts"] is not None:  # Qwen2.5-VL
        assert list(patched.second_per_grid_ts) == pytest.approx(hf["second_per_grid_ts"], abs=0)
    video_id = QWEN_SPECIAL_IDS["<|video_pad|>"]
    rows = (patched.video_grid_thw.prod(1) // 4).tolist()
    assert [row.count(video_id) for row in ids] == [rows[0], rows[1] + rows[2], 0]


def test_qwen3_timestamps_come_from_the_frames_kept(reference, clips):
    processor = Qwen3VLVideoProcessor(**CASES[2][2])
    video = load_video(clips[0], sampler=processor.sampler)  # 23 frames at 7 fps: 6 kept
    kept = video.metadata.frames_indices
    assert kept == (0, 4, 9, 13, 18, 22)
    times = processor.timestamps(video.metadata)
    assert times == [(kept[i] / 7.0 + kept[i + 1] / 7.0) / 2 for i in (0, 2, 4)]
    text = processor.video_text((3, 2, 2), video.metadata)
    frame = "<|vision_start|><|video_pad|><|vision_end|>"
    assert text == "".join(f"<{t:.1f} seconds>{frame}" for t in times)
    # an odd number kept: the last frame's index repeated for the padding
    odd = VideoMetadata(40, 10.0, 8, 8, 4.0, (0, 13, 26))
    assert processor.timestamps(odd) == [0.65, 2.6]
    with pytest.raises(ValueError, match="3 frames kept, fewer than the 3 temporal patches"):
        processor.video_text((3, 2, 2), odd)


def test_frames_without_metadata_are_timed_at_24_fps(reference):
    processor = Qwen3VLVideoProcessor(**CASES[2][2])
    ids, _ = our_ids(processor, PROMPTS[:1], [drawn_frames(5, 20, 30)])
    assert ids == reference[-1]["input_ids"]


def test_a_video_count_other_than_the_pads_is_refused():
    with pytest.raises(
        ValueError, match=r"2 video marker\(s\) '<\|video_pad\|>'.*1 video\(s\) given"
    ):
        expand_video_pads([MARKER, MARKER], ["x"])


def test_a_text_bracketing_its_frames_replaces_the_whole_marker():
    """Qwen3-VL's frames each have their own start / end pair, so the template's marker goes
    whole (transformers 5.25, and its 4.x code; 5.0 to 5.24 wrote the marker's pair around
    them too); Qwen2-VL's pads keep the marker's pair, and a bare pad takes either text."""
    metadata = VideoMetadata(4, 2.0, 32, 32, 2.0, (0, 1, 2, 3))
    qwen3 = Qwen3VLVideoProcessor(**CASES[2][2]).video_text((2, 2, 2), metadata)
    frame = "<|vision_start|><|video_pad|><|vision_end|>"
    assert qwen3 == f"<0.2 seconds>{frame}<1.2 seconds>{frame}"
    prompts = [f"a {MARKER} b", "c <|video_pad|> d"]
    assert expand_video_pads(prompts, [qwen3, qwen3]) == [f"a {qwen3} b", f"c {qwen3} d"]
    pads = "<|video_pad|>" * 3
    assert expand_video_pads(prompts, [pads, pads]) == [
        f"a <|vision_start|>{pads}<|vision_end|> b",
        f"c {pads} d",
    ]
