"""Stopping a train job: every process of it, wherever it runs.

A job train starts runs in a process group of its own, but not all of it stays there: torchrun
starts each worker in a session of its own, so a kill of torchrun's group (or of torchrun
alone) leaves the workers training, and they would finish the run while train reports a kill.
So the job's environment carries a mark (MEGATRON_SKILL_JOB_MARK, a random token) that every
process it starts inherits, and stopping the job signals its group and every process whose
environment holds the mark.

Run as a program, this is train's watchdog: a small process of its own that waits for train's
pipe to close. When train dies (even by SIGKILL) the pipe closes without train saying that the
job ended; the watchdog stops the job and reports its end (emit_event.py settle). Standard
library only, and no import of the package: it runs as a bare script.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MARK_ENV = "MEGATRON_SKILL_JOB_MARK"
EMITTER = Path(__file__).resolve().parents[1] / "emit_event.py"


def marked(mark: str) -> list[int]:
    """The live processes (of this user) whose environment holds the job's mark."""
    needle = f"{MARK_ENV}={mark}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or another user's
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _signal(group: int | None, mark: str, sig: int) -> bool:
    """Send sig to the group and the marked processes; whether any was there to get it."""
    sent = False
    if group:
        try:
            os.killpg(group, sig)
            sent = True
        except (ProcessLookupError, PermissionError):
            pass
    for pid in marked(mark):
        try:
            os.kill(pid, sig)
            sent = True
        except (ProcessLookupError, PermissionError):
            pass
    return sent


def stop(group: int | None, mark: str, grace_s: float = 20.0) -> bool:
    """Stop the job: SIGTERM to its process group and its marked processes (torchrun passes it
    on to its workers and waits for them), SIGKILL to whatever is left after grace_s. Whether
    anything was left to stop."""
    found = False
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not _signal(group, mark, sig):
            return found
        found = True
        end = time.monotonic() + wait
        while time.monotonic() < end and _signal(group, mark, 0):
            time.sleep(0.2)
    return found


def main(argv: list[str]) -> int:
    group, mark, run_dir = int(argv[0]), argv[1], argv[2] if len(argv) > 2 else ""
    told = sys.stdin.buffer.read()  # train writes a byte when the job is over; nothing if it died
    stop(group, mark)
    if not told and run_dir:
        subprocess.run([sys.executable, str(EMITTER), "settle", "--run-dir", run_dir], stdin=subprocess.DEVNULL,
                       timeout=300, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
