"""Exclusive locks and atomic files, the two primitives that keep concurrent or killed runs
from losing data.

A lock is ``flock`` on a file: the kernel grants it to one process at a time and releases it
when that process dies, however it dies, so there is no stale owner to detect and no
check-then-take race.  The lock file is never deleted (deleting it would let a second
process lock a new file of the same name while the first still holds the old one); it is
created empty when missing and never written unless the caller owns the folder.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any


class Busy(Exception):
    """The lock is held by another process (its owner, when it said who it is)."""

    def __init__(self, owner: dict[str, Any]):
        super().__init__(f"held by {owner or 'another process'}")
        self.owner = owner


def not_a_lock(path: Path, where: str):
    """The answer when a lock's name holds something else (a link, a folder, a pipe, a device):
    a request's clear error, never a write through it."""
    from .errors import ToolError

    return ToolError("conflict", f"{path} is not a lock file (a link, folder, pipe or device stands at its name)",
                     where=where, fix="move it away (nothing there is removed or written) and ask again")


class NotALockFile(OSError):
    """The lock's name holds something else than a regular file."""


class FileLock:
    """``with FileLock(path, record_owner=True):`` -- raises Busy at once if another process holds it.

    record_owner writes the holder's pid, host and start time into the file (only for lock
    files inside a folder the tool made: a user's file of that name is never written)."""

    def __init__(self, path: Path, record_owner: bool = False):
        self.path = Path(path)
        self.record_owner = record_owner
        self.fd: int | None = None

    def acquire(self) -> "FileLock":
        """The lock; Busy while another process holds it; OSError when the lock's name holds no
        lock file of ours: a symbolic link (never followed: the owner record would be written
        wherever it points), a FIFO, a device or a folder (NotALockFile)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotALockFile(f"{self.path} is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Busy(self.owner()) from None
        except BaseException:
            os.close(fd)
            raise
        if self.record_owner:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                          "since": time.time()}).encode(), 0)
            except BaseException:
                os.close(fd)   # gives the lock back too
                raise
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            if self.record_owner:
                os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def held_elsewhere(self) -> bool:
        """Whether another process holds the lock now (a probe: takes it and gives it back)."""
        if not self.path.exists():
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)   # a FIFO would wait
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def owner(self) -> dict[str, Any]:
        if not self.record_owner:
            return {}
        from .files import read_regular

        try:
            owner = json.loads(read_regular(self.path, 4096) or b"{}")   # bounded: never a device's endless read
        except (OSError, ValueError, RecursionError):
            return {}
        return owner if isinstance(owner, dict) else {}

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Write path so that a reader sees the old content or the new, never half of it (a
    temporary of a name only this process uses, fsynced, renamed over path)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)
    _remove_stale_temporaries(path)


def _remove_stale_temporaries(path: Path) -> None:
    """The temporaries of path that a killed writer left (write_atomic's own name pattern, a
    regular file, its process gone): a kill between the write and the rename leaves one, and no
    later run would remove it otherwise. A live writer's is left alone."""
    prefix, suffix = f".{path.name}.", ".tmp"
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):-len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else ""
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        stale = path.parent / name
        if stale.is_symlink() or not stale.is_file():
            continue
        try:
            stale.unlink()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True   # another user's process, or no process number at all: not ours to judge
    return True
