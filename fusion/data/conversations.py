"""Conversations from JSON Lines files, in the two formats fine-tuning data comes in (and,
through :mod:`fusion.data.hf_datasets`, from Hugging Face data sets: Parquet files or a
``datasets.Dataset.save_to_disk`` directory, the same two formats as columns).

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
:func:`read_conversations` given a Parquet file or a directory reads a data set instead
(:func:`fusion.data.hf_datasets.read_hf_dataset`), its rows checked the same way and named
``file:row N`` (N counted from 0, as ``dataset[N]``).
"""

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from fusion._io import NotRegularFile, open_regular
from fusion.checkpoint.errors import as_path, short_repr
from fusion.errors import FusionError

if TYPE_CHECKING:
    import torch

    from fusion.data.hf_datasets import EmbeddedImage

# An image of a conversation: a file, or encoded bytes in a data set's row (read again, and
# decoded, each time its pixels are needed).
ConversationImage = Union[Path, "EmbeddedImage"]

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


class DataError(FusionError, ValueError):
    """A data file, or one of its lines, that cannot be used.

    The message is ``"<file>:<line>: <problem>"`` (``"<file>: <problem>"`` for the whole
    file; ``"<file>:row <N>: <problem>"`` for row N of a data set), so it can be acted on
    without a debugger.

    Attributes:
        file: the data file.
        line: the line number (1-based), or None when the whole file is at fault; for a data
            set's row, ``row + 1``.
        problem: what is wrong, without the location.
        row: the data set's row (0-based, as ``dataset[row]``), or None.
    """

    def __init__(
        self,
        file: str | os.PathLike,
        line: int | None,
        problem: str,
        *,
        row: int | None = None,
    ) -> None:
        self.file = Path(file)
        self.row = row
        self.line = row + 1 if row is not None else line
        self.problem = problem
        name = os.fsencode(self.file).decode("utf-8", "backslashreplace")
        if row is not None:
            where = f"{name}:row {row}"
        else:
            where = name if line is None else f"{name}:{line}"
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class Conversation:
    """One conversation, in Hugging Face's messages format.

    Attributes:
        messages: ``[{"role": ..., "content": ...}, ...]``; content is a string or a list of
            ``{"type": "text", "text": ...}`` and ``{"type": "image", "path": <absolute>}``
            items (other keys of a message are kept for the template); an image embedded in
            a data set's row is a ``{"type": "image"}`` item.
        images: the images in order of appearance (repeats included): absolute paths, or
            for a data set's row its embedded images
            (:class:`fusion.data.hf_datasets.EmbeddedImage`: where the bytes are, not the
            bytes); :func:`load_conversation_image` decodes either.
        file: the data file it was read from.
        line: its line number (1-based); for a data set's row, ``row + 1``.
        row: the data set's row (0-based), or None for a line of JSON Lines.
    """

    messages: list[dict[str, Any]]
    images: tuple[ConversationImage, ...]
    file: Path
    line: int
    row: int | None = None

    @property
    def source(self) -> str:
        """``"<file>:<line>"`` (``"<file>:row <N>"`` for a data set's row), for messages."""
        name = os.fsencode(self.file).decode("utf-8", "backslashreplace")
        return f"{name}:row {self.row}" if self.row is not None else f"{name}:{self.line}"

    def error(self, problem: str) -> DataError:
        """A :class:`DataError` about this conversation."""
        if self.row is not None:
            return DataError(self.file, None, problem, row=self.row)
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
    """Read and check a JSON Lines file of conversations (see the module docstring), or a
    Hugging Face data set: a Parquet file, a directory of them, or a directory written by
    ``datasets.Dataset.save_to_disk`` (:func:`fusion.data.hf_datasets.read_hf_dataset`,
    which needs the ``data`` extra; rows named ``file:row N``).

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
        ImportError: a data set without ``pyarrow`` (or ``datasets`` for a ``save_to_disk``
            directory) installed, naming the extra.
    """
    file = as_path(path, "path")
    if _is_data_set(file):
        from fusion.data.hf_datasets import read_hf_dataset

        return read_hf_dataset(file, skip_bad=skip_bad, check_images=check_images)
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
        conversations.append(Conversation(messages, images, file, number))
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


def parse_conversation(
    record: object,
    base: Path,
    images: "Sequence[ConversationImage] | None" = None,
    images_key: str = "images",
) -> tuple[list[dict[str, Any]], tuple[ConversationImage, ...]]:
    """One parsed JSON line -> (messages in Hugging Face's format, absolute image paths).

    Args:
        record: the line's object.
        base: the directory relative image paths are relative to.
        images: a data set's row: its images, in order (the ``images_key`` column, or
            LLaVA-Instruct's ``image``); each image item of ``messages`` (each
            ``"<image>"`` marker of ``conversations``) takes the next one, and the counts must
            match. None: images are paths in the record, as in JSON Lines.
        images_key: the column ``images`` came from, for errors.

    Raises:
        ValueError: the problem, naming the field (without file and line).
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {short_repr(record, 80)}")
    found: tuple[ConversationImage, ...]
    if "messages" in record:
        messages, paths = _hf_messages(record["messages"], base, images is not None)
        if images is not None:
            found = _take_images(images, len(paths), images_key)
        else:
            found = tuple(path for path in paths if path is not None)
    elif "conversations" in record:
        messages, found = _llava_messages(record, base, images, images_key)
    else:
        raise ValueError(
            "expected a 'messages' list (Hugging Face's format) or a 'conversations' list "
            f"(LLaVA-Instruct's), got the keys {short_repr(sorted(record), 120)}"
        )
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("no assistant message: nothing to train on")
    return messages, found


def _take_images(
    images: "Sequence[ConversationImage]",
    items: int,
    key: str,
) -> tuple[ConversationImage, ...]:
    """A data set's row: its ``images`` for the ``items`` image items of ``messages``."""
    if items != len(images):
        raise ValueError(
            f"{items} image item(s) in messages, but {len(images)} image(s) in {key!r}: each "
            f'{{"type": "image"}} item takes the next image of {key!r}'
        )
    return tuple(images)


def _hf_messages(
    value: object, base: Path, embedded: bool = False
) -> tuple[list[dict[str, Any]], tuple[Path | None, ...]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"messages: expected a non-empty list, got {short_repr(value, 80)}")
    messages: list[dict[str, Any]] = []
    images: list[Path | None] = []
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
            elif kind == "image" and embedded:
                for key in _PATH_KEYS:  # the row's images column holds the images
                    if item.get(key) is not None:
                        raise ValueError(
                            f"{at}.{key}: an image item of a data set with an images column "
                            "takes the next image of that column, and holds no path"
                        )
                images.append(None)
                items.append({"type": "image"})
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
    record: dict[str, Any],
    base: Path,
    embedded: "Sequence[ConversationImage] | None" = None,
    key: str = "image",
) -> tuple[list[dict[str, Any]], tuple[ConversationImage, ...]]:
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"conversations: expected a non-empty list, got {short_repr(turns, 80)}")
    names: list[Any]
    if embedded is not None:
        names = list(embedded)
    else:
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
            f"{len(names)} image(s) given in {key!r}; write one {IMAGE_MARKER!r} where each "
            "image goes"
        )
    if embedded is not None:
        return messages, tuple(names)  # image items without a path: the row holds them
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


def load_conversation_image(image: "ConversationImage | str") -> "torch.Tensor":
    """Decode one of a :class:`Conversation`'s images (uint8 [c, h, w], as
    :func:`fusion.preprocessing.load_image`): a file, or an image embedded in a data set
    (its bytes read again from the data set, bounded, then decoded).

    Raises:
        ValueError: naming the image: unreadable, undecodable, too large.
    """
    if isinstance(image, str | Path):
        from fusion.preprocessing import load_image

        return load_image(image)
    return image.load()


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
