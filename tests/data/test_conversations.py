"""Reading conversation files: both formats, paths relative to the file, and every bad line
named by file, line and problem (or skipped and counted)."""

import json
import re

import pytest

from fusion.data import DataError, read_conversations


def hf(*paths, answer="A cat."):
    user = [{"type": "image", "path": p} for p in paths] + [{"type": "text", "text": "What?"}]
    return {
        "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


def llava(image, first="<image>\nWhat is it?"):
    record = {
        "conversations": [
            {"from": "human", "value": first},
            {"from": "gpt", "value": "A cat."},
            {"from": "human", "value": "Sure?"},
            {"from": "gpt", "value": "Yes."},
        ]
    }
    if image is not None:
        record["image"] = image
    return record


def test_both_formats(tmp_path, write_images, write_jsonl):
    (tmp_path / "images").mkdir()
    names = write_images(tmp_path / "images", [(8, 8), (9, 7)])
    paths = [f"images/{n}" for n in names]
    absolute = str(tmp_path / paths[1])
    text_only = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "name": "bot"},
        ]
    }
    file = write_jsonl(
        tmp_path / "train.jsonl",
        [hf(paths[0], absolute), llava(paths[0]), text_only],
    )
    read = read_conversations(file)
    assert read.skipped == []
    first, second, third = read.conversations
    assert first.images == (tmp_path / paths[0], tmp_path / paths[1])
    assert first.messages[0]["content"][1] == {"type": "image", "path": absolute}
    assert (first.line, second.line, third.line) == (1, 2, 3)
    assert first.source == f"{file}:1"
    # LLaVA: roles mapped, markers become image items (with the newline next to them).
    assert second.messages[0] == {
        "role": "user",
        "content": [
            {"type": "image", "path": str(tmp_path / paths[0])},
            {"type": "text", "text": "What is it?"},
        ],
    }
    assert [m["role"] for m in second.messages] == ["user", "assistant"] * 2
    assert second.messages[1]["content"] == [{"type": "text", "text": "A cat."}]
    assert second.images == (tmp_path / paths[0],)
    # String content and extra keys are kept for text-only templates.
    assert third.messages == text_only["messages"] and third.images == ()


def test_llava_markers_in_place_and_several_images(tmp_path, write_images, write_jsonl):
    names = write_images(tmp_path, [(8, 8), (9, 7)])
    record = llava(names, first="Compare <image>\nand\n<image>, please")
    (conversation,) = read_conversations(write_jsonl(tmp_path / "a.jsonl", [record])).conversations
    assert conversation.messages[0]["content"] == [
        {"type": "text", "text": "Compare "},
        {"type": "image", "path": str(tmp_path / names[0])},
        {"type": "text", "text": "and"},
        {"type": "image", "path": str(tmp_path / names[1])},
        {"type": "text", "text": ", please"},
    ]


BAD_LINES = [
    ("", r"empty line: expected one JSON object per line"),
    ("   ", r"empty line"),
    ('{"messages": [', r"malformed JSON: "),
    ("[1, 2]", r"expected a JSON object, got \[1, 2\]"),
    ('{"text": "hi"}', r"expected a 'messages' list .* or a 'conversations' list"),
    ('{"messages": []}', r"messages: expected a non-empty list"),
    ('{"messages": [{"content": "hi"}]}', r"messages\[0\]: no 'role'"),
    ('{"messages": [{"role": "", "content": "hi"}]}', r"messages\[0\]: no 'role'"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\]\.content: expected a string or a list"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r"no assistant message"),
    (
        '{"messages": [{"role": "user", "content": [{"type": "audio", "path": "v.wav"}]}]}',
        r"messages\[0\]\.content\[0\]: expected an item of type 'text', 'image' or 'video'",
    ),
    (
        '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        r"messages\[0\]\.content\[0\]: a text item needs a string 'text'",
    ),
    (
        '{"messages": [{"role": "user", "content": [{"type": "image"}]}]}',
        r"messages\[0\]\.content\[0\]: an image item needs a file path",
    ),
    (
        '{"messages": [{"role": "user", "content": "see <image>"}, '
        '{"role": "assistant", "content": "ok"}]}',
        r"messages\[0\]\.content: the text holds the image marker '<image>'",
    ),
    (
        '{"messages": [{"role": "user", "content": [{"type": "image", "url": '
        '"https://example.com/a.png"}]}]}',
        r"messages\[0\]\.content\[0\]\.url: 'https://example\.com/a\.png' is a URL; images must",
    ),
    (json.dumps(llava(None)), r"1 image marker\(s\) '<image>' in the conversation, but 0 image"),
    (json.dumps(llava("a.png", first="no marker")), r"0 image marker\(s\).*but 1 image"),
    (
        '{"conversations": [{"from": "robot", "value": "hi"}]}',
        r"conversations\[0\]: 'from' must be one of",
    ),
    ('{"conversations": [{"from": "human"}]}', r"conversations\[0\]\.value: expected a string"),
    ('{"image": 3, "conversations": [{"from": "gpt", "value": "x"}]}', r"image: expected a path"),
    (json.dumps(hf("missing.png")), r"image '.*missing\.png': no such file"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_LINES)
def test_bad_lines(tmp_path, write_images, write_jsonl, line, problem):
    names = write_images(tmp_path, [(8, 8)])
    file = write_jsonl(tmp_path / "train.jsonl", [hf(names[0]), line, hf(names[0])])
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(tmp_path))}/train\.jsonl:2: {problem}"
    ) as caught:
        read_conversations(file)
    assert caught.value.line == 2 and caught.value.file == file
    read = read_conversations(file, skip_bad=True)
    assert [c.line for c in read.conversations] == [1, 3]
    assert [e.line for e in read.skipped] == [2]


def test_undecodable_images_and_bytes(tmp_path, write_images, write_jsonl):
    names = write_images(tmp_path, [(8, 8)])
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    records = [hf(names[0]), hf("broken.png"), hf(names[0], "broken.png")]
    file = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(DataError, match=r"train\.jsonl:2: .*broken\.png"):
        read_conversations(file)
    read = read_conversations(file, skip_bad=True)
    assert [c.line for c in read.conversations] == [1]
    assert [e.line for e in read.skipped] == [2, 3]
    assert read_conversations(file, check_images=False).skipped == []
    bom = b"\xef\xbb\xbf" + json.dumps(hf(names[0])).encode()
    (tmp_path / "bom.jsonl").write_bytes(bom)  # no final newline either
    assert len(read_conversations(tmp_path / "bom.jsonl").conversations) == 1
    (tmp_path / "latin.jsonl").write_bytes(json.dumps(hf(names[0])).encode() + b"\n\xff\n")
    with pytest.raises(DataError, match=r"latin\.jsonl:2: not UTF-8 text"):
        read_conversations(tmp_path / "latin.jsonl")


def test_whole_file_problems(tmp_path, write_jsonl):
    with pytest.raises(DataError, match=r"missing\.jsonl: cannot be read"):
        read_conversations(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl: no conversation: the file is empty"):
        read_conversations(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match=r"a directory, but neither one written by datasets"):
        read_conversations(tmp_path)  # a directory is read as a data set
    file = write_jsonl(tmp_path / "bad.jsonl", ["{}", "[]"])
    with pytest.raises(
        DataError, match=r"bad\.jsonl: no good conversation: all 2 line\(s\) are bad"
    ):
        read_conversations(file, skip_bad=True)
    with pytest.raises(TypeError, match="path: expected a path"):
        read_conversations(3)


@pytest.mark.parametrize(
    ("kind", "key", "column", "article"),
    [("image", "path", "images", "an"), ("video", "video", "videos", "a")],
)
def test_an_item_of_a_row_with_a_media_column_holds_no_path(tmp_path, kind, key, column, article):
    """A data set row's column holds its media: an item naming a file too is refused, not
    silently taken from one place or the other."""
    from fusion.data.records import parse_conversation

    record = {
        "messages": [
            {"role": "user", "content": [{"type": kind, key: "x.png"}]},
            {"role": "assistant", "content": "ok"},
        ]
    }
    media = {"images" if kind == "image" else "videos": [tmp_path / "x.png"]}
    with pytest.raises(
        ValueError,
        match=rf"content\[0\]\.{key}: {article} {kind} item of a data set with {article} "
        rf"{column} column takes the next {kind} of that column, and holds no path",
    ):
        parse_conversation(record, tmp_path, **media)
