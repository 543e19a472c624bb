"""Hugging Face data sets in, written by ``datasets`` in the tests: a Parquet file (images
embedded as PNG bytes), a directory of Parquet shards, a ``save_to_disk`` directory and a
``datasets.Dataset`` in memory give the samples (ids, labels, pixels) of the same
conversations as JSON Lines with image files; hostile rows are refused naming the row, or
skipped with nothing else lost."""

import io
import json
import struct
import zlib

import pytest
import torch
from PIL import Image

from fusion.data import (
    ConversationEncoder,
    DataError,
    EmbeddedImage,
    encode_conversations,
    hf_datasets,
    read_conversations,
    read_hf_dataset,
)
from vlm_helpers import make_image, trl_features

datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")
datasets.disable_progress_bars()

SIZES = [(20, 30), (45, 13), (16, 16)]


def png(height: int, width: int, seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(make_image(height, width, seed)).save(out, format="PNG")
    return out.getvalue()


def conversations() -> list[tuple[list[dict], list[int]]]:
    """(messages with image items, the images they show, by index into SIZES)."""
    image, text = {"type": "image"}, lambda t: {"type": "text", "text": t}
    return [
        (
            [
                {"role": "system", "content": [text("Be brief.")]},
                {"role": "user", "content": [image, text("What?")]},
                {"role": "assistant", "content": [text("A cat.")]},
                {"role": "user", "content": [text("And these"), image, image]},
                {"role": "assistant", "content": [text("A dog, twice!")]},
            ],
            [0, 1, 2],
        ),
        (
            [
                {"role": "user", "content": [text("Say hi")]},
                {"role": "assistant", "content": [text("Hi.")]},
            ],
            [],
        ),
        (
            [
                {"role": "user", "content": [text("Again:"), image]},
                {"role": "assistant", "content": [text("The same cat.")]},
            ],
            [0],
        ),
    ]


def jsonl_and_dataset(directory):
    """The conversations as JSON Lines with PNG files, and as a datasets.Dataset with the
    same PNG bytes embedded (TRL's messages + images columns)."""
    names = []
    for i, (h, w) in enumerate(SIZES):
        names.append(f"img{i}.png")
        (directory / names[-1]).write_bytes(png(h, w, i))
    lines, rows = [], {"messages": [], "images": []}
    for messages, shown in conversations():
        files = iter(shown)
        with_paths = [
            {
                **m,
                "content": [
                    {"type": "image", "path": names[next(files)]}
                    if item["type"] == "image"
                    else item
                    for item in m["content"]
                ],
            }
            for m in messages
        ]
        lines.append(json.dumps({"messages": with_paths}))
        rows["messages"].append(messages)
        rows["images"].append([Image.open(io.BytesIO(png(*SIZES[i], i))) for i in shown])
    (directory / "train.jsonl").write_text("\n".join(lines) + "\n")
    dataset = datasets.Dataset.from_dict(rows)  # Pillow images: datasets.Image stores bytes
    return directory / "train.jsonl", dataset


def write(dataset, directory, layout: str):
    if layout == "parquet":
        dataset.to_parquet(str(directory / "train.parquet"))
        return directory / "train.parquet"
    if layout == "parquet_shards":
        (directory / "shards").mkdir()
        for index in range(2):
            shard = dataset.shard(2, index, contiguous=True)
            shard.to_parquet(str(directory / "shards" / f"train-{index:05d}-of-00002.parquet"))
        return directory / "shards"
    if layout == "save_to_disk":
        dataset.save_to_disk(str(directory / "saved"))
        return directory / "saved"
    assert layout == "dataset"
    return dataset


@pytest.mark.parametrize("layout", ["parquet", "parquet_shards", "save_to_disk", "dataset"])
@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_data_set_gives_the_samples_of_json_lines(model_dirs, tmp_path, family, layout):
    jsonl, dataset = jsonl_and_dataset(tmp_path)
    data = write(dataset, tmp_path, layout)
    encoder = ConversationEncoder.from_directory(model_dirs[family][0])
    expected = encode_conversations(
        encoder, read_conversations(jsonl).conversations, max_seq_len=4096
    ).samples
    read = read_hf_dataset(data) if layout == "dataset" else read_conversations(data)
    got = encode_conversations(encoder, read.conversations, max_seq_len=4096).samples
    assert len(got) == len(expected) == 3
    # No pixels and no bytes kept: each image by its place in the data set.
    refs = [ref for sample in got for ref in sample.images]
    assert len(refs) == 4 and all(isinstance(ref.embedded, EmbeddedImage) for ref in refs)
    assert all(sample.pixel_values.numel() == 0 for sample in got)
    for ours, theirs in zip(encoder.load_pixels(got), encoder.load_pixels(expected), strict=True):
        assert torch.equal(ours.tokens, theirs.tokens)
        assert torch.equal(ours.labels, theirs.labels)
        assert torch.equal(ours.pixel_values, theirs.pixel_values)
        assert torch.equal(ours.image_grid_thw, theirs.image_grid_thw)
    if layout == "parquet_shards":  # each shard counts its own rows
        assert [c.source.rsplit("/", 1)[1] for c in read.conversations] == [
            "train-00000-of-00002.parquet:row 0",
            "train-00000-of-00002.parquet:row 1",
            "train-00001-of-00002.parquet:row 0",
        ]
    elif layout != "dataset":
        assert [c.source for c in read.conversations] == [f"{data}:row {i}" for i in range(3)]


def test_llava_instruct_columns(model_dirs, tmp_path):
    """LLaVA-Instruct's columns: conversations with "<image>" markers, and one image."""
    directory = model_dirs["idefics3"][0]
    (tmp_path / "a.png").write_bytes(png(20, 30, 0))
    record = {
        "image": "a.png",
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"},
            {"from": "gpt", "value": "A cat."},
        ],
    }
    (tmp_path / "llava.jsonl").write_text(json.dumps(record) + "\n")
    rows = {**record, "image": Image.open(io.BytesIO(png(20, 30, 0)))}
    datasets.Dataset.from_dict({k: [v] for k, v in rows.items()}).to_parquet(
        str(tmp_path / "llava.parquet")
    )
    encoder = ConversationEncoder.from_directory(directory)
    (theirs,) = read_conversations(tmp_path / "llava.jsonl").conversations
    (ours,) = read_conversations(tmp_path / "llava.parquet").conversations
    expected = encoder.encode_conversation(theirs)
    got = encoder.encode_conversation(ours)
    assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.labels, expected.labels)
    assert torch.equal(got.pixel_values, expected.pixel_values)


def huge_png() -> bytes:
    """A PNG whose header declares 30000 x 30000 pixels (900 million): a few bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def hostile_rows():
    good = conversations()[2][0]
    one_image = [{"bytes": png(16, 16, 0), "path": None}]
    return [
        ("good", good, one_image, None),
        ("missing messages", None, [], "messages: expected a non-empty list, got None"),
        ("undecodable", good, [{"bytes": b"not a png", "path": None}], "images[0]: not an image"),
        (
            "more markers than images",
            conversations()[0][0],
            one_image,
            "3 image item(s) in messages, but 1 image(s) in 'images'",
        ),
        ("huge declared size", good, [{"bytes": huge_png(), "path": None}], "max_pixels=89478485"),
        ("good again", good, one_image, None),
    ]


def test_hostile_rows_are_refused_naming_the_row(tmp_path):
    rows = hostile_rows()
    features = trl_features()
    data = {"messages": [r[1] for r in rows], "images": [r[2] for r in rows]}
    file = tmp_path / "hostile.parquet"
    datasets.Dataset.from_dict(data, features=features).to_parquet(str(file))
    for bad in (1, 2, 3, 4):
        # Each bad row alone after the good one: the first bad row is the one named.
        only = [rows[0], rows[bad]]
        single = tmp_path / f"bad{bad}.parquet"
        datasets.Dataset.from_dict(
            {"messages": [r[1] for r in only], "images": [r[2] for r in only]}, features=features
        ).to_parquet(str(single))
        with pytest.raises(DataError) as caught:
            read_conversations(single)
        assert str(caught.value).startswith(f"{single}:row 1: ")
        assert rows[bad][3] in str(caught.value)
        assert "\n" not in str(caught.value)
        assert caught.value.row == 1
    read = read_conversations(file, skip_bad=True)
    assert [c.row for c in read.conversations] == [0, 5]  # nothing good lost
    assert [e.row for e in read.skipped] == [1, 2, 3, 4]
    for error, (_, _, _, problem) in zip(read.skipped, rows[1:5], strict=True):
        assert problem in str(error)


def test_whole_file_problems(tmp_path):
    datasets.Dataset.from_dict({"text": ["hi"]}).to_parquet(str(tmp_path / "plain.parquet"))
    with pytest.raises(DataError, match=r"expected a 'messages' column .* got the columns"):
        read_conversations(tmp_path / "plain.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="a directory, but neither one written by"):
        read_conversations(tmp_path / "empty")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["hi"]})})
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"a DatasetDict \(splits \['train'\]\): give one"):
        read_conversations(tmp_path / "dict")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1" + b"\0" * 20)
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_conversations(tmp_path / "broken.parquet")


def test_images_are_read_again_per_batch_from_few_row_groups(model_dirs, tmp_path):
    """One row per row group: loading every sample's pixels keeps at most ROW_GROUPS_KEPT
    groups' image columns; the conversations themselves hold no bytes."""
    import pyarrow.parquet as pq

    _, dataset = jsonl_and_dataset(tmp_path)
    pq.write_table(dataset.with_format("arrow")[:], tmp_path / "one.parquet", row_group_size=1)
    read = read_conversations(tmp_path / "one.parquet")
    images = [image for c in read.conversations for image in c.images]
    assert all(isinstance(image, EmbeddedImage) for image in images)
    assert not any(isinstance(v, bytes) for image in images for v in vars(image).values())
    encoder = ConversationEncoder.from_directory(model_dirs["llava"][0])
    samples = encode_conversations(encoder, read.conversations, max_seq_len=4096).samples
    for sample in samples:
        encoder.load_pixels([sample])
        table = images[0].table
        assert len(table._kept) <= hf_datasets.ROW_GROUPS_KEPT


def test_decode_image_bounds_bytes_first():
    from fusion.media.images import decode_image

    data = png(20, 30, 3)
    with pytest.raises(ValueError, match=r"x: \d+ bytes of encoded image, more than max_bytes=100"):
        decode_image(data, "x", max_bytes=100)
    with pytest.raises(ValueError, match="x: empty"):
        decode_image(b"", "x")
    with pytest.raises(TypeError, match="x: expected the encoded image as bytes"):
        decode_image("a.png", "x")  # type: ignore[arg-type]
    assert decode_image(data).shape == (3, 20, 30)


def test_missing_extra_is_named(tmp_path, monkeypatch):
    import builtins

    file = tmp_path / "t.parquet"
    datasets.Dataset.from_dict({"messages": [conversations()[1][0]]}).to_parquet(str(file))
    real = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.split(".")[0] == "pyarrow":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(ImportError, match=r"pip install 'torch-early-fusion\[data\]'"):
        read_conversations(file)
