"""Conversations from JSON Lines files, in the two formats fine-tuning data comes in.

One conversation per line, image paths relative to the file:

- Hugging Face's messages format::

    {"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

  ``content`` is a list of items (``"text"`` with ``"text"``, ``"image"`` with ``"path"``;
  ``"image"`` or a local ``"url"`` are taken for the path too) or a plain string (text only,
  what text-only templates such as Llama's expect). Several turns and images are allowed.
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
missing or cannot be decoded (:func:`fusion.preprocessing.load_image`), or image markers
that do not match the images is a :class:`DataError` naming the file, the line and the
problem; with ``skip_bad=True`` such lines are skipped and returned with their errors.
"""

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion._io import NotRegularFile, open_regular
from fusion.checkpoint.errors import as_path, short_repr

IMAGE_MARKER = "<image>"
MAX_LINE_BYTES = 64 * 2**20  # a conversation line; real ones are kilobytes
_LLAVA_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_PATH_KEYS = ("path", "image", "url")


class DataError(ValueError):
    """A data file, or one of its lines, that cannot be used.

    The message is ``"<file>:<line>: <problem>"`` (``"<file>: <problem>"`` for the whole
    file), so it can be acted on without a debugger.

    Attributes:
        file: the data file.
        line: the line number (1-based), or None when the whole file is at fault.
        problem: what is wrong, without the location.
    """

    def __init__(self, file: str | os.PathLike, line: int | None, problem: str) -> None:
        self.file = Path(file)
        self.line = line
        self.problem = problem
        name = os.fsencode(self.file).decode("utf-8", "backslashreplace")
        where = name if line is None else f"{name}:{line}"
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class Conversation:
    """One conversation, in Hugging Face's messages format.

    Attributes:
        messages: ``[{"role": ..., "content": ...}, ...]``; content is a string or a list of
            ``{"type": "text", "text": ...}`` and ``{"type": "image", "path": <absolute>}``
            items (other keys of a message are kept for the template).
        images: the absolute image paths in order of appearance (repeats included).
        file: the data file it was read from.
        line: its line number (1-based).
    """

    messages: list[dict[str, Any]]
    images: tuple[Path, ...]
    file: Path
    line: int

    @property
    def source(self) -> str:
        """``"<file>:<line>"``, for messages."""
        return f"{os.fsencode(self.file).decode('utf-8', 'backslashreplace')}:{self.line}"

    def error(self, problem: str) -> DataError:
        """A :class:`DataError` about this conversation."""
        return DataError(self.file, self.line, problem)


@dataclass(frozen=True)
class ConversationFile:
    """What :func:`read_conversations` read.

    Attributes:
        conversations: the good conversations, in file order.
        skipped: the errors of the lines skipped (``skip_bad=True``), in file order.
    """

    conversations: list[Conversation]
    skipped: list[DataError] = field(default_factory=list)


def read_conversations(
    path: str | os.PathLike, *, skip_bad: bool = False, check_images: bool = True
) -> ConversationFile:
    """Read and check a JSON Lines file of conversations (see the module docstring).

    Args:
        path: the ``.jsonl`` file; relative image paths are relative to its directory.
        skip_bad: skip bad lines (returned in ``skipped``) instead of raising.
        check_images: decode every image once (each distinct file once) to check it.

    Returns:
        a :class:`ConversationFile`.

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        DataError: the file cannot be read or holds no line; unless ``skip_bad``, the first
            bad line (file, line number and problem); with ``skip_bad``, no good line left.
    """
    file = as_path(path, "path")
    base = file.parent.absolute()
    conversations: list[Conversation] = []
    skipped: list[DataError] = []
    checked: dict[Path, str | None] = {}  # image -> problem, each file decoded once
    count = 0
    for number, raw in _lines(file):
        count += 1
        try:
            messages, images = parse_conversation(_parse_line(raw, first=number == 1), base)
            if check_images:
                for image in images:
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
        conversations.append(Conversation(messages, images, file, number))
    if count == 0:
        raise DataError(file, None, "no conversation: the file is empty")
    if not conversations:
        raise DataError(
            file, None, f"no good conversation: all {count} line(s) are bad (first: {skipped[0]})"
        )
    return ConversationFile(conversations, skipped)


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


def parse_conversation(record: object, base: Path) -> tuple[list[dict[str, Any]], tuple[Path, ...]]:
    """One parsed JSON line -> (messages in Hugging Face's format, absolute image paths).

    Raises:
        ValueError: the problem, naming the field (without file and line).
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {short_repr(record, 80)}")
    if "messages" in record:
        messages, images = _hf_messages(record["messages"], base)
    elif "conversations" in record:
        messages, images = _llava_messages(record, base)
    else:
        raise ValueError(
            "expected a 'messages' list (Hugging Face's format) or a 'conversations' list "
            f"(LLaVA-Instruct's), got the keys {short_repr(sorted(record), 120)}"
        )
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("no assistant message: nothing to train on")
    return messages, images


def _hf_messages(value: object, base: Path) -> tuple[list[dict[str, Any]], tuple[Path, ...]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"messages: expected a non-empty list, got {short_repr(value, 80)}")
    messages, images = [], []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: expected an object, got {short_repr(message, 80)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}: no 'role' (expected a string such as 'user')")
        content = message.get("content")
        if isinstance(content, str):
            _check_text(content, f"{where}.content")
            messages.append(dict(message))
            continue
        if not isinstance(content, list):
            raise ValueError(
                f"{where}.content: expected a string or a list of items, got "
                f"{short_repr(content, 80)}"
            )
        items = []
        for j, item in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text":
                text = item.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{at}: a text item needs a string 'text'")
                _check_text(text, at)
                items.append(dict(item))
            elif kind == "image":
                image = _image_path(item, base, at)
                images.append(image)
                items.append({"type": "image", "path": str(image)})
            else:
                raise ValueError(
                    f"{at}: expected an item of type 'text' or 'image', got {short_repr(item, 80)}"
                )
        messages.append({**message, "content": items})
    return messages, tuple(images)


def _llava_messages(
    record: dict[str, Any], base: Path
) -> tuple[list[dict[str, Any]], tuple[Path, ...]]:
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"conversations: expected a non-empty list, got {short_repr(turns, 80)}")
    names = record.get("image", [])
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"image: expected a path or a list of paths, got {short_repr(record['image'], 80)}"
        )
    markers = 0
    messages: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise ValueError(f"{where}: expected an object, got {short_repr(turn, 80)}")
        speaker = turn.get("from")
        if not isinstance(speaker, str) or speaker not in _LLAVA_ROLES:
            raise ValueError(
                f"{where}: 'from' must be one of {sorted(_LLAVA_ROLES)}, got {short_repr(speaker)}"
            )
        value = turn.get("value")
        if not isinstance(value, str):
            raise ValueError(f"{where}.value: expected a string, got {short_repr(value, 80)}")
        pieces = value.split(IMAGE_MARKER)
        items: list[dict[str, Any]] = []
        for k, piece in enumerate(pieces):
            if k > 0:
                items.append({"type": "image"})
                piece = piece.lstrip("\n")
            if k < len(pieces) - 1:
                piece = piece.rstrip("\n")
            if piece:
                items.append({"type": "text", "text": piece})
        markers += len(pieces) - 1
        messages.append({"role": _LLAVA_ROLES[speaker], "content": items})
    if markers != len(names):
        raise ValueError(
            f"{markers} image marker(s) {IMAGE_MARKER!r} in the conversation, but "
            f"{len(names)} image(s) given in 'image'; write one {IMAGE_MARKER!r} where each "
            "image goes"
        )
    images = [_resolve(name, base, "image") for name in names]
    index = 0
    for message in messages:
        for item in message["content"]:
            if item["type"] == "image":
                item["path"] = str(images[index])
                index += 1
    return messages, tuple(images)


def _check_text(text: str, where: str) -> None:
    if IMAGE_MARKER in text:
        raise ValueError(
            f"{where}: the text holds the image marker {IMAGE_MARKER!r}; images go in their own "
            '{"type": "image", "path": ...} items'
        )


def _image_path(item: dict[str, Any], base: Path, where: str) -> Path:
    for key in _PATH_KEYS:
        if isinstance(item.get(key), str):
            return _resolve(item[key], base, f"{where}.{key}")
    raise ValueError(f"{where}: an image item needs a file path in 'path'")


def _resolve(name: str, base: Path, where: str) -> Path:
    if not name or "\x00" in name:
        raise ValueError(f"{where}: expected a file path, got {name!r}")
    if "://" in name and not name.startswith("file://"):
        raise ValueError(f"{where}: {name!r} is a URL; images must be local files")
    path = Path(name.removeprefix("file://"))
    return path if path.is_absolute() else base / path


def _image_problem(image: Path) -> str | None:
    """None if ``image`` decodes, else the problem."""
    from fusion.preprocessing import load_image

    if not image.exists():
        return f"image {str(image)!r}: no such file"
    try:
        load_image(image)
    except (OSError, ValueError) as error:
        text = str(error)
        return text if str(image) in text else f"image {str(image)!r}: {text}"
    return None
