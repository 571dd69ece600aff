#!/usr/bin/env python3
"""Measure throughput levers one by one with the bench tool; one JSON per lever in OUTDIR.

    python tools/run_levers.py OUTDIR [LEVER ...]      # levers from tools/benchmarks/levers.json

Each lever is a bench request (a base request with overrides); the table row it prints is
tokens/s, TFLOP/s/GPU, MFU and peak allocated memory, as references/benchmarks.md lists them.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "tools" / "benchmarks"


def requests() -> dict[str, dict]:
    spec = json.loads((BENCH / "levers.json").read_text())["levers"]
    out = {}
    for name, lever in spec.items():
        req = json.loads((BENCH / lever["base"]).read_text())
        req.update(lever["set"])
        out[name] = req
    return out


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = requests()
    names = sys.argv[2:] or list(todo)
    python = os.environ.get("PYTHON", sys.executable)
    rc = 0
    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        proc = subprocess.run([python, str(ROOT / "tools" / "launch.py"), "bench", "--request", "-",
                               "--runs-root", str(out_dir / "runs")], input=json.dumps(todo[name]),
                              capture_output=True, text=True, cwd=ROOT)
        (out_dir / f"{name}.json").write_text(proc.stdout)
        (out_dir / f"{name}.err").write_text(proc.stderr[-20000:])
        try:
            res = json.loads(proc.stdout)["result"]
            m = res["measured"]
            print(f"| {name} | {res['label']} | {m['tokens_per_s']:,} | {m['tflops_per_gpu']} | {m['mfu']:.1%} | "
                  f"{m['max_allocated_gib']} GiB |", flush=True)
        except (ValueError, KeyError, TypeError):
            rc = 1
            print(f"| {name} | failed: exit {proc.returncode} | see {out_dir / (name + '.err')} |", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
