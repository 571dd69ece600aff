"""The record of handled events, one per run: which event ids were seen, each incident (one job's
end, one stall, ...) with every report of it, its cause, the actions decided for it and which of
them were carried out, and when the run was relaunched. It lives in
RUNS_ROOT/.events/RUN_ID/ledger.json, rewritten whole and atomically under the folder's lock, so a
crash leaves the old record or the new one, and two handlers of the same run take turns.

Seen is not acted: an incident's actions are recorded when they are decided, and each one is
marked as started before its process starts (write-ahead). A handler that dies in between leaves
it marked, so nothing is ever started twice for one incident (at most once is the right side to
err on for relaunches); until it is marked, any later report of the incident may start it.
"""
from __future__ import annotations

import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Any

from ..errors import ToolError
from ..files import read_regular
from ..locks import Busy, FileLock, write_atomic
from .event import job_of

KEEP_EVENTS = 2000  # event ids remembered per run; older ones go (a replay that old is stale anyway)
LOCK_WAIT_S = 30.0
MAX_BYTES = 64 * 1024 * 1024
RELAUNCHING = ("resume", "relayout")  # the actions that start the job again: one per incident

_NUMBER = {"type": "number"}
_TEXT = {"type": "string"}
# A decided action as on-event answers it (its response schema), with the command it starts.
ACTION = {"allOf": [{"$ref": "on-event.response.json#/properties/result/properties/actions/items"},
                    {"properties": {"argv": {"type": "array", "items": _TEXT}, "cwd": _TEXT}}]}
# The record's shape, checked on every read: a damaged or hand-edited file is a clear error, never
# a crash half-way through handling an event.
SHAPE = {
    "type": "object",
    "properties": {
        "events": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["type", "seen", "job_id"],
            "properties": {"type": _TEXT, "seen": _NUMBER, "job_id": _TEXT, "incident": {"type": ["string", "null"]},
                           "verdict": _TEXT, "time": _TEXT}}},
        "incidents": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["event_id", "actions", "applied"],
            "properties": {"event_id": _TEXT, "at": _NUMBER, "cause": _TEXT,
                           "actions": {"type": "array", "items": {"anyOf": [_TEXT, ACTION]}},
                           "applied": {"type": "object", "additionalProperties": {"type": "object"}},
                           "reports": {"type": "array", "items": {
                               "type": "object", "required": ["event_id"],
                               "properties": {"event_id": _TEXT, "cause": {"type": ["string", "null"]},
                                              "nodes": {"type": "array", "items": _TEXT},
                                              "iteration": {"type": "integer"}}}}}}},
        "relaunches": {"type": "array", "items": _NUMBER},
        "checkpoints": {"type": "object", "additionalProperties": {"type": "object"}},
    },
}


def folder(runs_root: Path, run_id: str) -> Path:
    return runs_root / ".events" / run_id


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _damaged(path: Path, why: str) -> ToolError:
    return ToolError("runtime", f"the event record {path} is damaged: {why}", where=str(path),
                     fix="move the file aside (events already handled may then act again), or restore it")


def _not_a_folder(path: Path, why: str) -> ToolError:
    return ToolError("runtime", f"{path} must be a folder that on-event writes in, but {why}", where=str(path),
                     fix="move it aside, and on-event makes the folder itself (its record of handled events is in "
                         "RUNS_ROOT/.events/RUN_ID: moved aside, events already handled may act again)")


def own_folder(root: Path, *names: str) -> Path:
    """root/names..., each a real folder below root (made where missing): never a symbolic link,
    which would put the record, its lock and the proposals wherever it points."""
    path = root
    for name in names:
        path = path / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            try:
                os.mkdir(path)
                continue
            except OSError as e:
                raise _not_a_folder(path, f"it cannot be made ({e.strerror or e})") from None
        except OSError as e:
            raise _not_a_folder(path, str(e.strerror or e)) from None
        if stat.S_ISLNK(mode):
            raise _not_a_folder(path, "it is a symbolic link")
        if not stat.S_ISDIR(mode):
            raise _not_a_folder(path, "it is a file")
    return path


class Ledger:
    def __init__(self, runs_root: Path, run_id: str):
        self.root, self.run_id = runs_root, run_id
        self.dir = folder(runs_root, run_id)
        self.path = self.dir / "ledger.json"
        self.data: dict[str, Any] = {"events": {}, "incidents": {}, "relaunches": [], "checkpoints": {}}
        self._lock: FileLock | None = None

    def read(self) -> "Ledger":
        if os.path.islink(self.path):
            raise _damaged(self.path, "it is a symbolic link, not the record on-event writes")
        try:
            raw = read_regular(self.path, MAX_BYTES)
        except FileNotFoundError:
            return self
        except NotADirectoryError:
            raise _damaged(self.path, "a file is where one of its folders should be") from None
        except OSError as e:
            raise _damaged(self.path, str(e.strerror or e)) from None
        try:
            stored = json.loads(raw.decode("utf-8"), parse_float=_finite, parse_constant=_refuse_constant)
            json.dumps(stored, ensure_ascii=False).encode("utf-8")   # a lone surrogate (\ud800) is no text
        except UnicodeEncodeError:
            raise _damaged(self.path, "it holds a lone surrogate, which is not Unicode") from None
        except (ValueError, RecursionError) as e:
            raise _damaged(self.path, f"not JSON ({e})") from None
        self._check(stored)
        self.data.update(stored)
        return self

    def _check(self, stored: Any) -> None:
        from ..contract import validator

        error = next(iter(validator(SHAPE).iter_errors(stored)), None)
        if error is not None:
            where = "/" + "/".join(str(p) for p in error.absolute_path)
            raise _damaged(self.path, f"at {where}: {error.message}")

    def __enter__(self) -> "Ledger":
        own_folder(self.root, ".events", self.run_id)
        lock = FileLock(self.dir / "ledger.lock", record_owner=True)
        end = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                self._lock = lock.acquire()
                break
            except Busy as busy:
                if time.monotonic() > end:
                    raise ToolError("conflict", f"another handler holds the event record of this run ({busy.owner})",
                                    where=str(lock.path), fix="send the event again in a minute") from None
                time.sleep(0.1)
            except OSError as e:   # a link, a FIFO, a device or a folder where the lock file goes
                raise ToolError("runtime", f"the event record's lock {lock.path} is not a lock file of on-event "
                                f"({e.strerror or e})", where=str(lock.path),
                                fix="move it aside; on-event makes a new one") from None
        try:
            return self.read()
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        if self._lock:
            self._lock.release()

    def proposals(self) -> Path:
        """The folder of the proposed train requests (a real folder of the record's, made here)."""
        return own_folder(self.root, ".events", self.run_id, "proposals")

    def save(self) -> None:
        events = self.data["events"]
        if len(events) > KEEP_EVENTS:
            for key in sorted(events, key=lambda k: events[k]["seen"])[:len(events) - KEEP_EVENTS]:
                del events[key]
        write_atomic(self.path, json.dumps(self.data, indent=1, sort_keys=True))

    # ---- events
    def seen(self, event_id: str) -> dict[str, Any] | None:
        return self.data["events"].get(event_id)

    def note(self, event: dict[str, Any], verdict: str, incident: str | None) -> None:
        self.data["events"][event["event_id"]] = {"type": event["type"], "time": event["time"], "seen": time.time(),
                                                  "verdict": verdict, "incident": incident,
                                                  "job_id": job_of(event)}

    def latest_attempt(self, job_id: str) -> int:
        """The last attempt of this job that the record has events of (0: its first, or none)."""
        attempts = [0]
        for e in self.data["events"].values():
            job, _, n = str(e.get("job_id")).partition("~")
            if job == job_id and n.isdigit():
                attempts.append(int(n))
        return max(attempts)

    def job_running(self, job_id: str) -> bool:
        """A start of this job's attempt (job_of) was reported and no end."""
        kinds = {e["type"] for e in self.data["events"].values() if e.get("job_id") == job_id}
        return "job.started" in kinds and not kinds & {"job.finished", "job.failed"}

    def job_ended(self, job_id: str) -> bool:
        return any(e.get("job_id") == job_id and e["type"] in ("job.finished", "job.failed")
                   for e in self.data["events"].values())

    # ---- incidents
    def incident(self, key: str) -> dict[str, Any] | None:
        return self.data["incidents"].get(key)

    def report(self, key: str, event: dict[str, Any], cause: str | None) -> dict[str, Any]:
        """Add a report of the incident (opening it with this event when it is the first)."""
        record = self.data["incidents"].setdefault(key, {"event_id": event["event_id"], "at": time.time(),
                                                         "actions": [], "applied": {}, "reports": []})
        entry = {"event_id": event["event_id"], "type": event["type"], "emitter": event["emitter"], "cause": cause,
                 "nodes": list(event["job"].get("nodes") or [])}
        iteration = event.get("details", {}).get("iteration")
        if isinstance(iteration, int) and not isinstance(iteration, bool):
            entry["iteration"] = iteration   # where a loss went bad: a rollback goes to a checkpoint before it
        record.setdefault("reports", []).append(entry)
        return record

    def decide(self, key: str, event: dict[str, Any], cause: str, actions: list[dict[str, Any]]) -> None:
        """The incident's cause and the actions decided for it (by this event's report)."""
        record = self.data["incidents"][key]
        record.update(cause=cause, actions=actions, decided_by=event["event_id"])

    def started(self, key: str, kind: str, what: dict[str, Any]) -> None:
        self.data["incidents"][key]["applied"][kind] = what

    def relaunched(self, key: str) -> tuple[str, dict[str, Any]] | None:
        """The relaunch started for this incident, if one was."""
        applied = (self.incident(key) or {}).get("applied", {})
        return next(((k, v) for k, v in applied.items() if k in RELAUNCHING), None)

    # ---- relaunches of the run
    def relaunch_allowed(self, now: float, limit: int, window_s: float, backoff_s: float) -> tuple[bool, str, float]:
        """Whether one more relaunch may go now: at most limit in window_s, and the n-th after
        the last waits backoff_s x 2^(n-1). (allowed, why not, when it may go)."""
        recent = [t for t in self.data["relaunches"] if now - t < window_s]
        if len(recent) >= limit:
            return False, (f"{len(recent)} relaunches of this run in the last {window_s / 3600:g} h, the limit the "
                           "policy sets"), min(recent) + window_s
        if recent:
            not_before = max(recent) + backoff_s * 2 ** (len(recent) - 1)
            if now < not_before:
                return False, f"back-off: the last relaunch was {now - max(recent):.0f} s ago", not_before
        return True, "", now

    def count_relaunch(self, now: float) -> None:
        self.data["relaunches"].append(now)

    def checkpoint(self, iteration: int, loss: Any) -> None:
        self.data["checkpoints"][str(iteration)] = {"loss": loss, "at": time.time()}
