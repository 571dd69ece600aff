"""Reading a file someone else could have put in place (an event, a secret, a run's record)
without ever blocking on it: only a regular file of bounded size is read. A FIFO, a device or a
socket is refused at once (the file is opened without waiting and checked before any read)."""
from __future__ import annotations

import os
import stat
from pathlib import Path


class NotReadable(OSError):
    """The path is there but is no regular file."""


class TooLarge(NotReadable):
    """The file is larger than the reader accepts."""


def read_bounded(path: Path | str, limit: int) -> bytes:
    """The bytes of a regular file of at most limit bytes; FileNotFoundError, NotReadable or
    another OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotReadable(f"{path} is not a regular file")
        if info.st_size > limit:
            raise TooLarge(f"{path} is larger than {limit} bytes")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise TooLarge(f"{path} is larger than {limit} bytes")
    return data


def read_tail(path: Path | str, nbytes: int) -> bytes:
    """The last nbytes of a regular file of any size (a growing log); NotReadable for a FIFO,
    a device or a socket."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotReadable(f"{path} is not a regular file")
        size = os.lseek(fd, 0, os.SEEK_END)
        os.lseek(fd, max(0, size - nbytes), os.SEEK_SET)
        return os.read(fd, nbytes)
    finally:
        os.close(fd)
