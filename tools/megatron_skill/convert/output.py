"""The output folder of a conversion: made whole or not at all, never over someone else's files.

The work is written into a hidden sibling folder and renamed into place at the end, with a
record (RECORD) naming the tool and the request id. The same request again returns the record's
result, unless the files it was made from changed since (the record keeps their sizes and
modification times); another request's folder is replaced only with overwrite, and only when
it holds exactly the files the record's manifest lists (a record alone, forged or copied, never
makes anyone's other files ours); any other non-empty folder is left as it is.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

from .. import files
from ..errors import ToolError
from ..locks import Busy, FileLock, not_a_lock

RECORD = "conversion.json"
ROOM = 40  # bytes the staging, lock and set-aside names add to the output's name


def check(out: Path, where: str = "/output") -> Path:
    """out, when a conversion can write it: a folder or nothing yet, below folders, its name short
    enough for the hidden names beside it."""
    return files.output_folder(out, where, "output folder", room=ROOM)


def existing(out: Path, tool: str, rid: str, overwrite: bool, where: str,
             inputs: dict[str, list[int]] | None = None) -> dict[str, Any] | None:
    """The recorded result when this request made out from these same inputs; None when out may be
    (re)made; else a ToolError saying what is in the way."""
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_symlink():
        raise ToolError("conflict", f"{out} is a symbolic link", where=where,
                        fix="give the folder it points to, or another output")
    if not out.is_dir():
        raise ToolError("conflict", f"{out} exists and is not a folder", where=where, fix="choose another output")
    record = _record(out)
    if record is None:
        if any(out.iterdir()):
            raise ToolError("conflict", f"{out} holds files this skill did not write", where=where,
                            fix="choose a new or empty folder (the files there are left as they are)")
        return None
    same = record.get("tool") == tool and record.get("request_id") == rid
    if same and (inputs is None or record.get("inputs", inputs) == inputs):
        return {**record["result"], "already_done": True}
    if not same and not overwrite:
        raise ToolError("conflict", f"{out} holds the result of another {record.get('tool')} request "
                        f"({record.get('request_id')})", where=where,
                        fix="choose another output, or set overwrite true to replace it")
    strangers = _strangers(out, record)
    if strangers:
        raise ToolError("conflict", f"{out} holds files its conversion.json does not list as this skill's "
                        f"({', '.join(strangers[:3])}{', ...' if len(strangers) > 3 else ''})", where=where,
                        fix="move those files away, or choose another output (nothing there is removed)")
    return None


def already(out: Path, tool: str, rid: str, overwrite: bool, ctx,
            inputs: dict[str, list[int]] | None = None) -> dict[str, Any] | None:
    """existing(), said on the progress stream: this same request answered from the record, or
    made again because what it was made from changed."""
    done = existing(out, tool, rid, overwrite, "/output", inputs)
    if done is not None:
        ctx.progress(f"{tool}: {out} was made by this same request; nothing to do")
    elif (_record(out) or {}).get("request_id") == rid:
        ctx.progress(f"{tool}: the files {out} was made from changed since; making it again")
    return done


@contextlib.contextmanager
def claim(out: Path, tool: str, rid: str, overwrite: bool, ctx, inputs: dict[str, list[int]] | None = None):
    """Hold the output's lock; yields already()'s answer, checked again under the lock."""
    held = lock(out, tool)
    try:
        yield already(out, tool, rid, overwrite, ctx, inputs)
    finally:
        held.release()


def _record(out: Path) -> dict[str, Any] | None:
    rec = files.read_record(out / RECORD)
    return rec if rec is not None and isinstance(rec.get("result"), dict) else None


def manifest(folder: Path) -> dict[str, int] | None:
    """Every file below folder (relative path: size), the record aside; None when something there
    is neither a regular file nor a folder (a link, a FIFO): never a conversion's own."""
    out: dict[str, int] = {}
    for top, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = Path(top) / name
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                out[path.relative_to(folder).as_posix()] = st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                return None
    out.pop(RECORD, None)
    return out


def _strangers(out: Path, record: dict[str, Any]) -> list[str]:
    """What in out the record does not list as written by its conversion (name and size), or that
    it lists but is gone or changed; empty when out is wholly the conversion's. A record whose
    request id is not its request's is nobody's: everything is a stranger then."""
    listed = record.get("files")
    here = manifest(out)
    if here is None:
        return ["a link or a special file"]
    if not isinstance(listed, dict) or record.get("request_id") not in _request_ids(record):
        return sorted(here) or [RECORD]
    return sorted(k for k in set(here) | set(listed) if here.get(k) != listed.get(k))


def _request_ids(record: dict[str, Any]) -> set[str]:
    """The ids the record's own request has: today's (its paths are stored absolute, so from any
    working folder), and the one an earlier version wrote for it."""
    from ..contract import legacy_request_id, request_id

    request, tool = record.get("request"), record.get("tool")
    if not (isinstance(request, dict) and isinstance(tool, str)):
        return set()
    return {request_id(tool, request), legacy_request_id(tool, request)}


def _remove_listed(folder: Path, listed: dict[str, int]) -> bool:
    """Remove the files listed (and folders left empty) from folder; whether it is gone."""
    (folder / RECORD).unlink(missing_ok=True)
    for rel in listed:
        (folder / rel).unlink(missing_ok=True)
    for top, _, _ in sorted(os.walk(folder), key=lambda w: -len(Path(w[0]).parts)):
        with contextlib.suppress(OSError):
            Path(top).rmdir()  # only when empty: anything else stays
    return not folder.exists()


class OutputBusy(ToolError):
    """Another process holds the output's lock (it is converting into the same folder now)."""


def lock(out: Path, tool: str) -> FileLock:
    """The lock of whoever writes out (a file beside it, kept, never written): two conversions
    into one folder would clear each other's staging."""
    files.make_folder(out.parent, "/output")
    try:
        return FileLock(out.with_name(f".{out.name}.conversion.lock")).acquire()
    except Busy:
        raise OutputBusy("conflict", f"another conversion is writing {out}", where="/output",
                        fix="wait for it to finish, or choose another output") from None
    except OSError:
        raise not_a_lock(out.with_name(f".{out.name}.conversion.lock"), "/output") from None


def staging(out: Path, rid: str) -> Path:
    """A fresh hidden sibling folder to build the result in (a stale one of a killed run of this
    same request is ours to clear)."""
    tmp = out.with_name(f".{out.name}.{rid}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, out: Path, tool: str, rid: str, request: dict, result: dict,
            inputs: dict[str, list[int]] | None = None) -> None:
    """Write the record (with the manifest of what tmp holds and the inputs' fingerprint) into tmp,
    then put tmp at out: an empty folder or a previous result of this skill (checked by existing)
    is moved aside first, and only the files its manifest lists are removed from it after."""
    listed = manifest(tmp) or {}
    from ..contract import with_absolute_paths

    request = with_absolute_paths(request)   # its id the same from any working folder
    (tmp / RECORD).write_text(json.dumps({"tool": tool, "request_id": rid, "request": request, "result": result,
                                          "files": listed, "inputs": inputs or {}}, indent=1) + "\n")
    old = None
    previous = _record(out) if out.exists() else None
    if out.exists():
        if previous is None:
            out.rmdir()  # empty: existing() refused anything else
        else:
            old = out.with_name(f".{out.name}.{rid}.old-{os.getpid()}")
            out.rename(old)
    tmp.rename(out)
    if old is not None and not _remove_listed(old, previous.get("files") or {}):
        print(f"{tool}: {old} keeps files that appeared while {out} was replaced; they are left there",
              file=sys.stderr)


def record_of(folder: Path) -> dict[str, Any] | None:
    """The record of a folder this skill's conversion wrote, or None."""
    return _record(Path(folder))
