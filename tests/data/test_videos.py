"""Videos in fine-tuning data, on a tiny Qwen2.5-VL directory: conversation parts naming a
clip file or a list of frame files, mixed with images, in JSON Lines and in Hugging Face data
sets (a ``videos`` column). Encoding reads each clip's container only (its rows and text are
known before decoding); the frames are decoded, one clip at a time, when a batch is collated;
the ids and patches are transformers' processor's, and those of the video decoded at once. A
sample too long for ``max_seq_len`` is refused or skipped before any frame is decoded."""

import json
from pathlib import Path

import pytest
import torch
from video_helpers import (
    CLIP_FPS,
    FRAMES,
    RECORDS,
    answer,
    hf_video_outputs,
    hf_video_settings,
    text,
    user,
    video,
    write_media,
)

import fusion.preprocessing
from fusion.data import (
    ChatTemplate,
    Collate,
    ConversationEncoder,
    DataError,
    MicroBatches,
    StepBatches,
    encode_conversations,
    read_conversations,
    read_encoded,
    read_hf_dataset,
)
from fusion.preprocessing import VideoBounds, VideoError, load_video, read_video_processor
from qwen3_helpers import QWEN3_PREPROCESSOR, write_qwen3_dir
from qwen_helpers import PAD, QWEN_PIXELS, VIDEO_PAD, write_qwen_dir

KEYS = (
    "tokens",
    "labels",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)  # an odd count: the last frame repeated for the temporal patch


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return write_qwen_dir(tmp_path_factory.mktemp("qwen") / "qwen2_5_vl", "qwen2_5_vl")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    write_media(root)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root / "train.jsonl"


@pytest.fixture
def decodes(monkeypatch) -> list:
    """Every clip (or frame list) the data side decodes, in order."""
    seen, real = [], fusion.preprocessing.load_video

    def counted(source, **kwargs):
        seen.append(source)
        return real(source, **kwargs)

    monkeypatch.setattr(fusion.preprocessing, "load_video", counted)
    return seen


def test_videos_are_planned_from_their_containers_and_decoded_when_collated(
    qwen_dir, data, decodes
):
    encoder = ConversationEncoder.from_directory(qwen_dir)
    read = read_conversations(data)
    clip, frames = data.parent / "clip.mp4", tuple(data.parent / f for f in FRAMES)
    assert [c.videos for c in read.conversations] == [(clip,), (frames,), (clip, frames), ()]
    encoded = encode_conversations(encoder, read.conversations, max_seq_len=1024)
    assert decodes == []  # nothing decoded to encode
    samples = encoded.samples
    assert [s.pixels_loaded for s in samples] == [False, False, False, True]
    for sample in samples:  # the rows planned are the placeholders written
        assert int((sample.tokens == VIDEO_PAD).sum()) == sum(v.rows for v in sample.videos)
        assert not bool((sample.labels == VIDEO_PAD).any())  # never a target
    assert samples[0].videos[0].grid == (3, 2, 4)  # 5 frames padded to 6, 40 x 60 -> 28 x 56

    loaded = encoder.load_pixels(samples)
    assert decodes == [clip, list(frames), clip, list(frames)]  # one clip at a time
    for conversation, sample in zip(read.conversations, loaded, strict=True):
        whole = encoder.encode_conversation(conversation)  # decoded at once, as encode does
        for key in KEYS:
            mine, theirs = getattr(sample, key), getattr(whole, key)
            assert torch.equal(mine, theirs) or mine.numel() == theirs.numel() == 0, key

    # The patches are the video processor's on the kept frames; the seconds 2 / fps.
    processor = read_video_processor(qwen_dir)
    patched = processor([load_video(clip, sampler=processor.sampler)])
    assert torch.equal(loaded[0].pixel_values_videos, patched.pixel_values_videos)
    assert loaded[0].second_per_grid_ts.tolist() == [pytest.approx(2 / CLIP_FPS)]
    assert loaded[1].second_per_grid_ts.tolist() == [pytest.approx(2 / 24)]  # frames: 24 fps

    # A packed batch of them: each entry in order of appearance across the batch.
    batch = Collate(PAD, 1024, encoder=encoder)(samples)
    videos = batch.encoder_input["video"]
    assert videos["video_grid_thw"].tolist() == [
        list(v.grid) for row in [[0, 1, 2, 3]] for i in row for v in samples[i].videos
    ]
    assert torch.equal(
        videos["pixel_values_videos"], torch.cat([s.pixel_values_videos for s in loaded[:3]])
    )
    assert batch.encoder_input["image"]["image_grid_thw"].size(0) == 2


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_ids_and_patches_equal_transformers_processor(model_type, qwen_dir, data, tmp_path):
    """A conversation's ids, patches, grids and seconds with a clip and frame files:
    transformers' processor on the template's text and the same decoded clips (Qwen3-VL's
    sampling 2 frames a second and writing their timestamps)."""
    if model_type == "qwen3_vl":
        directory = write_qwen3_dir(tmp_path / "qwen3_vl")
        settings = {k: QWEN3_PREPROCESSOR[k] for k in ("size", "patch_size", "image_mean")}
        settings |= {"image_std": QWEN3_PREPROCESSOR["image_std"]}
        video_class, processor = "Qwen3VLVideoProcessor", "Qwen3VLProcessor"
        sample_frames = True
    else:
        directory = qwen_dir
        settings = {
            **QWEN_PIXELS,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        }
        video_class, processor, sample_frames = (
            "Qwen2VLVideoProcessor",
            "Qwen2_5_VLProcessor",
            False,
        )
    encoder = ConversationEncoder.from_directory(directory)
    messages = [user(video("clip.mp4"), video(FRAMES), text("Same?")), answer("no")]
    file = tmp_path / "train.jsonl"
    file.write_text(json.dumps({"messages": messages}) + "\n")
    for name in ("clip.mp4", *FRAMES):  # the media of data's directory
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes((data.parent / name).read_bytes())
    conversation = read_conversations(file).conversations[0]
    sample = encoder.encode_conversation(conversation)
    clips = [load_video(tmp_path / "clip.mp4"), load_video([tmp_path / f for f in FRAMES])]
    (reference,) = hf_video_outputs(
        [
            {
                "processor": processor,
                "class": video_class,
                "settings": hf_video_settings(settings, sample_frames),
                "tokenizer": str(directory),
                "prompts": [ChatTemplate.from_directory(directory).render(conversation.messages)],
                "videos": [clip.frames for clip in clips],
                "kwargs": {"video_metadata": [clip.metadata.as_transformers() for clip in clips]},
            }
        ],
        tmp_path,
    )
    assert reference["input_ids"][0] == sample.tokens.tolist()
    assert torch.equal(reference["pixel_values_videos"], sample.pixel_values_videos)
    assert torch.equal(reference["video_grid_thw"], sample.video_grid_thw)
    if model_type == "qwen2_5_vl":
        assert torch.tensor(reference["second_per_grid_ts"]).tolist() == pytest.approx(
            sample.second_per_grid_ts.tolist()
        )
    else:  # 4 of the clip's 5 frames kept (at least min_frames), the 3 frame files: 2 patches
        assert sample.video_grid_thw[:, 0].tolist() == [2, 2]


def test_a_sample_too_long_is_refused_or_skipped_before_any_frame_is_decoded(
    qwen_dir, tmp_path, decodes
):
    """The rows a video brings come from its container: a clip whose frames cannot be decoded
    (its frame data zeroed, its index intact) is planned all the same, so that a sample past
    max_seq_len is refused, or skipped, without a frame decoded; kept, it fails only when its
    batch is made, naming the sample and the clip."""
    write_media(tmp_path)
    broken = tmp_path / "broken.mp4"
    raw = bytearray((tmp_path / "clip.mp4").read_bytes())
    start = raw.find(b"mdat") + 4
    raw[start:] = bytes(len(raw) - start)
    broken.write_bytes(bytes(raw))
    with pytest.raises(VideoError, match=r"broken\.mp4"):
        load_video(broken)
    decodes.clear()
    records = [
        {"messages": [user(text("Say hi.")), answer("hi")]},
        {"messages": [user(video("broken.mp4"), text("What moves?")), answer("a square")]},
    ]
    file = tmp_path / "train.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in records))
    encoder = ConversationEncoder.from_directory(qwen_dir)
    full = read_encoded(encoder, file, max_seq_len=1024).samples[1]
    assert full.videos[0].rows == 6 and decodes == []
    limit = len(full) - 1
    with pytest.raises(DataError, match=rf"train\.jsonl:2: {len(full)} tokens, longer than"):
        read_encoded(encoder, file, max_seq_len=limit)
    skipped = read_encoded(encoder, file, max_seq_len=limit, skip_bad=True)
    assert len(skipped.samples) == 1 and len(skipped.skipped) == 1
    assert "longer than max_seq_len" in str(skipped.skipped[0])
    assert decodes == []  # refused and skipped with nothing decoded
    with pytest.raises(ValueError, match=r"train\.jsonl:2: .*broken\.mp4"):
        Collate(PAD, 1024, encoder=encoder)([full])


def test_bad_videos_are_refused_naming_file_and_line(qwen_dir, data, model_dirs, tmp_path):
    bad = [
        (video("missing.mp4"), r"train\.jsonl:1: video .*missing\.mp4.*: no such file"),
        (video([]), r"train\.jsonl:1: messages\[0\]\.content\[0\]\.video: expected a clip"),
        (video("https://x/a.mp4"), r"content\[0\]\.video: 'https://x/a\.mp4' is a URL"),
        ({"type": "video"}, r"content\[0\]: a video item needs a clip file"),
    ]
    for item, problem in bad:
        file = tmp_path / "train.jsonl"
        file.write_text(json.dumps({"messages": [user(item, text("?")), answer("no")]}) + "\n")
        with pytest.raises(DataError, match=problem):
            read_conversations(file)
    # LLaVA-Video's key beside LLaVA-Instruct's turns: refused, not dropped.
    turns = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "no"}]
    file.write_text(json.dumps({"video": "clip.mp4", "conversations": turns}) + "\n")
    with pytest.raises(DataError, match=r"train\.jsonl:1: video: videos given, but LLaVA"):
        read_conversations(file)
    # A clip that is no video: refused when encoded, before training, naming it.
    (tmp_path / "not.mp4").write_bytes(b"\x00" * 64)
    file.write_text(json.dumps({"messages": [user(video("not.mp4")), answer("no")]}) + "\n")
    encoder = ConversationEncoder.from_directory(qwen_dir)
    with pytest.raises(DataError, match=r"train\.jsonl:1: .*not\.mp4: not a readable video"):
        read_encoded(encoder, file, max_seq_len=1024)
    # A model that takes no videos refuses them (its template would drop them).
    llava = ConversationEncoder.from_directory(model_dirs["llava"][0])
    conversation = read_conversations(data).conversations[0]
    with pytest.raises(DataError, match=r"train\.jsonl:1: videos: 1 given, but the model takes"):
        llava.check_conversation(conversation)


def test_a_data_set_videos_column(qwen_dir, data, tmp_path):
    """TRL's columns: ``messages`` with ``{"type": "video"}`` items and ``videos`` naming the
    files (paths, lists of frame paths, or datasets.Video's path structs) relative to the
    data set: the samples of the JSON Lines file's conversations; embedded clip bytes are
    refused naming the row."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root = data.parent

    def embedded(messages: list[dict]) -> list[dict]:
        out = []
        for message in messages:
            content = [
                {"type": "video"} if part["type"] == "video" else part
                for part in message["content"]
            ]
            out.append({**message, "content": content})
        return out

    encoder = ConversationEncoder.from_directory(qwen_dir)
    expected = encode_conversations(
        encoder, read_conversations(data).conversations, max_seq_len=1024
    ).samples
    clip = {"bytes": None, "path": "clip.mp4"}  # as datasets.Video stores a file
    cases = {  # Arrow keeps one type a column: one kind of video per data set
        "paths": ([0], [["clip.mp4"]]),
        "frames": ([1], [[FRAMES]]),
        "structs": ([0], [[clip]]),
    }
    for kind, (rows, videos) in cases.items():
        messages = [embedded(RECORDS[i]["messages"]) for i in rows]
        pq.write_table(pa.table({"messages": messages, "videos": videos}), root / f"{kind}.parquet")
        read = read_hf_dataset(root / f"{kind}.parquet")
        got = encode_conversations(encoder, read.conversations, max_seq_len=1024).samples
        for mine, i in zip(got, rows, strict=True):
            assert torch.equal(mine.tokens, expected[i].tokens), kind
            assert mine.videos == expected[i].videos, kind
    records = RECORDS
    table = pa.table(
        {
            "messages": [embedded(records[0]["messages"])],
            "videos": [[{"bytes": b"\x00\x01", "path": None}]],
        }
    )
    pq.write_table(table, root / "bytes.parquet")
    turns = [{"from": "human", "value": "What?"}, {"from": "gpt", "value": "no"}]
    llava = pa.table({"conversations": [turns], "videos": [["clip.mp4"]]})
    pq.write_table(llava, root / "llava.parquet")
    with pytest.raises(DataError, match=r"llava\.parquet:row 0: videos: videos given, but"):
        read_hf_dataset(root / "llava.parquet")
    with pytest.raises(DataError, match=r"bytes\.parquet:row 0: videos\[0\]: a clip's bytes"):
        read_hf_dataset(root / "bytes.parquet")


def test_the_encoder_refuses_video_settings_it_cannot_use(qwen_dir, data):
    encoder = ConversationEncoder.from_directory(qwen_dir)
    parts = (encoder.template, encoder.tokenizer)
    with pytest.raises(ValueError, match=r"video_processor: given for a text-only model"):
        ConversationEncoder(*parts, video_processor=encoder.video_processor, video_token_id=1)
    with pytest.raises(ValueError, match=r"video_token_id: expected a non-negative integer"):
        ConversationEncoder(
            *parts, processor=encoder.processor, video_processor=encoder.video_processor
        )
    with pytest.raises(TypeError, match=r"video_bounds: expected a VideoBounds or None, got dict"):
        ConversationEncoder(*parts, video_bounds={"max_frames": 10})
    # Bounds the caller sets are applied when the clip is planned, before decoding.
    bounded = ConversationEncoder(
        *parts,
        processor=encoder.processor,
        video_processor=encoder.video_processor,
        video_token_id=VIDEO_PAD,
        video_bounds=VideoBounds(max_frames=4),
    )
    with pytest.raises(VideoError, match=r"clip\.mp4: claims 5 frames, more than max_frames=4"):
        bounded.plan_video(data.parent / "clip.mp4")


def test_the_loader_decodes_clips_in_its_workers(qwen_dir, data, decodes):
    """With worker processes, no clip is decoded in the training process: each micro-batch's
    clips are decoded (and patched) in the worker that makes it."""
    encoder = ConversationEncoder.from_directory(qwen_dir)
    samples = read_encoded(encoder, data, max_seq_len=1024).samples
    collate = Collate(PAD, 1024, encoder=encoder)
    batches = StepBatches(samples, [[0, 1], [2, 3]], collate)
    with MicroBatches(batches, num_workers=1) as stream:
        made = [item.batch for item in stream]
    assert decodes == []  # the workers' decodes happen in their own processes
    expected = [collate(samples[:2]), collate(samples[2:])]
    for batch, theirs in zip(made, expected, strict=True):
        assert batch is not None
        mine, want = batch.encoder_input["video"], theirs.encoder_input["video"]
        assert all(torch.equal(mine[key], want[key]) for key in want)
