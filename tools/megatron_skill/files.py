"""Opening what a request names, one way for every tool.

A path in a request may name anything: a FIFO (reading it waits for a writer that never
comes), a device (/dev/zero never ends), a folder, a symbolic link that loops, a name longer
than the file system allows, a path through a regular file. Every tool opens files through
this module, which answers each of these with one ToolError that says which path and why:

- read_bytes / read_text / read_json: a regular file, read up to a size limit, text as UTF-8,
  JSON strictly (no NaN or Infinity);
- open_stream: a regular file opened for reading in pieces (large inputs such as JSONL);
- regular_file / folder: what exists, checked without reading it;
- output_folder: a folder to write into, which need not exist yet but must be makeable;
- read_regular / read_tail: the same regular-file reading for callers that answer its OSError
  with their own error (an event's ledger, a secret file, a growing log).

The files the tools leave behind (a checkpoint tracker, records of runs and conversions) are
read by read_record and read_tracker, which answer None for anything that is not such a record
instead of raising: a forged or damaged file is then simply "not ours".
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

from .errors import ToolError

MAX_NAME_BYTES = 255    # one name in a path (NAME_MAX on Linux and macOS)
MAX_PATH_BYTES = 4095   # a whole path (PATH_MAX less its NUL)
MiB = 2**20
JSON_LIMIT = 64 * MiB   # a request, config.json, a safetensors index, tokenizer_config.json
RECORD_LIMIT = 16 * MiB  # a record this skill wrote
TOKENIZER_LIMIT = 512 * MiB  # tokenizer.json (tens of MiB for the largest vocabularies)
TRACKER_LIMIT = 64      # latest_checkpointed_iteration.txt: "release" or an iteration number
TRACKER = "latest_checkpointed_iteration.txt"
ITERATION = re.compile(r"\d{1,12}")  # Megatron counts iterations in an int64; 12 digits is plenty


# ---- names ------------------------------------------------------------------------------
def check_names(path: str | Path, where: str, room: int = 0) -> Path:
    """path, refused when one of its names or the whole of it is longer than a file system allows;
    room: bytes the tool adds to the last name for the files it keeps beside it (a lock, a
    temporary), which must fit too."""
    text = os.fspath(path)
    if len(text.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES - room:
        raise ToolError("bad_request", f"the path is longer than {MAX_PATH_BYTES - room} bytes", where=where,
                        fix="give a shorter path")
    parts = Path(text).parts
    for i, name in enumerate(parts):
        most = MAX_NAME_BYTES - (room if i == len(parts) - 1 else 0)
        if len(name.encode("utf-8", "surrogateescape")) > most:
            raise ToolError("bad_request", f"a name in {_short(text)} is longer than {most} bytes ({_short(name)})",
                            where=where, fix=f"give names of at most {most} bytes (the file system allows "
                            f"{MAX_NAME_BYTES}" + (f"; the tool adds up to {room} for its own files beside it)"
                                                   if room else ")"))
    return Path(text)


def _short(text: str, keep: int = 80) -> str:
    return text if len(text) <= keep else text[:keep // 2] + "..." + text[-keep // 2:]


def _file_below(path: Path) -> Path | None:
    """The regular file (or other non-folder) that path lies below, if any."""
    for parent in path.absolute().parents:
        try:
            if not stat.S_ISDIR(os.stat(parent).st_mode):
                return parent
        except OSError:
            continue
    return None


def os_error(e: OSError, path: str | Path, where: str, what: str) -> ToolError:
    """An OSError of opening or making path, as the ToolError that says what to do."""
    shown = _short(os.fspath(path), 200)
    if e.errno == errno.ENOENT:
        return ToolError("not_found", f"no {what} at {shown}", where=where, fix=f"give the path of an existing {what}")
    if e.errno == errno.ELOOP:
        return ToolError("bad_request", f"{shown} is a symbolic link that loops (or a chain of more than 40 links)",
                         where=where, fix="give a path whose links end at a real file or folder")
    if e.errno == errno.ENAMETOOLONG:
        return ToolError("bad_request", f"a name in {shown} is longer than the file system allows", where=where,
                         fix=f"give names of at most {MAX_NAME_BYTES} bytes")
    if e.errno == errno.ENOTDIR:
        below = _file_below(Path(path))
        return ToolError("bad_request", f"{shown} lies below {below or 'a file'}, which is a file, not a folder",
                         where=where, fix="give a path whose every folder is a folder")
    if e.errno == errno.EISDIR:
        return ToolError("bad_request", f"{shown} is a folder, not a {what}", where=where,
                         fix=f"give the path of the {what} itself")
    if e.errno in (errno.EACCES, errno.EPERM):
        return ToolError("not_found", f"{shown}: permission denied", where=where,
                         fix=f"give a {what} this user may read (or write, for an output)")
    if e.errno in (errno.EROFS, errno.ENOSPC, errno.EDQUOT):
        return ToolError("bad_request", f"cannot write {shown}: {e.strerror or e}", where=where,
                         fix=f"give a {what} on a writable disk with room")
    if e.errno == errno.ENXIO:  # a socket, or a device without its driver
        return _not_regular(shown, where, what)
    return ToolError("bad_request", f"cannot read {shown}: {e.strerror or e}", where=where, fix=f"give a readable {what}")


def _not_regular(shown: str, where: str, what: str) -> ToolError:
    return ToolError("bad_request", f"{shown} is not a regular file (a FIFO, a device or a socket)", where=where,
                     fix=f"give a regular {what} (copy what a pipe gives into a file first)")


# ---- reading --------------------------------------------------------------------------
class NotRegular(OSError):
    """The path is there but is no regular file (a folder, a FIFO, a device, a socket)."""

    def __init__(self, path: str | Path, is_dir: bool):
        super().__init__(f"{path} is {'a folder' if is_dir else 'not a regular file'}")
        self.is_dir = is_dir


class TooLarge(OSError):
    """The file is larger than the reader accepts."""


def regular_fd(path: str | Path) -> int:
    """A descriptor of path opened for reading, once it is known to be a regular file; OSError
    (NotRegular for anything else) otherwise. The open itself never waits: O_NONBLOCK makes a
    FIFO's open return at once (and is then cleared)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(path, stat.S_ISDIR(mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | Path, limit: int) -> bytes:
    """The bytes of a regular file of at most limit bytes; OSError (TooLarge, NotRegular,
    FileNotFoundError, ...) otherwise."""
    with os.fdopen(regular_fd(path), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"{path} is larger than {limit} bytes")
    return data


def read_tail(path: str | Path, nbytes: int) -> bytes:
    """The last nbytes of a regular file of any size (a growing log); OSError otherwise."""
    fd = regular_fd(path)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        os.lseek(fd, max(0, size - nbytes), os.SEEK_SET)
        return os.read(fd, nbytes)
    finally:
        os.close(fd)


def _open_regular(path: str | Path, where: str, what: str) -> int:
    """regular_fd, its refusals as the ToolError that says what to do."""
    check_names(path, where)
    try:
        return regular_fd(path)
    except NotRegular as e:
        shown = _short(os.fspath(path), 200)
        if e.is_dir:
            raise ToolError("bad_request", f"{shown} is a folder, not a {what}", where=where,
                            fix=f"give the path of the {what} itself") from None
        raise _not_regular(shown, where, what) from None
    except OSError as e:
        raise os_error(e, path, where, what) from None


def open_stream(path: str | Path, where: str, what: str = "file") -> BinaryIO:
    """path opened for reading in binary, when it is a regular file (any size)."""
    return os.fdopen(_open_regular(path, where, what), "rb")


def read_bytes(path: str | Path, where: str, what: str = "file", limit: int = JSON_LIMIT) -> bytes:
    """The bytes of a regular file of at most limit bytes."""
    with open_stream(path, where, what) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:  # opened, yet unreadable: /proc/self/mem (EIO), a file on a failing disk
            raise os_error(e, path, where, what) from None
    if len(data) > limit:
        raise ToolError("bad_request", f"{_short(os.fspath(path), 200)} is larger than {limit:,} bytes, more than "
                        f"any {what} holds", where=where, fix=f"give the {what} itself")
    return data


def decode(data: bytes, name: str, where: str, code: str = "bad_request") -> str:
    """data as UTF-8 text, or the ToolError that says where it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ToolError(code, f"{name} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}",
                        where=where, fix="give a UTF-8 text file") from None


def read_text(path: str | Path, where: str, what: str = "file", limit: int = JSON_LIMIT,
              code: str = "bad_request") -> str:
    """The UTF-8 text of a regular file of at most limit bytes."""
    return decode(read_bytes(path, where, what, limit), _short(os.fspath(path), 200), where, code)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class DuplicateKey(ValueError):
    """An object that gives one key twice: Python's reader keeps the last, another reader the first."""


def unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"the key {key!r} is given twice in one object")
        out[key] = value
    return out


def parse_json(text: str, name: str, where: str, code: str = "bad_request", unique_keys: bool = False,
               unicode_checked_later: bool = False) -> Any:
    """Strict JSON (NaN and Infinity refused, as is nesting deeper than the parser follows, and
    text that is not Unicode: an escaped lone surrogate, which no later write could encode);
    unique_keys: an object giving a key twice too (which of the two was meant is not ours to guess);
    unicode_checked_later: the caller names the field that holds a lone surrogate (a request's
    check of its values), so it is not refused here."""
    try:
        value = json.loads(text, parse_constant=_no_constant, object_pairs_hook=unique_object if unique_keys else None)
        if not unicode_checked_later and _SURROGATE_ESCAPE.search(text):   # a pair decodes to one character; a lone half stays
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value
    except DuplicateKey as e:
        raise ToolError(code, f"{name}: {e}", where=where,
                        fix="give each key once: which of the two was meant is not for the tool to guess") from None
    except UnicodeEncodeError as e:
        raise ToolError(code, f"{name} holds a lone surrogate (\\u{ord(e.object[e.start]):04x}), which is not "
                        "Unicode", where=where, fix="write the file as valid UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ToolError(code, f"{name} is not JSON: {e}", where=where, fix="give one JSON document") from None
    except ValueError as e:
        raise ToolError(code, f"{name}: {e}", where=where,
                        fix="give finite numbers (JSON has no NaN or Infinity)") from None
    except RecursionError:
        raise ToolError(code, f"{name} is nested too deeply", where=where, fix="give a JSON document of "
                        "ordinary depth") from None


def read_json(path: str | Path, where: str, what: str = "JSON file", limit: int = JSON_LIMIT,
              code: str = "bad_request", unique_keys: bool = False) -> Any:
    """A regular file's strict JSON; code is the error code of content that is not (bad_model for
    a model's config.json)."""
    return parse_json(read_text(path, where, what, limit, code), _short(os.fspath(path), 200), where, code,
                      unique_keys)


def read_json_object(path: str | Path, where: str, what: str = "JSON file", limit: int = JSON_LIMIT,
                     code: str = "bad_request", unique_keys: bool = False) -> dict[str, Any]:
    value = read_json(path, where, what, limit, code, unique_keys)
    if not isinstance(value, dict):
        raise ToolError(code, f"{_short(os.fspath(path), 200)} holds a JSON {type(value).__name__}, not an object",
                        where=where, fix=f"give the {what} itself")
    return value


# ---- what exists ------------------------------------------------------------------------
def _stat(path: str | Path, where: str, what: str) -> os.stat_result:
    check_names(path, where)
    try:
        return os.stat(path)
    except OSError as e:
        raise os_error(e, path, where, what) from None


def regular_file(path: str | Path, where: str, what: str = "file") -> Path:
    """path, when it is a regular file (a link to one will do)."""
    mode = _stat(path, where, what).st_mode
    if stat.S_ISDIR(mode):
        raise ToolError("bad_request", f"{_short(os.fspath(path), 200)} is a folder, not a {what}", where=where,
                        fix=f"give the path of the {what} itself")
    if not stat.S_ISREG(mode):
        raise _not_regular(_short(os.fspath(path), 200), where, what)
    return Path(path)


def folder(path: str | Path, where: str, what: str = "folder") -> Path:
    """path, when it is a folder (a link to one will do)."""
    if not stat.S_ISDIR(_stat(path, where, what).st_mode):
        raise ToolError("bad_request", f"{_short(os.fspath(path), 200)} is a file, not a {what}", where=where,
                        fix=f"give the path of a {what}")
    return Path(path)


def kind_of(path: str | Path) -> str:
    """'file', 'folder', 'missing' or 'other' (a FIFO, a device, a loop, a path through a file)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError):
        return "other"
    return "file" if stat.S_ISREG(mode) else "folder" if stat.S_ISDIR(mode) else "other"


def is_file(path: str | Path) -> bool:
    """Path.is_file that answers False where the name cannot exist (Python 3.12's raises on a name
    too long for the file system, a request's error, not the tool's)."""
    return kind_of(path) == "file"


def is_dir(path: str | Path) -> bool:
    """Path.is_dir, the same way."""
    return kind_of(path) == "folder"


def output_folder(path: str | Path, where: str, what: str = "output folder", room: int = 0) -> Path:
    """path, a folder to write into: it is one, or it can be made (no name too long, no file where
    it or one of its parents would be, no link that loops or points nowhere)."""
    check_names(path, where, room)
    target = Path(path).absolute()
    for candidate in (target, *target.parents):
        try:
            mode = os.stat(candidate).st_mode
        except FileNotFoundError:
            if os.path.islink(candidate):
                raise ToolError("bad_request", f"{candidate} is a symbolic link to nothing", where=where,
                                fix=f"remove the link, or give another {what}") from None
            continue
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                continue  # a parent is a file: found further up
            raise os_error(e, candidate, where, what) from None
        if stat.S_ISDIR(mode):
            return target
        shown = _short(str(candidate), 200)
        raise ToolError("bad_request", f"{shown} is a file, not a folder" if candidate == target else
                        f"{_short(str(target), 200)} lies below {shown}, which is a file, not a folder",
                        where=where, fix=f"give a path for the {what} that is a folder, or can be made as one")
    return target


def make_folder(path: str | Path, where: str, what: str = "output folder") -> Path:
    """output_folder(path), made with its parents."""
    target = output_folder(path, where, what)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, target, where, what) from None
    return target


# ---- files the tools leave behind -----------------------------------------------------------
def read_record(path: str | Path) -> dict[str, Any] | None:
    """A JSON object a tool of this skill wrote at path, or None for anything else (missing, not a
    regular file, too large, not UTF-8, not JSON, not an object)."""
    try:
        value = read_json(path, where="", limit=RECORD_LIMIT)
    except ToolError:
        return None
    return value if isinstance(value, dict) else None


def read_tracker(checkpoints: str | Path) -> int | str | None:
    """What Megatron's tracker in a checkpoint folder says: an iteration, "release", or None when
    there is no tracker or it holds neither (a forged or damaged file)."""
    try:
        text = read_text(Path(checkpoints) / TRACKER, where="", limit=TRACKER_LIMIT).strip()
    except ToolError:
        return None
    if text == "release":
        return text
    return int(text) if ITERATION.fullmatch(text) else None


def has_tracker(checkpoints: str | Path) -> bool:
    return os.path.lexists(Path(checkpoints) / TRACKER)


def fingerprint(paths: list[Path]) -> dict[str, list[int]]:
    """Size and modification time (ns) of each path that is a regular file: what a result made
    from these files is checked against before it is given again."""
    out = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[str(Path(p).absolute())] = [st.st_size, st.st_mtime_ns]
    return out
