import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
os.environ.setdefault("PYTHONWARNINGS", "ignore")


def run_cli(*args: str, stdin: str | None = None, timeout: int = 600, env: dict | None = None):
    """Run tools/launch.py as a user would; returns (exit code, parsed stdout JSON, stderr)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    try:
        out = json.loads(proc.stdout) if proc.stdout.strip() else None
    except json.JSONDecodeError:
        out = proc.stdout
    return proc.returncode, out, proc.stderr


@pytest.fixture
def cli():
    return run_cli
