"""Conversations from JSON Lines files, in the two formats fine-tuning data comes in (and,
through :mod:`fusion.data.hf_datasets`, from Hugging Face data sets: Parquet files or a
``datasets.Dataset.save_to_disk`` directory, the same two formats as columns).

One conversation per line, image paths relative to the file:

- Hugging Face's messages format::

    {"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

  ``content`` is a list of items (``"text"`` with ``"text"``, ``"image"`` with ``"path"``;
  ``"image"`` or a local ``"url"`` are taken for the path too; ``"video"`` with ``"video"``, a
  clip file or a list of frame files, for models that take videos) or a plain string (text
  only, what text-only templates such as Llama's expect). Several turns, images and videos
  are allowed, mixed in any order::

    {"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"},
                                               {"type": "image", "path": "a.png"},
                                               {"type": "text", "text": "Same cat?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]}]}
- LLaVA-Instruct's format::

    {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                                         {"from": "gpt", "value": "A cat."}]}

  ``image`` is one path or a list; each ``"<image>"`` in a value is where the next image goes.
  Turns become messages of list content (``human`` -> ``user``, ``gpt`` -> ``assistant``,
  ``system``), each marker an image item; newlines next to a marker are dropped with it
  (``"<image>\\nWhat"`` -> an image, then ``"What"``); the template decides what goes between
  an image and its text.

The whole file is read and checked before anything is returned: a line that is empty, not
JSON, of neither format, a message without a role, no assistant message, an image that is
missing or cannot be decoded (:func:`fusion.preprocessing.load_image`), a video file (or
frame file) that is missing, or image markers that do not match the images is a
:class:`DataError` naming the file, the line and the problem (a video's container is checked
when it is encoded, :meth:`fusion.data.ConversationEncoder.check_conversation`: probed, not
decoded); with ``skip_bad=True`` such lines are skipped and returned with their errors.
:func:`read_conversations` given a Parquet file or a directory reads a data set instead
(:func:`fusion.data.hf_datasets.read_hf_dataset`), its rows checked the same way and named
``file:row N`` (N counted from 0, as ``dataset[N]``).
"""

import json
import os
from collections.abc import Iterator
from pathlib import Path

from fusion._io import NotRegularFile, open_regular
from fusion.checkpoint.errors import as_path
from fusion.data.hf_datasets import read_hf_dataset

# What the data set reader shares is defined below both readers, in fusion.data.records; the
# names only re-exported ("as") are importable from here too, where they were first.
from fusion.data.records import IMAGE_MARKER as IMAGE_MARKER
from fusion.data.records import (
    Conversation,
    ConversationFile,
    DataError,
    _image_problem,
    parse_conversation,
    video_problem,
)
from fusion.data.records import ConversationImage as ConversationImage
from fusion.data.records import ConversationVideo as ConversationVideo
from fusion.data.records import load_conversation_image as load_conversation_image

MAX_LINE_BYTES = 64 * 2**20  # a conversation line; real ones are kilobytes


def read_conversations(
    path: str | os.PathLike, *, skip_bad: bool = False, check_images: bool = True
) -> ConversationFile:
    """Read and check a JSON Lines file of conversations (see the module docstring), or a
    Hugging Face data set: a Parquet file, a directory of them, or a directory written by
    ``datasets.Dataset.save_to_disk`` (:func:`fusion.data.hf_datasets.read_hf_dataset`,
    which needs the ``data`` extra; rows named ``file:row N``).

    Args:
        path: the ``.jsonl`` file; relative image paths are relative to its directory.
        skip_bad: skip bad lines (returned in ``skipped``) instead of raising.
        check_images: decode every image once (each distinct file once) to check it, and
            check that every video's files exist.

    Returns:
        a :class:`ConversationFile`.

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        DataError: the file cannot be read or holds no line; unless ``skip_bad``, the first
            bad line (file, line number and problem); with ``skip_bad``, no good line left.
        ImportError: a data set without ``pyarrow`` (or ``datasets`` for a ``save_to_disk``
            directory) installed, naming the extra.
    """
    file = as_path(path, "path")
    if _is_data_set(file):
        return read_hf_dataset(file, skip_bad=skip_bad, check_images=check_images)
    base = file.parent.absolute()
    conversations: list[Conversation] = []
    skipped: list[DataError] = []
    checked: dict[Path, str | None] = {}  # image -> problem, each file decoded once
    count = 0
    for number, raw in _lines(file):
        count += 1
        try:
            record = _parse_line(raw, first=number == 1)
            messages, images, videos = parse_conversation(record, base)
            if check_images:
                for video in videos:
                    if (problem := video_problem(video)) is not None:
                        raise ValueError(problem)
                for image in images:
                    assert isinstance(image, Path)  # JSON Lines: files
                    if image not in checked:
                        checked[image] = _image_problem(image)
                    if checked[image] is not None:
                        raise ValueError(checked[image])
        except ValueError as error:
            bad = DataError(file, number, str(error))
            if not skip_bad:
                raise bad from None
            skipped.append(bad)
            continue
        conversations.append(Conversation(messages, images, file, number, videos=videos))
    if count == 0:
        raise DataError(file, None, "no conversation: the file is empty")
    if not conversations:
        raise DataError(
            file, None, f"no good conversation: all {count} line(s) are bad (first: {skipped[0]})"
        )
    return ConversationFile(conversations, skipped)


PARQUET_MAGIC = b"PAR1"  # what a Parquet file starts (and ends) with


def _is_data_set(file: Path) -> bool:
    """Whether ``file`` is a data set rather than JSON Lines: a directory, or a file that
    starts as Parquet files do (a JSON Lines file cannot)."""
    if file.is_dir():
        return True
    try:
        with open_regular(file) as handle:
            return handle.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC
    except OSError:  # the JSON Lines reader reports it
        return False


def _lines(file: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line; a trailing newline ends the last line."""
    try:
        handle = open_regular(file)
    except NotRegularFile:
        raise DataError(file, None, "not a regular file (a FIFO, device, ...)") from None
    except OSError as error:
        raise DataError(file, None, f"cannot be read: {error.strerror}") from None
    with handle:
        number = 0
        while True:
            raw = handle.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(file, number, f"line longer than {MAX_LINE_BYTES} bytes: refused")
            yield number, raw


def _parse_line(raw: bytes, *, first: bool = False) -> object:
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")  # a BOM may start the file
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 text: {error}") from None
    if not text.strip():
        raise ValueError("empty line: expected one JSON object per line")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("malformed JSON: nested too deeply") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"malformed JSON: {error}") from None
