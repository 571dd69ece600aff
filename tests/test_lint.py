"""The code passes the linter CI runs (ruff, configured in pyproject.toml): unused imports and
names, shadowed loop variables, exceptions re-raised without their cause, import order."""
import subprocess
import sys

from conftest import ROOT


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "tools", "tests", "benchmarks", "dev"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
