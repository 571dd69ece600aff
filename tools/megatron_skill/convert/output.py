"""The output folder of a conversion: made whole or not at all, never over someone else's files.

The work is written into a hidden sibling folder and renamed into place at the end, with a
record (RECORD) naming the tool and the request id. The same request again returns the record's
result; another request's folder is replaced only with overwrite, and only when the record says
this skill made it; any other non-empty folder is left as it is.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import ToolError
from ..locks import Busy, FileLock

RECORD = "conversion.json"


def existing(out: Path, tool: str, rid: str, overwrite: bool, where: str) -> dict[str, Any] | None:
    """The recorded result when this request made out; None when out may be (re)made; else a
    ToolError saying what is in the way."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise ToolError("conflict", f"{out} exists and is not a folder", where=where, fix="choose another output")
    record = _record(out)
    if record is None:
        if any(out.iterdir()):
            raise ToolError("conflict", f"{out} holds files this skill did not write", where=where,
                            fix="choose a new or empty folder (the files there are left as they are)")
        return None
    if record.get("tool") == tool and record.get("request_id") == rid:
        return {**record["result"], "already_done": True}
    if not overwrite:
        raise ToolError("conflict", f"{out} holds the result of another {record.get('tool')} request "
                        f"({record.get('request_id')})", where=where,
                        fix="choose another output, or set overwrite true to replace it")
    return None


def already(out: Path, tool: str, rid: str, overwrite: bool, ctx) -> dict[str, Any] | None:
    """existing(), said on the progress stream when this same request is answered from the record."""
    done = existing(out, tool, rid, overwrite, "/output")
    if done is not None:
        ctx.progress(f"{tool}: {out} was made by this same request; nothing to do")
    return done


@contextlib.contextmanager
def claim(out: Path, tool: str, rid: str, overwrite: bool, ctx):
    """Hold the output's lock; yields already()'s answer, checked again under the lock."""
    held = lock(out, tool)
    try:
        yield already(out, tool, rid, overwrite, ctx)
    finally:
        held.release()


def _record(out: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads((out / RECORD).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("result"), dict) else None


def lock(out: Path, tool: str) -> FileLock:
    """The lock of whoever writes out (a file beside it, kept, never written): two conversions
    into one folder would clear each other's staging."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        return FileLock(out.with_name(f".{out.name}.conversion.lock")).acquire()
    except Busy:
        raise ToolError("conflict", f"another conversion is writing {out}", where="/output",
                        fix="wait for it to finish, or choose another output") from None


def staging(out: Path, rid: str) -> Path:
    """A fresh hidden sibling folder to build the result in (a stale one of a killed run of this
    same request is ours to clear)."""
    tmp = out.with_name(f".{out.name}.{rid}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, out: Path, tool: str, rid: str, request: dict, result: dict) -> None:
    """Write the record into tmp, then put tmp at out: an empty folder or a previous result of
    this skill (checked by existing) is moved aside first and removed after."""
    (tmp / RECORD).write_text(json.dumps({"tool": tool, "request_id": rid, "request": request, "result": result},
                                         indent=1) + "\n")
    old = None
    if out.exists():
        if _record(out) is None:
            out.rmdir()  # empty: existing() refused anything else
        else:
            old = out.with_name(f".{out.name}.{rid}.old-{os.getpid()}")
            out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


def record_of(folder: Path) -> dict[str, Any] | None:
    """The record of a folder this skill's conversion wrote, or None."""
    return _record(Path(folder))
