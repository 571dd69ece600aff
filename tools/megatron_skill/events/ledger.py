"""The record of handled events, one per run: which event ids were seen, which incidents were
acted on, when the run was relaunched. It lives in RUNS_ROOT/.events/RUN_ID/ledger.json,
rewritten whole and atomically under the folder's lock, so a crash leaves the old record or
the new one, and two handlers of the same run take turns.

An incident is recorded before its action is carried out (write-ahead): a handler that dies
in between leaves the incident claimed and the action not confirmed, so a retried event
answers 'duplicate' and nothing is launched twice. At most once is the right side to err on
for relaunches; the record says which actions were confirmed.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..errors import ToolError
from ..locks import Busy, FileLock, write_atomic

KEEP_EVENTS = 2000  # event ids remembered per run; older ones go (a replay that old is stale anyway)
LOCK_WAIT_S = 30.0


def folder(runs_root: Path, run_id: str) -> Path:
    return runs_root / ".events" / run_id


class Ledger:
    def __init__(self, runs_root: Path, run_id: str):
        self.dir = folder(runs_root, run_id)
        self.path = self.dir / "ledger.json"
        self.data: dict[str, Any] = {"events": {}, "incidents": {}, "relaunches": [], "checkpoints": {}}
        self._lock: FileLock | None = None

    def read(self) -> "Ledger":
        try:
            stored = json.loads(self.path.read_text())
        except FileNotFoundError:
            return self
        except (OSError, ValueError) as e:
            raise ToolError("runtime", f"the event record {self.path} cannot be read: {e}", where=str(self.path),
                            fix="move the damaged file aside (events already handled may then act again)") from None
        self.data.update(stored)
        return self

    def __enter__(self) -> "Ledger":
        self.dir.mkdir(parents=True, exist_ok=True)
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
        return self.read()

    def __exit__(self, *exc: object) -> None:
        if self._lock:
            self._lock.release()

    def save(self) -> None:
        events = self.data["events"]
        if len(events) > KEEP_EVENTS:
            for key in sorted(events, key=lambda k: events[k]["seen"])[:len(events) - KEEP_EVENTS]:
                del events[key]
        write_atomic(self.path, json.dumps(self.data, indent=1, sort_keys=True))

    # ---- what is asked of it
    def seen(self, event_id: str) -> dict[str, Any] | None:
        return self.data["events"].get(event_id)

    def claimed(self, incident: str) -> dict[str, Any] | None:
        return self.data["incidents"].get(incident)

    def note(self, event: dict[str, Any], verdict: str, incident: str | None) -> None:
        self.data["events"][event["event_id"]] = {"type": event["type"], "time": event["time"], "seen": time.time(),
                                                  "verdict": verdict, "incident": incident,
                                                  "job_id": event["job"]["job_id"]}

    def claim(self, incident: str, event: dict[str, Any], actions: list[str]) -> None:
        self.data["incidents"][incident] = {"event_id": event["event_id"], "at": time.time(), "actions": actions,
                                            "applied": {}}

    def applied(self, incident: str, kind: str, what: dict[str, Any]) -> None:
        self.data["incidents"][incident]["applied"][kind] = what

    def job_running(self, job_id: str) -> bool:
        """A start of this job was reported and no end."""
        kinds = {e["type"] for e in self.data["events"].values() if e.get("job_id") == job_id}
        return "job.started" in kinds and not kinds & {"job.finished", "job.failed"}

    def relaunch_allowed(self, now: float, limit: int, window_s: float, backoff_s: float) -> tuple[bool, str, float]:
        """Whether one more relaunch may go now: at most limit in window_s, and the n-th after
        the last waits backoff_s x 2^(n-1). (allowed, why not, when it may go)."""
        recent = [t for t in self.data["relaunches"] if now - t < window_s]
        if len(recent) >= limit:
            return False, (f"{len(recent)} relaunches of this run in the last {window_s / 3600:g} h, the limit the "
                           "policy sets: a person decides now"), min(recent) + window_s
        if recent:
            not_before = max(recent) + backoff_s * 2 ** (len(recent) - 1)
            if now < not_before:
                return False, f"back-off: the last relaunch was {now - max(recent):.0f} s ago", not_before
        return True, "", now

    def count_relaunch(self, now: float) -> None:
        self.data["relaunches"].append(now)

    def checkpoint(self, iteration: int, loss: Any) -> None:
        self.data["checkpoints"][str(iteration)] = {"loss": loss, "at": time.time()}
