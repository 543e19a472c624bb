"""Conversations from Hugging Face data sets: Parquet files (as the Hub stores data sets), a
directory of them, a directory written by ``datasets.Dataset.save_to_disk``, or a
``datasets.Dataset`` in memory.

Columns, those TRL reads (other columns are ignored):

- ``messages`` (Hugging Face's messages format, as in JSON Lines) and ``images``: the row's
  images in order, each ``{"type": "image"}`` item of ``messages`` taking the next one; and
  ``videos``: the row's videos in order, each ``{"type": "video"}`` item taking the next one
  (a video is a clip file's path, or a list of frame files' paths, relative to the data
  set's directory; a ``{"bytes": null, "path": ...}`` struct, as ``datasets.Video`` stores a
  file, is taken too);
- or LLaVA-Instruct's ``conversations`` and ``image`` (one image or a list), each
  ``"<image>"`` marker taking the next one.

An image is stored as ``datasets.Image`` stores it, a ``{"bytes": ..., "path": ...}`` struct
(a ``datasets.Dataset`` built from Pillow images stores them so): its encoded bytes, or when
they are null its ``path``, a local file relative to the data set's directory (read as JSON
Lines reads one). Plain ``binary`` or path ``string`` values are taken too. Arrow stores a key
that a message or item lacks as null; null keys are dropped, so a row reads as the JSON
object it was made from (a text item does not carry ``"image": None`` into the template).

Every row is checked before anything is returned, with the checks of JSON Lines
(:func:`fusion.data.conversations.parse_conversation`); a bad row is a
:class:`~fusion.data.DataError` ``"<file>:row <N>: <problem>"``, N counted from 0 as
``dataset[N]`` (each Parquet file of a directory counts its own rows); ``skip_bad=True`` skips
and returns them.

Memory, as for image files: a conversation holds where its images (and videos) are
(:class:`EmbeddedImage`: the data set, row and index), never their bytes or pixels; the bytes
are read again, and decoded, when a batch needs them. A Parquet file is read one row group at a
time (the last few groups' image columns kept: ``datasets`` writes 100 rows per group for
image data); a ``save_to_disk`` directory is memory-mapped.

Untrusted input: a row group's declared size is checked before it is read
(:data:`MAX_ROW_GROUP_BYTES`), an image's bytes before they are decoded
(:data:`fusion.media.images.MAX_IMAGE_BYTES`), its pixel count from its header before
its pixels are (Pillow's decompression-bomb guard, :func:`fusion.media.images.
decode_image`).

``pyarrow`` (and ``datasets`` for ``save_to_disk`` directories) come with the ``data`` extra,
imported only here, only when a data set is read.
"""

import bisect
import json
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fusion.checkpoint.errors import short_repr
from fusion.data.records import (
    Conversation,
    ConversationFile,
    ConversationImage,
    ConversationVideo,
    DataError,
    EmbeddedImage,
    _image_list,
    _image_problem,
    _name,
    _resolve,
    _Table,
    parse_conversation,
    video_paths,
    video_problem,
)

INSTALL_DATA_EXTRA = "pip install 'torch-early-fusion[data]'"
# A row group's declared uncompressed size, checked before it is read: datasets writes groups
# of 100 rows for image data (a few hundred megabytes at most); a hostile footer could declare
# anything.
MAX_ROW_GROUP_BYTES = 2 * 2**30
ROW_GROUPS_KEPT = 2  # the image columns of the last row groups read, kept for the next reads
SCAN_ROWS = 100  # rows of a save_to_disk directory checked at a time
# (messages column, images column) of each format, in the order they are looked for.
FORMATS = (("messages", "images"), ("conversations", "image"))
VIDEOS_COLUMN = "videos"  # the messages format's videos (TRL's name, beside images)
_PATH_KEYS = ("bytes", "path")


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError(
            f"reading Parquet data sets needs pyarrow: {INSTALL_DATA_EXTRA} (or pyarrow)"
        ) from None
    return pyarrow


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "reading a directory written by datasets.Dataset.save_to_disk needs the datasets "
            f"package: {INSTALL_DATA_EXTRA} (or datasets)"
        ) from None
    return datasets


class _ParquetTable(_Table):
    def __init__(self, file: Path) -> None:
        pyarrow = _pyarrow()
        self.file, self.base = file, file.parent.absolute()
        try:
            self._parquet = pyarrow.parquet.ParquetFile(file)
        except (OSError, pyarrow.ArrowException, ValueError) as error:
            raise DataError(file, None, f"not a readable Parquet file: {error}") from None
        metadata = self._parquet.metadata
        self.columns = list(self._parquet.schema_arrow.names)
        self.num_rows = int(metadata.num_rows)
        self._starts = []
        start = 0
        for group in range(metadata.num_row_groups):
            self._starts.append(start)
            start += metadata.row_group(group).num_rows
        if start != self.num_rows:
            raise DataError(file, None, "its row groups do not add up to its row count")
        self._kept: OrderedDict[tuple[int, str], Any] = OrderedDict()

    def _read(self, group: int, columns: Sequence[str]) -> Any:
        """Row group ``group``'s ``columns`` (a pyarrow Table), its declared size checked
        first."""
        pyarrow = _pyarrow()
        meta = self._parquet.metadata.row_group(group)
        size = 0
        for index in range(meta.num_columns):
            chunk = meta.column(index)
            if chunk.path_in_schema.split(".", 1)[0] in columns:
                size += max(int(chunk.total_uncompressed_size), 0)
        row = self._starts[group]
        if size > MAX_ROW_GROUP_BYTES:
            raise DataError(
                self.file,
                None,
                f"row group {group} (rows {row} to {row + meta.num_rows - 1}) declares "
                f"{size} bytes of {list(columns)}, more than {MAX_ROW_GROUP_BYTES}: refused "
                "before reading (write the data set in smaller row groups)",
            )
        try:
            return self._parquet.read_row_group(group, columns=list(columns))
        except (OSError, pyarrow.ArrowException, ValueError, MemoryError) as error:
            raise DataError(
                self.file, None, f"row group {group} (from row {row}) cannot be read: {error}"
            ) from None

    def chunks(self, columns: Sequence[str]) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        for group, start in enumerate(self._starts):
            yield start, self._read(group, columns).to_pylist()

    def cell(self, row: int, column: str) -> Any:
        group = bisect.bisect_right(self._starts, row) - 1
        key = (group, column)
        if key not in self._kept:
            self._kept[key] = self._read(group, [column]).column(0)
            while len(self._kept) > ROW_GROUPS_KEPT:
                self._kept.popitem(last=False)
        self._kept.move_to_end(key)
        return self._kept[key][row - self._starts[group]].as_py()


class _DatasetTable(_Table):
    """A ``datasets.Dataset`` (memory-mapped from a ``save_to_disk`` directory, or in
    memory), read as Arrow: images stay as stored, never decoded by ``datasets``."""

    def __init__(self, dataset: Any, file: Path, base: Path) -> None:
        self.file, self.base = file, base
        self._data = dataset.with_format("arrow")
        self.columns = list(dataset.column_names)
        self.num_rows = len(dataset)

    def chunks(self, columns: Sequence[str]) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        selected = self._data.select_columns(list(columns))
        for start in range(0, self.num_rows, SCAN_ROWS):
            yield start, selected[start : start + SCAN_ROWS].to_pylist()

    def cell(self, row: int, column: str) -> Any:
        return self._data[row : row + 1].column(column)[0].as_py()


def _without_nulls(value: Any) -> Any:
    """``value`` with the null keys of its objects dropped (Arrow's struct fields for keys a
    message or item did not have), at every depth."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _row_images(
    table: _Table,
    row: int,
    value: Any,
    column: str,
    check: bool,
    checked: dict[Path, str | None],
) -> list[ConversationImage]:
    """The images of row ``row`` (its ``column`` value) as what conversations hold, each
    decoded once to check it when ``check``.

    Raises:
        ValueError: naming the image (``images[k]``): neither bytes nor a path, not an
            image, too large, ...
    """
    from fusion.media.images import decode_image

    found: list[ConversationImage] = []
    for index, item in enumerate(_image_list(value, column)):
        where = f"{column}[{index}]"
        data, path = item, None
        if isinstance(item, dict):
            unknown = sorted(set(item) - set(_PATH_KEYS))
            if unknown:
                raise ValueError(
                    f"{where}: expected an image as datasets.Image stores it "
                    f"({{'bytes': ..., 'path': ...}}), got the keys {short_repr(unknown, 80)}"
                )
            data, path = item.get("bytes"), item.get("path")
        elif isinstance(item, str):
            data, path = None, item
        if isinstance(data, bytes):
            if check:
                decode_image(data, where)  # decodable? (pixels freed at once)
            found.append(EmbeddedImage(table, row, column, index))
        elif data is None and isinstance(path, str) and path:
            image = _resolve(path, table.base, f"{where}.path")
            if check:
                if image not in checked:
                    checked[image] = _image_problem(image)
                if checked[image] is not None:
                    raise ValueError(f"{where}: {checked[image]}")
            found.append(image)
        else:
            raise ValueError(
                f"{where}: expected encoded bytes or a file path, got {short_repr(item, 80)}"
            )
    return found


def _row_videos(table: _Table, value: Any, check: bool) -> list[ConversationVideo]:
    """The videos of a row's ``videos`` value (null: none), their files checked to exist when
    ``check``.

    Raises:
        ValueError: naming the video (``videos[k]``): not a path, a list of frame paths or a
            ``{"bytes": null, "path": ...}`` struct; embedded bytes; a missing file.
    """
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{VIDEOS_COLUMN}: expected a list of videos, got {short_repr(value, 80)}")
    found: list[ConversationVideo] = []
    for index, item in enumerate(value):
        where = f"{VIDEOS_COLUMN}[{index}]"
        if isinstance(item, dict):
            unknown = sorted(set(item) - set(_PATH_KEYS))
            if unknown:
                raise ValueError(
                    f"{where}: expected a path, a list of frame paths or a datasets.Video "
                    f"struct ({{'bytes': ..., 'path': ...}}), got the keys {short_repr(unknown)}"
                )
            if item.get("bytes") is not None:
                raise ValueError(
                    f"{where}: a clip's bytes embedded in the data set are not read (a clip is "
                    "decoded by seeking in its file); store the clips as files and their paths "
                    "in the column"
                )
            item = item.get("path")
        video = video_paths(item, table.base, where)
        if check and (problem := video_problem(video)) is not None:
            raise ValueError(f"{where}: {problem}")
        found.append(video)
    return found


def _read_table(
    table: _Table,
    conversations: list[Conversation],
    skipped: list[DataError],
    *,
    skip_bad: bool,
    check_images: bool,
) -> None:
    """Check every row of ``table``, adding its conversations and (``skip_bad``) errors."""
    format_ = next(((text, images) for text, images in FORMATS if text in table.columns), None)
    if format_ is None:
        raise DataError(
            table.file,
            None,
            "expected a 'messages' column (TRL's format, with an 'images' column) or a "
            "'conversations' column (LLaVA-Instruct's, with 'image'), got the columns "
            f"{short_repr(table.columns, 200)}",
        )
    text, images = format_
    has_images = images in table.columns
    has_videos = VIDEOS_COLUMN in table.columns  # refused with the conversations format
    columns = [text] + [images] * has_images + [VIDEOS_COLUMN] * has_videos
    checked: dict[Path, str | None] = {}
    for start, rows in table.chunks(columns):
        for offset, values in enumerate(rows):
            row = start + offset
            try:
                record = {text: _without_nulls(values[text])}
                found = None
                if has_images:
                    found = _row_images(table, row, values[images], images, check_images, checked)
                clips = None
                if has_videos:
                    clips = _row_videos(table, values[VIDEOS_COLUMN], check_images)
                messages, paths, videos = parse_conversation(
                    record, table.base, found, images, clips, VIDEOS_COLUMN
                )
            except ValueError as error:
                bad = DataError(table.file, None, str(error), row=row)
                if not skip_bad:
                    raise bad from None
                skipped.append(bad)
                continue
            conversations.append(
                Conversation(messages, paths, table.file, row + 1, row=row, videos=videos)
            )


def _tables(path: Path) -> list[_Table]:
    """The tables of ``path``: a Parquet file, a directory of them, or a ``save_to_disk``
    directory."""
    if not path.is_dir():
        return [_ParquetTable(path)]
    if (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").exists())
        raise DataError(
            path,
            None,
            f"a DatasetDict (splits {splits}): give one split's directory, e.g. "
            f"{_name(path / (splits[0] if splits else 'train'))}",
        )
    if (path / "state.json").exists():
        datasets = _datasets()
        try:
            dataset = datasets.load_from_disk(os.fspath(path), keep_in_memory=False)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
            raise DataError(path, None, f"not a readable save_to_disk directory: {error}") from None
        if not isinstance(dataset, datasets.Dataset):
            raise DataError(path, None, f"expected a Dataset, got {type(dataset).__name__}")
        return [_DatasetTable(dataset, path, path.absolute())]
    files = sorted(p for p in path.iterdir() if p.suffix == ".parquet" and p.is_file())
    if not files:
        raise DataError(
            path,
            None,
            "a directory, but neither one written by datasets.Dataset.save_to_disk "
            "(state.json) nor one of Parquet files (*.parquet)",
        )
    return [_ParquetTable(file) for file in files]


def read_hf_dataset(
    data: str | os.PathLike | Any, *, skip_bad: bool = False, check_images: bool = True
) -> ConversationFile:
    """Read and check a Hugging Face data set of conversations (see the module docstring).

    Args:
        data: a Parquet file, a directory of Parquet files (read in name order), a directory
            written by ``datasets.Dataset.save_to_disk``, or a ``datasets.Dataset``.
        skip_bad: skip bad rows (returned in ``skipped``) instead of raising.
        check_images: decode every image once to check it (pixels dropped at once), and
            check that every video's files exist.

    Returns:
        a :class:`~fusion.data.ConversationFile`: conversations in row order, each holding its
        embedded images by place (:class:`EmbeddedImage`).

    Raises:
        ImportError: ``pyarrow`` (``datasets`` for a ``save_to_disk`` directory) missing,
            naming the ``data`` extra.
        DataError: a file that is no data set, no known columns, a row group too large to
            read; unless ``skip_bad``, the first bad row (``file:row N: problem``); no row,
            or with ``skip_bad`` no good row left.
    """
    if isinstance(data, str | os.PathLike):
        path = Path(data)
        tables = _tables(path)
    elif type(data).__module__.split(".", 1)[0] == "datasets" and hasattr(data, "with_format"):
        files = [f.get("filename") for f in getattr(data, "cache_files", ())]
        path = Path(files[0]) if files and isinstance(files[0], str) else Path("<dataset>")
        tables = [_DatasetTable(data, path, Path.cwd())]
    else:
        raise TypeError("data: expected a path or a datasets.Dataset, got " + type(data).__name__)
    conversations: list[Conversation] = []
    skipped: list[DataError] = []
    for table in tables:
        _read_table(table, conversations, skipped, skip_bad=skip_bad, check_images=check_images)
    rows = len(conversations) + len(skipped)
    if rows == 0:
        raise DataError(path, None, "no conversation: the data set has no rows")
    if not conversations:
        raise DataError(
            path, None, f"no good conversation: all {rows} row(s) are bad (first: {skipped[0]})"
        )
    return ConversationFile(conversations, skipped)
