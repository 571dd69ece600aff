"""A train attempt that died before it recorded its job's end: found, marked failed, and its end
reported then (references/events.md, "Kills").

train writes state.json "running" when its job starts and the result (finished, failed) when it
ends; it holds the run's lock all along. A state left at "running" with the lock free is an
attempt whose train process died (SIGKILL, the machine's OOM killer) without reporting the end:
its watchdog reports it right away, and the next train or on-event call of the run does, should
the watchdog have died too. The end is a job.failed of the attempt's job, cause killed unless
the log names another. Standard library and the skill's own modules only: emit_event.py runs it.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from .. import runs
from ..errors import ToolError
from . import emit as emitter
from . import event as ev

LAYOUT_KEYS = ("tp", "pp", "vp", "cp", "ep", "dp", "mbs", "gbs", "seq_length")


ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # schemas/event.json's run and job ids


def _id(value: Any) -> str | None:
    return value if isinstance(value, str) and ID.fullmatch(value) else None


def run_id(run_dir: Path, state: dict[str, Any]) -> str:
    return _id(state.get("run_id")) or run_dir.name


def job_id(run_dir: Path, state: dict[str, Any]) -> str:
    """The attempt's job id as train gave it to its emitters (RUN_ID.ATTEMPT); a field of another
    shape (a damaged or forged state) is not used."""
    if _id(state.get("job_id")):
        return state["job_id"]
    attempts = state.get("attempts")
    attempts = attempts if isinstance(attempts, int) and not isinstance(attempts, bool) and 0 < attempts < 10**6 else 1
    return f"{run_id(run_dir, state)}.{attempts - 1}"


def end_event(run_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The unsigned job.failed of a dead attempt: killed (its job was stopped from outside, with
    the train process that ran it), unless the log's end names a known failure."""
    log = run_dir / "logs" / "train.log"
    details = emitter.ending(1, log if log.exists() else None)
    details.pop("exit_code", None)  # not known: the job was stopped, its status never collected
    details.setdefault("failure", "killed")
    details["message"] = ("train stopped before it recorded the job's end (it was killed, or its machine "
                          "was); the job was stopped with it")
    given = state.get("layout") if isinstance(state.get("layout"), dict) else {}
    layout = {k: v for k, v in given.items() if k in LAYOUT_KEYS and isinstance(v, int) and not isinstance(v, bool)
              and 0 < v < 2**40}
    run = run_id(run_dir, state)
    return ev.new("job.failed", run, {"job_id": job_id(run_dir, state), "scheduler": "local",
                                      "host": os.uname().nodename[:255]}, "train", details=details,
                  request_id=run, run_dir=str(run_dir), log=str(log), layout=layout or None)


def elsewhere(run_dir: Path) -> str | None:
    """The host of the train that last took the run's lock, where that is not this host (its
    record in run.lock: train leaves it there when it dies, and empties it when it ends). A lock
    is the kernel's of one host where the file system does not share flock between hosts: that no
    process holds it here says nothing of a train there, which may be alive."""
    host = runs.RunLock(run_dir).owner().get("host")
    return host[:255] if isinstance(host, str) and host and host != socket.gethostname() else None


def dead_attempt(run_dir: Path, locked: bool = False) -> dict[str, Any] | None:
    """When the run's last attempt died without recording its end: mark it failed in state.json
    and answer the end event to send (None otherwise, while the run's lock is held by a live
    process, and when its train ran on another host: elsewhere). locked: the caller holds the
    run's lock itself (train, as it starts again: its run, wherever its last attempt ran)."""
    run_dir = Path(run_dir)
    if not (run_dir / runs.STATE).is_file():
        return None
    lock = runs.RunLock(run_dir)
    if not locked:
        if elsewhere(run_dir):
            return None
        try:
            lock.acquire()
        except (ToolError, OSError):   # held by a live train: its attempt is not dead
            return None
    try:
        state = runs.read_state(run_dir)
        if not state or state.get("status") != "running":
            return None
        request = state.get("request") if isinstance(state.get("request"), dict) else {}
        if request.get("launcher") == "slurm" and state.get("backend") == "gpu":
            return None  # a Slurm job outlives the train that submitted it: its trap and trigger report its end
        event = end_event(run_dir, state)
        runs.write_state(run_dir, status="failed", returncode=None, died=event["details"]["message"])
        return event
    finally:
        if not locked:
            lock.release()


def report(run_dir: Path, locked: bool = False, wait: bool = False) -> dict[str, Any] | None:
    """Settle a dead attempt of the run (dead_attempt) and send its end: here (wait), or from a
    process of its own (emit_event.py settle --event), so that the caller never waits for the
    receiver. The event made, or None."""
    event = dead_attempt(run_dir, locked)
    if event is None:
        return None
    if wait:
        emitter.emit(event, Path(run_dir))
        return event
    argv = [sys.executable, str(emitter.EMITTER), "settle", "--run-dir", str(run_dir), "--event", json.dumps(event)]
    with open(os.devnull, "wb") as null:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=null, stderr=null, start_new_session=True)
    return event
