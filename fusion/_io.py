"""Reading files from untrusted directories: regular files only, opened without blocking, and
read bounded.

:func:`read_regular` is the one bounded read: every reader of a whole file (configs, indexes,
tokenizers, chat templates, adapter configs, side files of an export, checkpoint metadata)
calls it and turns its errors into its own, naming the file.
"""

import os
import stat
from io import BufferedReader
from typing import BinaryIO

from fusion.errors import FusionError


class NotRegularFile(FusionError, OSError):
    """A path names a FIFO, a device, a directory or a socket, not a regular file."""


class FileTooLarge(FusionError, OSError):
    """A file holds more bytes than its reader takes.

    Attributes:
        limit: the most bytes taken.
        size: the size the file gave before it was read (more than ``limit``), or None when it
            grew past ``limit`` while it was read.
    """

    def __init__(self, file: str | bytes | os.PathLike, limit: int, size: int | None) -> None:
        self.limit = limit
        self.size = size
        got = f"{size} bytes" if size is not None else "grew"
        super().__init__(f"{os.fsdecode(file)!r}: {got}, more than {limit}: refused")


def open_regular(
    file: str | bytes | os.PathLike, *, follow_symlinks: bool = True
) -> BufferedReader:
    """Open ``file`` (after symlinks, unless ``follow_symlinks`` is False) for reading if it is
    a regular file.

    A FIFO would block the open or the read until a writer comes, and a device such as
    ``/dev/zero`` never ends: ``O_NONBLOCK`` makes the open return at once, then ``fstat``
    refuses anything that is not a regular file. ``follow_symlinks=False`` opens with
    ``O_NOFOLLOW``: a link (even one planted since the caller looked) is refused by the open.

    Raises:
        NotRegularFile: ``file`` is not a regular file.
        OSError: it cannot be opened (missing, no permission, a link without
            ``follow_symlinks``, ...).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(file, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"{os.fsdecode(file)!r}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_limited(handle: BinaryIO, limit: int, file: str | bytes | os.PathLike) -> bytes:
    """The whole content of the regular file open in ``handle`` (see :func:`open_regular`), at
    most ``limit`` bytes: refused before reading when its size says more, and read at most
    ``limit + 1`` bytes, so a file growing meanwhile costs nothing either.

    Raises:
        FileTooLarge: naming ``file``: more than ``limit`` bytes.
        OSError: it cannot be read.
    """
    size = os.fstat(handle.fileno()).st_size
    if size > limit:
        raise FileTooLarge(file, limit, size)
    content = handle.read(limit + 1)
    if len(content) > limit:
        raise FileTooLarge(file, limit, None)
    return content


def read_regular(
    file: str | bytes | os.PathLike, limit: int, *, follow_symlinks: bool = True
) -> bytes:
    """The content of ``file``, a regular file of at most ``limit`` bytes:
    :func:`open_regular`, then :func:`read_limited`.

    Raises:
        NotRegularFile: ``file`` is not a regular file.
        FileTooLarge: it holds more than ``limit`` bytes.
        OSError: it cannot be opened or read.
    """
    with open_regular(file, follow_symlinks=follow_symlinks) as handle:
        return read_limited(handle, limit, file)
