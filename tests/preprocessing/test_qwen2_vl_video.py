"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's video processors against transformers' own
(``Qwen2VLVideoProcessor``, ``Qwen3VLVideoProcessor``, run with torchvision in a child
process): the frames kept, ``pixel_values_videos`` bit for bit, ``video_grid_thw`` and
``second_per_grid_ts``, on clips and frames drawn here at odd sizes, frame rates and frame
counts; settings from a directory as transformers finds them; bad settings and inputs refused
by name."""

import json
from pathlib import Path

import pytest
import torch
from video_helpers import drawn_frames, hf_video_outputs, hf_video_settings, write_clip

from fusion.families.qwen_vl.video import (
    PatchedVideos,
    Qwen2VLVideoProcessor,
    Qwen3VLVideoProcessor,
    read_video_processor,
)
from fusion.media.video import VideoMetadata, load_video, probe_video

SMALL = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 20}
SMALL3 = {"min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 60}
PROCESSORS = {
    "Qwen2VLVideoProcessor": Qwen2VLVideoProcessor,
    "Qwen3VLVideoProcessor": Qwen3VLVideoProcessor,
}


def case(kind: str, settings: dict, frames: torch.Tensor, metadata=None) -> dict:
    return {
        "class": kind,
        "settings": settings,
        "frames": frames,
        "metadata": metadata,
        "kwargs": {},
    }


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """23 frames of 29 x 37 at 7 fps, H.264 with B-frames."""
    folder = tmp_path_factory.mktemp("clip")
    frames = drawn_frames(23, 29, 37, seed=3)
    return write_clip(folder / "clip.mp4", frames, 7.0, options={"g": "5", "bf": "2"}), frames


# (name, processor, our settings, the frames' (t, h, w))
FRAME_CASES = [
    ("qwen2 defaults, odd frame count padded", "Qwen2VLVideoProcessor", {}, (5, 45, 61)),
    ("qwen2 small budget, downscaled", "Qwen2VLVideoProcessor", SMALL, (7, 97, 131)),
    ("qwen2 bilinear", "Qwen2VLVideoProcessor", {**SMALL, "resample": 2}, (4, 33, 47)),
    ("qwen2 nearest", "Qwen2VLVideoProcessor", {**SMALL, "resample": 0}, (3, 33, 47)),
    ("qwen2 one frame", "Qwen2VLVideoProcessor", SMALL, (1, 30, 30)),
    ("qwen2 rescale only", "Qwen2VLVideoProcessor", {**SMALL, "do_normalize": False}, (2, 28, 56)),
    ("qwen2 normalise only", "Qwen2VLVideoProcessor", {**SMALL, "do_rescale": False}, (2, 28, 56)),
    (
        "qwen2 no resize, temporal patch 3",
        "Qwen2VLVideoProcessor",
        {**SMALL, "do_resize": False, "temporal_patch_size": 3},
        (4, 56, 28),
    ),
    (
        "qwen2 capped per frame",
        "Qwen2VLVideoProcessor",
        {"cap_pixels_per_frame": True, "max_video_tokens": 40},
        (6, 64, 90),
    ),
    ("qwen3 defaults, 3 frames", "Qwen3VLVideoProcessor", {}, (3, 40, 52)),
    ("qwen3 small, tiny frames scaled up", "Qwen3VLVideoProcessor", SMALL3, (5, 9, 23)),
    (
        "qwen3 capped",
        "Qwen3VLVideoProcessor",
        {**SMALL3, "cap_pixels_per_frame": True, "max_video_tokens": 6},
        (8, 70, 50),
    ),
]


@pytest.fixture(scope="module")
def reference(clip, tmp_path_factory):
    """Every case's transformers output, from one child process."""
    path, _ = clip
    full = load_video(path)
    cases = []
    for i, (_, kind, settings, shape) in enumerate(FRAME_CASES):
        cases.append(case(kind, hf_video_settings(settings, False), drawn_frames(*shape, seed=i)))
    # Sampled from a clip: transformers samples the whole clip's frames with its metadata.
    for kind, settings in SAMPLED:
        hf = hf_video_settings(settings, True)
        cases.append(case(kind, hf, full.frames, full.metadata.as_transformers()))
    for kind, settings in SAMPLING:
        cases.append(
            {"class": kind, "settings": hf_video_settings(settings, False), "sample": SAMPLE_CLIPS}
        )
    directory = tmp_path_factory.mktemp("qwen2_vl_dir")
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    (directory / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_QWEN2_VL))
    cases.append(
        {
            "directory": str(directory),
            "frames": drawn_frames(4, 40, 60),
            "metadata": None,
            "kwargs": {"cap_pixels_per_frame": False},
        }
    )
    outputs = hf_video_outputs(cases, tmp_path_factory.mktemp("hf"))
    return {"outputs": outputs, "directory": directory}


SAMPLED = [
    ("Qwen2VLVideoProcessor", {**SMALL, "fps": 1.5}),
    ("Qwen2VLVideoProcessor", {**SMALL, "num_frames": 7}),
    ("Qwen3VLVideoProcessor", SMALL3),  # 2 frames a second by default
    ("Qwen3VLVideoProcessor", {**SMALL3, "fps": 5.5}),
]
SAMPLING = [
    ("Qwen2VLVideoProcessor", {"fps": 2.0}),
    ("Qwen2VLVideoProcessor", {"fps": 0.7, "min_frames": 2, "max_frames": 9}),
    ("Qwen2VLVideoProcessor", {"num_frames": 5}),
    ("Qwen2VLVideoProcessor", {"num_frames": 3}),  # rounded half to even: 2
    ("Qwen2VLVideoProcessor", {"fps": 3.0, "temporal_patch_size": 3}),
    ("Qwen3VLVideoProcessor", {}),
    ("Qwen3VLVideoProcessor", {"fps": 0.5, "min_frames": 3, "max_frames": 11}),
    ("Qwen3VLVideoProcessor", {"num_frames": 6, "fps": None}),
    ("Qwen3VLVideoProcessor", {"fps": None}),
]
# Clips of every kind of length and frame rate (one without a frame rate).
SAMPLE_CLIPS = [
    {"total_num_frames": total, "fps": fps}
    for total in (1, 2, 3, 5, 9, 24, 61, 300, 1001)
    for fps in (7.0, 29.97, 60.0)
] + [{"total_num_frames": 50, "fps": None}]
PUBLISHED_QWEN2_VL = {  # Qwen2-VL-7B-Instruct's preprocessor_config.json: no video file
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}


def assert_equal_to(ours: PatchedVideos, hf: dict) -> None:
    assert ours.pixel_values_videos.dtype == hf["pixel_values_videos"].dtype
    assert torch.equal(ours.pixel_values_videos, hf["pixel_values_videos"])  # bitwise
    assert torch.equal(ours.video_grid_thw, hf["video_grid_thw"])


@pytest.mark.parametrize("index", range(len(FRAME_CASES)), ids=[c[0] for c in FRAME_CASES])
def test_frames_give_transformers_pixels_and_grids(reference, index):
    _, kind, settings, shape = FRAME_CASES[index]
    processor = PROCESSORS[kind](**settings)
    frames = drawn_frames(*shape, seed=index)
    ours = processor([frames])
    assert_equal_to(ours, reference["outputs"][index])
    (grid,) = ours.video_grid_thw.tolist()
    assert tuple(grid) == processor.grid(*shape[:1], *shape[1:])  # planned before decoding
    assert processor.rows(*shape) == ours.pixel_values_videos.shape[0] // processor.merge_size**2


@pytest.mark.parametrize("index", range(len(SAMPLED)))
def test_a_clip_sampled_and_processed_is_transformers(reference, clip, index):
    path, _ = clip
    kind, settings = SAMPLED[index]
    processor = PROCESSORS[kind](**{**settings, "do_sample_frames": True})
    video = load_video(path, sampler=processor.sampler)  # only the kept frames decoded
    hf = reference["outputs"][len(FRAME_CASES) + index]
    assert list(video.metadata.frames_indices) == hf["frames_indices"]
    ours = processor([video])
    assert_equal_to(ours, hf)
    # planned from the header and packets alone, before decoding: the same frames and grid
    indices, grid = processor.plan(probe_video(path))
    assert indices == hf["frames_indices"] and [list(grid)] == hf["video_grid_thw"].tolist()
    # Qwen2.5-VL's second_per_grid_ts: the temporal patch over the kept frames' rate
    assert ours.second_per_grid_ts == (processor.temporal_patch_size / hf["sampled_fps"],)


@pytest.mark.parametrize("index", range(len(SAMPLING)))
def test_sampling_is_transformers_on_clips_of_every_length(reference, index):
    kind, settings = SAMPLING[index]
    processor = PROCESSORS[kind](**settings)
    expected = reference["outputs"][len(FRAME_CASES) + len(SAMPLED) + index]["indices"]
    assert sum(indices is not None for indices in expected) > len(expected) // 2
    for fields, indices in zip(SAMPLE_CLIPS, expected, strict=True):
        total, fps = fields["total_num_frames"], fields["fps"]
        metadata = VideoMetadata(total, fps, 8, 8, None, ())
        if indices is None:  # transformers raised: so do we, naming the argument
            with pytest.raises(ValueError, match=r"num_frames|fps"):
                processor.sample_frames(metadata)
        else:
            assert processor.sample_frames(metadata) == indices, fields


def test_a_directory_without_video_settings_takes_the_image_processors(reference):
    """transformers falls back to preprocessor_config.json (published Qwen2-VL directories
    have no video_preprocessor_config.json): its pixel range applies to videos."""
    processor = read_video_processor(reference["directory"])
    assert type(processor) is Qwen2VLVideoProcessor
    assert (processor.min_pixels, processor.max_pixels) == (3136, 12845056)
    hf = reference["outputs"][-1]
    assert hf["type"] == "Qwen2VLVideoProcessor"
    assert_equal_to(processor([drawn_frames(4, 40, 60)]), hf)


def test_video_settings_files_are_found_as_transformers_finds_them(tmp_path):
    assert Qwen2VLVideoProcessor.from_directory(tmp_path) == Qwen2VLVideoProcessor()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_QWEN2_VL))
    video_settings = {
        "size": {"shortest_edge": 4096, "longest_edge": 65536},
        "fps": 2,
        "do_sample_frames": True,
    }
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video_settings))
    found = Qwen2VLVideoProcessor.from_directory(tmp_path)
    assert (found.min_pixels, found.max_pixels, found.fps, found.sampler) == (
        4096,
        65536,
        2.0,
        found.sample_frames,
    )
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"video_processor": {"max_pixels": 200704}})
    )
    nested = Qwen2VLVideoProcessor.from_directory(tmp_path)
    assert (nested.min_pixels, nested.max_pixels) == (Qwen2VLVideoProcessor().min_pixels, 200704)
    published3 = {
        "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "patch_size": 16,
        "fps": 2,
    }
    qwen3 = Qwen3VLVideoProcessor.from_config(published3)
    assert (qwen3.max_pixels, qwen3.image_mean, qwen3.fps) == (25165824, (0.5, 0.5, 0.5), 2.0)
    # as transformers' constructor: fps absent is the class's 2, null is None
    assert Qwen3VLVideoProcessor.from_config({}).fps == 2
    assert Qwen3VLVideoProcessor.from_config({"fps": None, "num_frames": 8}).fps is None


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("qwen2_vl", Qwen2VLVideoProcessor),
        ("qwen2_5_vl", Qwen2VLVideoProcessor),
        ("qwen3_vl", Qwen3VLVideoProcessor),
        ("qwen3_5", Qwen3VLVideoProcessor),
    ],
)
def test_the_model_type_chooses_the_class_and_the_tower_checks_the_sizes(
    tmp_path, model_type, expected
):
    vision = {"patch_size": 7, "temporal_patch_size": 2, "spatial_merge_size": 2}
    config = {"model_type": model_type, "vision_config": vision}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=f"no video processor settings.*{expected.__name__}"):
        found = read_video_processor(tmp_path)
    assert type(found) is expected and found.patch_size == 7  # the tower's patch
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"patch_size": 7}))
    assert read_video_processor(tmp_path) == expected(patch_size=7)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(ValueError, match=r"video_preprocessor_config\.json: patch_size: 14, but"):
        read_video_processor(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError, match=r"config\.json, key 'model_type': expected one of"):
        read_video_processor(tmp_path)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"fps": -1}, "fps: expected a finite number > 0"),
        ({"fps": 2, "num_frames": 4}, "num_frames, fps: give one"),
        ({"num_frames": 0}, r"num_frames: expected an integer in \[1"),
        ({"min_frames": 5, "max_frames": 4}, "max_frames: expected an integer >= 5"),
        ({"resample": 1}, "resample: expected one of"),
        ({"max_pixels": 10**12}, "expected at most 16777216 pixels"),
        (
            {"video_processor_type": "LlavaNextVideoProcessor"},
            "video_processor_type: expected Qwen2VLVideoProcessor",
        ),
        ({"do_sample_frames": "yes"}, "do_sample_frames: expected true or false"),
    ],
)
def test_bad_settings_are_refused_by_file_and_key(settings, message):
    with pytest.raises(ValueError, match=message) as caught:
        Qwen2VLVideoProcessor.from_config(settings, "video_preprocessor_config.json")
    assert str(caught.value).startswith("video_preprocessor_config.json: ")


def test_bad_videos_are_refused_by_index_before_any_work():
    processor = Qwen2VLVideoProcessor(**SMALL)
    good = drawn_frames(2, 28, 28)
    with pytest.raises(ValueError, match=r"videos\[1\]: expected uint8 frames \[t, 3, h, w\]"):
        processor([good, good.float()])
    with pytest.raises(TypeError, match=r"videos\[0\]: expected a Video"):
        processor(["clip.mp4"])
    with pytest.raises(ValueError, match=r"videos\[0\]: .*aspect ratio"):
        processor([torch.zeros(2, 3, 1, 300, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="more than max_patches=10"):
        Qwen2VLVideoProcessor(**SMALL, max_patches=10)([good])
    clip = VideoMetadata(9, 3.0, 8, 8, 3.0, ())
    with pytest.raises(ValueError, match="num_frames: no frame is kept of a clip of 9 frames"):
        Qwen2VLVideoProcessor(num_frames=1).sample_frames(clip)  # rounds to 0 temporal patches
    with pytest.raises(ValueError, match=r"fewer than the temporal patch"):
        Qwen3VLVideoProcessor()([good[:1]])
