"""Run directories: one per request id, with a state file and a lock, so that the same
job is never started twice and a killed one can be resumed from its checkpoints."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from . import files
from .errors import ToolError
from .locks import Busy, FileLock, not_a_lock, write_atomic

STATE = "state.json"


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """The run's state, or None where there is none (or what is there is not one of ours)."""
    return files.read_record(run_dir / STATE)


def write_state(run_dir: Path, **fields: Any) -> dict[str, Any]:
    state = {**(read_state(run_dir) or {}), **fields, "updated": time.time()}
    write_atomic(run_dir / STATE, json.dumps(state, indent=1))
    return state


def latest_checkpoint(ckpt_dir: Path) -> int | None:
    """The iteration of the run's last checkpoint; None without one (or with a tracker that is not
    Megatron's, or says release: a run's own checkpoints have iterations)."""
    it = files.read_tracker(ckpt_dir)
    return it if isinstance(it, int) else None


class RunLock(FileLock):
    """The run directory's lock, held by the process that runs the job (its pid and host
    recorded in run.lock); the kernel frees it when that process dies."""

    def __init__(self, run_dir: Path):
        super().__init__(run_dir / "run.lock", record_owner=True)

    def acquire(self) -> "RunLock":
        try:
            super().acquire()
        except Busy as busy:
            raise self.running(busy.owner) from None
        except OSError:
            raise not_a_lock(self.path, str(self.path)) from None
        return self

    def running(self, owner: dict[str, Any] | None = None) -> ToolError:
        """The conflict answered while another process runs this request."""
        owner = self.owner() if owner is None else owner
        return ToolError("conflict", f"this job is already running (pid {owner.get('pid')} on {owner.get('host')})",
                         where=str(self.path), fix="wait for it, or stop it; 'launch.py logs' reads its progress")
