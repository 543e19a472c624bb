"""Reading files from untrusted directories: regular files only, opened without blocking."""

import os
import stat
from io import BufferedReader


class NotRegularFile(OSError):
    """A path names a FIFO, a device, a directory or a socket, not a regular file."""


def open_regular(file: str | bytes | os.PathLike) -> BufferedReader:
    """Open ``file`` (after symlinks) for reading if it is a regular file.

    A FIFO would block the open or the read until a writer comes, and a device such as
    ``/dev/zero`` never ends: ``O_NONBLOCK`` makes the open return at once, then ``fstat``
    refuses anything that is not a regular file.

    Raises:
        NotRegularFile: ``file`` is not a regular file.
        OSError: it cannot be opened (missing, no permission, ...).
    """
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"{os.fsdecode(file)!r}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
