"""What both readers of conversations make and share, below them: JSON Lines'
(:func:`fusion.data.conversations.read_conversations`) and Hugging Face data sets'
(:func:`fusion.data.hf_datasets.read_hf_dataset`). A record (a line's JSON object, a data
set's row) in either of the two formats (described in :mod:`fusion.data.conversations`) is
checked and becomes a :class:`Conversation` (:func:`parse_conversation`); its images are files
or :class:`EmbeddedImage`\\ s (where in a data set their bytes are), its videos clip files or
lists of frame files (:data:`ConversationVideo`); a bad one is a :class:`DataError`.

The two readers import this module, and :func:`fusion.data.conversations.read_conversations`,
which picks the reader by the file's kind, imports both: so neither reader imports the other.
"""

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusion.checkpoint.errors import short_repr
from fusion.errors import FusionError

IMAGE_MARKER = "<image>"
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_PATH_KEYS = ("path", "image", "url")
_VIDEO_KEYS = ("video", "path", "url")  # where a video item names its clip (or frames)


def _name(file: Path) -> str:
    """``file`` as messages name it (bytes that are no UTF-8 escaped, never an error)."""
    return os.fsencode(file).decode("utf-8", "backslashreplace")


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
        name = _name(self.file)
        if row is not None:
            where = f"{name}:row {row}"
        else:
            where = name if line is None else f"{name}:{line}"
        super().__init__(f"{where}: {problem}")


class _Table:
    """One data set's rows, read a chunk at a time to check them, and one cell at a time
    again later (an image's bytes); :mod:`fusion.data.hf_datasets` reads the real ones."""

    file: Path  # what errors name
    base: Path  # relative image paths are relative to it
    columns: list[str]
    num_rows: int

    def chunks(self, columns: Sequence[str]) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """(first row, rows as Python values of ``columns``), every row once, in order."""
        raise NotImplementedError

    def cell(self, row: int, column: str) -> Any:
        """Row ``row``'s value of ``column``, read again."""
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class EmbeddedImage:
    """An image whose encoded bytes are in a data set's row: where they are, not the bytes.

    Attributes:
        column: the column (``images``, or LLaVA-Instruct's ``image``).
        row: the row (0-based).
        index: the image's place in the row's list (0 for a single image).
    """

    table: _Table
    row: int
    column: str
    index: int

    @property
    def name(self) -> str:
        """``"images[k]"``: how the row names it."""
        return f"{self.column}[{self.index}]"

    def __str__(self) -> str:
        return f"{_name(self.table.file)}:row {self.row}: {self.name}"

    def read(self) -> bytes:
        """The image's encoded bytes, read again from the data set.

        Raises:
            ValueError: the data set can no longer be read, or the row changed.
        """
        try:
            value = _image_list(self.table.cell(self.row, self.column), self.column)[self.index]
        except DataError as error:
            raise ValueError(f"{self}: {error.problem}") from None
        except (OSError, IndexError, KeyError, ValueError) as error:
            raise ValueError(f"{self}: cannot be read again: {error}") from None
        data = value.get("bytes") if isinstance(value, dict) else value
        if not isinstance(data, bytes):
            raise ValueError(f"{self}: its bytes are gone: the data set changed during the run")
        return data

    def load(self) -> torch.Tensor:
        """Its pixels, uint8 [c, h, w] (:func:`fusion.media.images.decode_image`).

        Raises:
            ValueError: naming the image: unreadable, more than ``MAX_IMAGE_BYTES``, not an
                image, corrupt, or more pixels than the decompression-bomb limit.
        """
        from fusion.media.images import decode_image

        return decode_image(self.read(), self.name)


def _image_list(value: Any, column: str) -> list[Any]:
    """A row's images: a list as stored, a single image as a list of one, null as none."""
    if value is None:
        return []
    if isinstance(value, list):
        return value
    if column == "image":  # LLaVA-Instruct's: one image per row
        return [value]
    raise ValueError(f"{column}: expected a list of images, got {short_repr(value, 80)}")


# An image of a conversation: a file, or encoded bytes in a data set's row (read again, and
# decoded, each time its pixels are needed).
ConversationImage = Path | EmbeddedImage
# A video of a conversation: a clip file, or its frames as image files in order (as
# LLaVA-Video-style data sets store them); decoded only when a batch needs its patches.
ConversationVideo = Path | tuple[Path, ...]


def video_name(video: ConversationVideo) -> str:
    """How messages name a video: its file, or its first frame and how many there are."""
    if isinstance(video, Path):
        return _name(video)
    return f"{_name(video[0])} (+{len(video) - 1} frames)" if video else "no frames"


@dataclass(frozen=True)
class Conversation:
    """One conversation, in Hugging Face's messages format.

    Attributes:
        messages: ``[{"role": ..., "content": ...}, ...]``; content is a string or a list of
            ``{"type": "text", "text": ...}`` and ``{"type": "image", "path": <absolute>}``
            items (other keys of a message are kept for the template); an image embedded in
            a data set's row is a ``{"type": "image"}`` item.
        images: the images in order of appearance (repeats included): absolute paths, or
            for a data set's row its embedded images (:class:`EmbeddedImage`: where the
            bytes are, not the bytes); :func:`load_conversation_image` decodes either.
        file: the data file it was read from.
        line: its line number (1-based); for a data set's row, ``row + 1``.
        row: the data set's row (0-based), or None for a line of JSON Lines.
        videos: the videos in order of appearance (:data:`ConversationVideo`: absolute clip
            paths, or tuples of absolute frame paths); their items in ``messages`` are
            ``{"type": "video", "video": <path or list of paths>}`` (``{"type": "video"}``
            for a data set's ``videos`` column).
    """

    messages: list[dict[str, Any]]
    images: tuple[ConversationImage, ...]
    file: Path
    line: int
    row: int | None = None
    videos: tuple[ConversationVideo, ...] = ()

    @property
    def source(self) -> str:
        """``"<file>:<line>"`` (``"<file>:row <N>"`` for a data set's row), for messages."""
        name = _name(self.file)
        return f"{name}:row {self.row}" if self.row is not None else f"{name}:{self.line}"

    def error(self, problem: str) -> DataError:
        """A :class:`DataError` about this conversation."""
        if self.row is not None:
            return DataError(self.file, None, problem, row=self.row)
        return DataError(self.file, self.line, problem)


@dataclass(frozen=True)
class ConversationFile:
    """What :func:`fusion.data.conversations.read_conversations` (or
    :func:`fusion.data.hf_datasets.read_hf_dataset`) read.

    Attributes:
        conversations: the good conversations, in file order.
        skipped: the errors of the lines skipped (``skip_bad=True``), in file order.
    """

    conversations: list[Conversation]
    skipped: list[DataError] = field(default_factory=list)


def parse_conversation(
    record: object,
    base: Path,
    images: Sequence[ConversationImage] | None = None,
    images_key: str = "images",
    videos: Sequence[ConversationVideo] | None = None,
    videos_key: str = "videos",
) -> tuple[list[dict[str, Any]], tuple[ConversationImage, ...], tuple[ConversationVideo, ...]]:
    """One parsed JSON line -> (messages in Hugging Face's format, absolute image paths,
    videos).

    Args:
        record: the line's object.
        base: the directory relative image and video paths are relative to.
        images: a data set's row: its images, in order (the ``images_key`` column, or
            LLaVA-Instruct's ``image``); each image item of ``messages`` (each
            ``"<image>"`` marker of ``conversations``) takes the next one, and the counts must
            match. None: images are paths in the record, as in JSON Lines.
        images_key: the column ``images`` came from, for errors.
        videos: a data set's row: its videos (the ``videos_key`` column), each video item of
            ``messages`` taking the next one, the counts matching. None: videos are paths in
            the record's video items (``"video"``, ``"path"`` or a local ``"url"``: a clip
            file, or a list of frame files).
        videos_key: the column ``videos`` came from, for errors.

    Raises:
        ValueError: the problem, naming the field (without file and line).
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {short_repr(record, 80)}")
    found: tuple[ConversationImage, ...]
    clips: tuple[ConversationVideo, ...] = ()
    if "messages" in record:
        messages, paths, named = _hf_messages(
            record["messages"], base, images is not None, videos is not None
        )
        if images is not None:
            found = _take_images(images, len(paths), images_key)
        else:
            found = tuple(path for path in paths if path is not None)
        if videos is not None:
            clips = _take_images(videos, len(named), videos_key, "video")
        else:
            clips = tuple(video for video in named if video is not None)
    elif "conversations" in record:
        for key, value in (("video", record.get("video")), (videos_key, videos)):
            if value:  # LLaVA-Video's key, or a data set's column: not silently dropped
                raise ValueError(
                    f"{key}: videos given, but LLaVA-Instruct's 'conversations' format marks "
                    "images only; write the conversation in the 'messages' format with "
                    '{"type": "video", "video": ...} items'
                )
        messages, found = _sharegpt_messages(record, base, images, images_key)
    else:
        raise ValueError(
            "expected a 'messages' list (Hugging Face's format) or a 'conversations' list "
            f"(LLaVA-Instruct's), got the keys {short_repr(sorted(record), 120)}"
        )
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("no assistant message: nothing to train on")
    return messages, found, clips


def _take_images(
    images: Sequence[Any], items: int, key: str, what: str = "image"
) -> tuple[Any, ...]:
    """A data set's row: its ``images`` (or videos: ``what``) for the ``items`` image (video)
    items of ``messages``."""
    if items != len(images):
        raise ValueError(
            f"{items} {what} item(s) in messages, but {len(images)} {what}(s) in {key!r}: each "
            f'{{"type": "{what}"}} item takes the next {what} of {key!r}'
        )
    return tuple(images)


def _hf_messages(
    value: object, base: Path, embedded: bool = False, embedded_videos: bool = False
) -> tuple[list[dict[str, Any]], tuple[Path | None, ...], tuple[ConversationVideo | None, ...]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"messages: expected a non-empty list, got {short_repr(value, 80)}")
    messages: list[dict[str, Any]] = []
    images: list[Path | None] = []
    videos: list[ConversationVideo | None] = []
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
                _check_column_item(item, _PATH_KEYS, at, "image")
                images.append(None)
                items.append({"type": "image"})
            elif kind == "image":
                image = _image_path(item, base, at)
                images.append(image)
                items.append({"type": "image", "path": str(image)})
            elif kind == "video" and embedded_videos:
                _check_column_item(item, _VIDEO_KEYS, at, "video")
                videos.append(None)
                items.append({"type": "video"})
            elif kind == "video":
                video = _video_source(item, base, at)
                videos.append(video)
                named = str(video) if isinstance(video, Path) else [str(p) for p in video]
                items.append({"type": "video", "video": named})
            else:
                raise ValueError(
                    f"{at}: expected an item of type 'text', 'image' or 'video', got "
                    f"{short_repr(item, 80)}"
                )
        messages.append({**message, "content": items})
    return messages, tuple(images), tuple(videos)


def _check_column_item(item: dict[str, Any], keys: Sequence[str], at: str, kind: str) -> None:
    """Refuse a path in a ``kind`` item (``"image"``, ``"video"``) of a data set row whose
    column holds its media: the item takes the column's next one."""
    a = "an" if kind[0] in "aeiou" else "a"
    for key in keys:
        if item.get(key) is not None:
            raise ValueError(
                f"{at}.{key}: {a} {kind} item of a data set with {a} {kind}s column "
                f"takes the next {kind} of that column, and holds no path"
            )


def _sharegpt_messages(
    record: dict[str, Any],
    base: Path,
    embedded: Sequence[ConversationImage] | None = None,
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
        if not isinstance(speaker, str) or speaker not in _SHAREGPT_ROLES:
            raise ValueError(
                f"{where}: 'from' must be one of {sorted(_SHAREGPT_ROLES)}, got "
                f"{short_repr(speaker)}"
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
        messages.append({"role": _SHAREGPT_ROLES[speaker], "content": items})
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


def _video_source(item: dict[str, Any], base: Path, where: str) -> ConversationVideo:
    for key in _VIDEO_KEYS:
        if item.get(key) is not None:
            return video_paths(item[key], base, f"{where}.{key}")
    raise ValueError(
        f"{where}: a video item needs a clip file (or a list of frame files) in 'video'"
    )


def video_paths(value: object, base: Path, where: str) -> ConversationVideo:
    """A video as a record names it: a clip file's path, or a non-empty list of frame files'
    paths (each relative to ``base`` unless absolute).

    Raises:
        ValueError: naming ``where``: neither a path nor a non-empty list of paths, a URL.
    """
    if isinstance(value, str):
        return _resolve(value, base, where)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(_resolve(v, base, f"{where}[{k}]") for k, v in enumerate(value))
    raise ValueError(
        f"{where}: expected a clip file's path or a non-empty list of frame files' paths, got "
        f"{short_repr(value, 80)}"
    )


def _resolve(name: str, base: Path, where: str) -> Path:
    if not name or "\x00" in name:
        raise ValueError(f"{where}: expected a file path, got {name!r}")
    if "://" in name and not name.startswith("file://"):
        raise ValueError(f"{where}: {name!r} is a URL; images must be local files")
    path = Path(name.removeprefix("file://"))
    return path if path.is_absolute() else base / path


def load_conversation_image(image: ConversationImage | str) -> torch.Tensor:
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


def video_problem(video: ConversationVideo) -> str | None:
    """None if ``video``'s files exist (a clip file, or every frame file), else the problem;
    its container and frames are checked when it is encoded (probed, not decoded)."""
    for path in (video,) if isinstance(video, Path) else video:
        if not path.is_file():
            what = "no such file" if not path.exists() else "not a regular file"
            return f"video {video_name(video)!r}: {_name(path)}: {what}"
    return None


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
