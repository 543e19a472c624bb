"""Reading clips: files written here with PyAV decode to the frames transformers' PyAV reader
gives for the same sample (seeking, never the whole clip), frame lists and decoded frames are
taken too, transformers' sampling rules are followed, and broken or hostile clips are refused
before decoding with one error naming the file."""

import os
import struct
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image
from video_helpers import drawn_frames, write_clip

import fusion.media.video as video_module
from fusion.media.video import (
    VideoBounds,
    VideoError,
    VideoMetadata,
    default_sample_indices,
    load_video,
    probe_video,
)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Clips at odd sizes and frame rates: H.264 with B-frames and short key frame intervals
    (so samples need seeks), and Motion JPEG in AVI (every frame a key frame)."""
    folder = tmp_path_factory.mktemp("clips")
    made = {}
    for name, t, h, w, fps, codec, fmt, options in (
        ("h264.mp4", 23, 29, 37, 7.0, "libx264", "yuv444p", {"g": "5", "bf": "2"}),
        ("ntsc.mkv", 17, 18, 26, 30000 / 1001, "libx264", "yuv420p", {"g": "4"}),
        ("mjpeg.avi", 9, 24, 32, 12.5, "mjpeg", "yuvj444p", None),
    ):
        frames = drawn_frames(t, h, w, seed=t)
        made[name] = (write_clip(folder / name, frames, fps, codec, fmt, options), frames)
    return made


def hf_pyav(path: Path, indices: list[int]):
    """transformers' own PyAV reader (decodes from the start) with the same indices."""
    from transformers.video_utils import load_video as hf_load_video

    frames, metadata = hf_load_video(
        str(path), backend="pyav", sample_indices_fn=lambda metadata, **_: np.array(indices)
    )
    return torch.from_numpy(frames).permute(0, 3, 1, 2), metadata


@pytest.mark.parametrize("name", ["h264.mp4", "ntsc.mkv", "mjpeg.avi"])
def test_a_clip_decodes_to_transformers_frames_for_each_sample(clips, name):
    path, drawn = clips[name]
    everything = load_video(path)
    assert everything.frames.shape == drawn.shape
    # lossy codecs: near the drawn frames (the right frames, in order), not equal
    assert (everything.frames.float() - drawn.float()).abs().mean() < 8
    total = drawn.shape[0]
    for indices in ([0], [total - 1], [1, 2, 2, 3], [0, 4, total // 2, total - 2], [3, total - 1]):
        video = load_video(path, sampler=lambda metadata, chosen=indices: chosen)
        unique = sorted(set(indices))  # transformers' reader keeps a repeated index once
        reference, hf_metadata = hf_pyav(path, unique)
        assert torch.equal(video.frames, reference[[unique.index(i) for i in indices]]), indices
        assert torch.equal(video.frames, everything.frames[indices])  # seeks land exactly
        assert video.metadata.frames_indices == tuple(indices)
        if hf_metadata.total_num_frames == 0:
            continue  # MKV records no frame count, and transformers' PyAV reader counts none
        for key in ("total_num_frames", "fps", "width", "height", "duration"):
            assert getattr(video.metadata, key) == pytest.approx(hf_metadata[key]), key


class CountingContainer:
    """A PyAV container whose decoded frames and seeks are counted."""

    def __init__(self, container, counts):
        self.container, self.counts = container, counts

    def seek(self, *args, **kwargs):
        self.counts["seeks"] += 1
        return self.container.seek(*args, **kwargs)

    def decode(self, *args, **kwargs):
        for frame in self.container.decode(*args, **kwargs):
            self.counts["frames"] += 1
            yield frame


def test_only_the_frames_kept_are_decoded(clips, monkeypatch):
    """Frames far into the clip are reached by seeking to the key frame before them (every
    5th frame here), not by decoding from the start."""
    path, drawn = clips["h264.mp4"]
    counts = {"frames": 0, "seeks": 0}
    read = video_module._ClipIndex.read.__func__

    def counting_read(cls, container, where, bounds):
        index = read(cls, container, where, bounds)
        index.container = CountingContainer(index.container, counts)
        return index

    last = drawn.shape[0] - 1
    everything = load_video(path).frames
    monkeypatch.setattr(video_module._ClipIndex, "read", classmethod(counting_read))
    video = load_video(path, sampler=lambda metadata: [2, 3, last])
    assert torch.equal(video.frames, everything[[2, 3, last]])
    # 2 and 3 share a key frame: decoded on, no second seek; the last one: one seek
    assert counts["seeks"] == 2
    assert counts["frames"] < 4 + 5 + 3  # up to 3, then one key-frame interval (and lookahead)
    counts.update(frames=0, seeks=0)
    assert torch.equal(load_video(path).frames, everything)
    assert counts == {"frames": drawn.shape[0], "seeks": 1}  # every frame: decoded on
    counts.update(frames=0, seeks=0)
    metadata = probe_video(path)
    assert counts == {"frames": 0, "seeks": 0}  # nothing decoded
    assert metadata == replace(
        load_video(path, sampler=lambda m: [0]).metadata, frames_indices=tuple(range(last + 1))
    )


def test_the_sampler_is_given_the_clips_metadata(clips):
    path, drawn = clips["h264.mp4"]
    seen = []
    load_video(path, sampler=lambda metadata: seen.append(metadata) or [0])
    (metadata,) = seen
    assert (metadata.total_num_frames, metadata.fps, metadata.width, metadata.height) == (
        drawn.shape[0],
        7.0,
        37,
        29,
    )
    assert metadata.video_backend == "pyav"


@given(
    total=st.integers(1, 400),
    clip_fps=st.floats(1, 120),
    num_frames=st.none() | st.integers(1, 400),
    fps=st.none() | st.floats(0.1, 60),
)
def test_default_sampling_is_transformers(total, clip_fps, num_frames, fps):
    from transformers.video_utils import VideoMetadata as HfMetadata
    from transformers.video_utils import default_sample_indices_fn

    if num_frames is not None and fps is not None:
        fps = None
    metadata = VideoMetadata(total, clip_fps, 8, 8, total / clip_fps, ())
    hf_metadata = HfMetadata(total_num_frames=total, fps=clip_fps)
    try:
        expected = default_sample_indices_fn(hf_metadata, num_frames=num_frames, fps=fps)
    except ValueError:
        with pytest.raises(ValueError, match="num_frames"):
            default_sample_indices(metadata, num_frames=num_frames, fps=fps)
        return
    assert default_sample_indices(metadata, num_frames=num_frames, fps=fps) == expected.tolist()


def test_frame_images_as_a_directory_a_list_tensors_and_pillow(tmp_path):
    drawn = drawn_frames(12, 15, 21)
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, frame in enumerate(drawn):  # natural order: frame_2 before frame_10
        Image.fromarray(frame.permute(1, 2, 0).numpy()).save(folder / f"frame_{i}.png")
    (folder / "notes.txt").write_text("not a frame")
    paths = sorted(folder.glob("*.png"), key=lambda p: int(p.stem.split("_")[1]))
    keep = [0, 5, 10, 11]
    for source in (
        folder,
        paths,
        drawn,
        [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in drawn],
    ):
        video = load_video(source, sampler=lambda metadata: keep, fps=3.0)
        assert torch.equal(video.frames, drawn[keep]), type(source)
        assert video.metadata.fps == 3.0 and video.metadata.total_num_frames == 12
        assert video.metadata.timestamps == [i / 3.0 for i in keep]
        assert video.metadata.sampled_fps == 4 / 12 * 3.0
    # Only the kept frames are decoded: a frame outside the sample with a broken body (its
    # header intact) is never noticed; inside the sample it is an error naming it.
    broken = folder / "frame_3.png"
    broken.write_bytes(broken.read_bytes()[:60])
    assert torch.equal(load_video(folder, sampler=lambda metadata: keep).frames, drawn[keep])
    with pytest.raises(ValueError, match=r"frame_3\.png"):
        load_video(folder, sampler=lambda metadata: [3])
    probed = probe_video(folder, fps=3.0)  # from the headers: nothing decoded
    assert (probed.total_num_frames, probed.width, probed.height) == (12, 21, 15)
    assert probed.frames_indices == tuple(range(12))


def test_frames_of_different_sizes_or_with_transparency_are_refused(tmp_path):
    for i, size in enumerate([(8, 6), (8, 6), (9, 6)]):
        Image.new("RGB", size, (i, 0, 0)).save(tmp_path / f"{i}.png")
    with pytest.raises(VideoError, match=r"2\.png.*9 x 6.*0\.png.*8 x 6"):
        load_video(tmp_path)
    with pytest.raises(VideoError, match="transparency"):
        load_video([Image.new("RGBA", (4, 4))] * 2)
    with pytest.raises(VideoError, match=r"frames: expected a uint8 tensor \[t, 3, h, w\]"):
        load_video(torch.zeros(2, 4, 5, 5, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"source: expected .* got an empty list"):
        load_video([])


def test_bad_samples_are_refused_by_name(clips):
    path, _ = clips["mjpeg.avi"]
    for indices, why in (([], "at least one"), ([0, 9], r"\[0, 8\]"), ([3, 1], "not in order")):
        with pytest.raises(VideoError, match=f"mjpeg.avi: the sampler gave .*{why}"):
            load_video(path, sampler=lambda metadata, chosen=indices: chosen)
    with pytest.raises(ValueError, match="num_frames: 10 frames asked for, but the clip holds 9"):
        load_video(path, sampler=lambda metadata: default_sample_indices(metadata, num_frames=10))
    with pytest.raises(ValueError, match="fps: sampling a number of frames a second"):
        load_video(drawn_frames(3, 4, 4), sampler=lambda m: default_sample_indices(m, fps=2))


def avi_header_patched(source: Path, target: Path, frames=None, size=None) -> Path:
    """An AVI whose header claims ``frames`` frames or frames of ``size`` (its stream header,
    main header and every JPEG's start-of-frame marker rewritten)."""
    data = bytearray(source.read_bytes())
    if frames is not None:
        struct.pack_into("<I", data, data.find(b"strh") + 40, frames)  # dwLength
        struct.pack_into("<I", data, data.find(b"avih") + 8 + 16, frames)  # dwTotalFrames
    if size is not None:
        width, height = size
        struct.pack_into("<ii", data, data.find(b"strf") + 12, width, height)
        struct.pack_into("<II", data, data.find(b"avih") + 8 + 32, width, height)
        start = 0
        while (start := data.find(b"\xff\xc0", start) + 1) > 0:
            struct.pack_into(">HH", data, start + 4, height, width)
    target.write_bytes(data)
    return target


def test_broken_and_hostile_clips_are_refused_naming_the_file(clips, tmp_path):
    path, _ = clips["h264.mp4"]
    truncated = tmp_path / "truncated.mp4"  # its index (at the end) cut off
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    # its index first, then frames cut off: the header claims frames the file lacks
    indexed = write_clip(
        tmp_path / "indexed.mp4",
        drawn_frames(12, 16, 16),
        5.0,
        container_options={"movflags": "faststart"},
    )
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(indexed.read_bytes()[: indexed.stat().st_size * 2 // 3])
    text = tmp_path / "notes.mp4"
    text.write_text("this is a text file renamed .mp4\n" * 20)
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    avi, _ = clips["mjpeg.avi"]
    million = avi_header_patched(avi, tmp_path / "million.avi", frames=1_000_000)
    huge = avi_header_patched(avi, tmp_path / "huge.avi", size=(12000, 9000))
    # playlists naming other files: FFmpeg reads only the bytes given it, opens nothing else
    playlist = tmp_path / "playlist.mp4"
    playlist.write_text(f"#EXTM3U\n#EXT-X-TARGETDURATION:4\n#EXTINF:3.0,\n{path}\n#EXT-X-ENDLIST\n")
    concat = tmp_path / "concat.mp4"
    concat.write_text(f"ffconcat version 1.0\nfile '{path}'\n")
    for file, why in (
        (truncated, "not a readable video"),
        (cut, r"the header claims 12 frames but the file holds \d+: truncated"),
        (text, "not a readable video"),
        (empty, "an empty file"),
        (million, "claims 1000000 frames, more than max_frames=100000"),
        (huge, "frames of .* pixels: expected sides in"),
        (tmp_path / "missing.mp4", "no such file"),
        (playlist, "not a readable video"),
        (concat, "not a readable video"),
    ):
        with pytest.raises(VideoError, match=why) as caught:
            load_video(file)
        assert str(caught.value).startswith(str(file)), caught.value
        assert isinstance(caught.value, ValueError) and len(str(caught.value).splitlines()) == 1
    under_claimed = avi_header_patched(avi, tmp_path / "under.avi", frames=4)
    with pytest.raises(VideoError, match="claims 4 frames but the file holds 9"):
        load_video(under_claimed)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    fifo = tmp_path / "clip.mp4"
    os.mkfifo(fifo)
    with pytest.raises(VideoError, match="not a regular file"):
        load_video(fifo)


def test_the_bounds_are_the_callers(clips):
    path, drawn = clips["h264.mp4"]
    t, _, h, w = drawn.shape
    size = path.stat().st_size
    for bounds, why in (
        (VideoBounds(max_width=w - 1), "expected sides in"),
        (VideoBounds(max_height=h - 1), "expected sides in"),
        (VideoBounds(max_frames=t - 1), f"claims {t} frames, more than max_frames={t - 1}"),
        (VideoBounds(max_duration=1.0), "more than max_duration=1.0"),
        (VideoBounds(max_file_bytes=size - 1), f"{size} bytes, more than max_file_bytes"),
        (
            VideoBounds(max_decoded_bytes=t * 3 * h * w - 1),
            f"{t} frames of {w} x {h} kept would take {t * 3 * h * w} bytes decoded, more",
        ),
    ):
        with pytest.raises(VideoError, match=why):
            load_video(path, bounds=bounds)
    decoded = t * 3 * h * w
    exact = VideoBounds(w, h, t, max_file_bytes=size, max_decoded_bytes=decoded)
    assert load_video(path, bounds=exact).frames.shape == drawn.shape
    half = VideoBounds(max_decoded_bytes=decoded // 2)  # fewer frames kept: taken
    assert load_video(path, sampler=lambda m: [0, 1], bounds=half).frames.shape[0] == 2
    with pytest.raises(VideoError, match="frames: claims 3 frames, more than max_frames=2"):
        load_video(drawn[:3], bounds=VideoBounds(max_frames=2))
    for bad in ({"max_width": 0}, {"max_frames": 1.5}, {"max_duration": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            VideoBounds(**bad)


def test_without_pyav_one_line_names_the_extra(clips, monkeypatch):
    path, _ = clips["mjpeg.avi"]
    monkeypatch.setitem(sys.modules, "av", None)  # import av raises ImportError
    with pytest.raises(ImportError) as caught:
        load_video(path)
    assert str(caught.value) == (
        "reading video files needs PyAV: pip install 'torch-early-fusion[video]'"
    )
    # frames given as images or tensors need no decoder
    assert load_video(drawn_frames(2, 4, 4)).frames.shape == (2, 3, 4, 4)
