"""Run directories: one per request id, with a state file and a lock, so that the same
job is never started twice and a killed one can be resumed from its checkpoints."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from .errors import ToolError

STATE = "state.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def read_state(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / STATE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_state(run_dir: Path, **fields: Any) -> dict[str, Any]:
    state = {**(read_state(run_dir) or {}), **fields, "updated": time.time()}
    tmp = run_dir / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(run_dir / STATE)
    return state


def latest_checkpoint(ckpt_dir: Path) -> int | None:
    try:
        return int((ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


class RunLock:
    """An exclusive lock file holding the pid and host of the process that runs the job."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "run.lock"

    def acquire(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                owner = self.owner()
                same_host = owner.get("host") == socket.gethostname()
                if owner and same_host and not _alive(owner.get("pid", -1)):
                    self.path.unlink(missing_ok=True)  # its process is gone: a stale lock
                    continue
                raise ToolError("conflict", f"this job is already running (pid {owner.get('pid')} on "
                                f"{owner.get('host')})", where=str(self.path),
                                fix="wait for it, or stop it; 'launch.py logs' reads its progress")
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}, f)
            return
        raise ToolError("conflict", "could not take the run lock", where=str(self.path), fix="try again")

    def owner(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
