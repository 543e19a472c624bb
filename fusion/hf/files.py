"""Reading whole files from untrusted Hugging Face directories, bounded: JSON files
(``config.json``, indexes, processor configs) and ``tokenizer.json``.

Every failure is a :class:`~fusion.hf.errors.CheckpointError` naming the file. Only regular
files are read (links to them are followed; FIFOs and devices refused), each capped in size
before it is read (:func:`fusion._io.read_regular`), and JSON is parsed strictly
(:func:`parse_json`).
"""

import json
from io import BufferedReader
from pathlib import Path
from typing import Any

from fusion._io import FileTooLarge, NotRegularFile, open_regular, read_regular
from fusion.hf.errors import CheckpointError

MAX_JSON_BYTES = 32 * 2**20  # config.json and indexes: real ones are kilobytes
MAX_TOKENIZER_BYTES = 256 * 2**20  # tokenizer.json: the largest real ones are tens of megabytes


def open_regular_file(file: Path, what: str = "file") -> BufferedReader:
    """Open ``file`` for reading, refusing anything but a regular file (after symlinks)."""
    try:
        return open_regular(file)
    except NotRegularFile:
        raise CheckpointError(
            file, None, f"{what} is not a regular file (a FIFO, device, ...)"
        ) from None
    except OSError as error:
        raise CheckpointError(file, None, f"unreadable {what}: {error.strerror}") from error


def parse_json(raw: bytes, file: Path, problem: str) -> Any:
    """Parse untrusted JSON; a failure is a :class:`CheckpointError` starting with ``problem``.

    ``Infinity``/``NaN`` parse to floats, and so do integers of more than 40 digits (as JSON
    numbers beyond a float's range already do), never to a huge int: the caller's type checks
    then name the key at fault."""
    try:
        return json.loads(raw, parse_int=lambda text: int(text) if len(text) <= 40 else float(text))
    except RecursionError:
        raise CheckpointError(file, None, f"{problem}: nested too deeply") from None
    except ValueError as error:  # includes JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(file, None, f"{problem}: {error}") from error


def read_bounded(file: Path, limit: int, what: str = "") -> bytes:
    """The content of the regular file ``file``, refused when it holds more than ``limit`` bytes
    (:func:`fusion._io.read_regular`: a huge or growing file costs nothing); ``what`` names
    the file at the start of its errors.

    Raises:
        CheckpointError: naming ``file``: not a regular file, unreadable, or too large.
    """
    try:
        return read_regular(file, limit)
    except NotRegularFile:
        problem = f"{what} is not" if what else "not"
        raise CheckpointError(
            file, None, f"{problem} a regular file (a FIFO, device, ...)"
        ) from None
    except FileTooLarge:
        named = f"{what} larger" if what else "larger"
        raise CheckpointError(file, None, f"{named} than {limit} bytes: refused") from None
    except OSError as error:
        named = f"unreadable {what}" if what else "unreadable"
        raise CheckpointError(file, None, f"{named}: {error.strerror}") from error


def read_tokenizer(file: Path, *, missing: str | None = None) -> Any:
    """``tokenizer.json`` (a regular file of at most :data:`MAX_TOKENIZER_BYTES`) as a
    ``tokenizers.Tokenizer``: JSON data, nothing executed. With ``missing``, a file that does
    not exist is refused as ``missing: {missing}``.

    Raises:
        ImportError: the ``tokenizers`` package is not installed.
        CheckpointError: naming ``file``: missing, not a regular file, too large or unreadable.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("reading tokenizer.json needs the tokenizers package") from None
    if missing is not None and not file.exists():
        raise CheckpointError(file, None, f"missing: {missing}")
    raw = read_bounded(file, MAX_TOKENIZER_BYTES)
    try:
        return Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as error:  # tokenizers raises plain Exception
        raise CheckpointError(file, None, f"unreadable tokenizer: {error}") from None


def read_json(file: Path, what: str) -> Any:
    """Read a JSON file of at most :data:`MAX_JSON_BYTES` (``what`` names it in errors)."""
    raw = read_bounded(file, MAX_JSON_BYTES, what)
    return parse_json(raw, file, f"unreadable {what}")
