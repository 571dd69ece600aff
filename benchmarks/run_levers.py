#!/usr/bin/env python3
"""Measure throughput levers one by one with the bench tool; one JSON per lever in OUTDIR.

    python benchmarks/run_levers.py OUTDIR [LEVER ...]      # levers from benchmarks/requests/levers.json
    python benchmarks/run_levers.py --set ranks.json [--memory-gib 120] OUTDIR [NAME ...]

Each lever is a bench request (a base request with overrides); the table row it prints is
tokens/s, TFLOP/s/GPU, MFU and peak allocated memory, as references/benchmarks.md lists them.
A set of single ranks under a fake process group (fake_rank: memory only) runs several at a
time on the one GPU, as many as fit in --memory-gib by the planner's per-rank peak; each
process's max_memory_allocated is its own.  Timed levers always run alone.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "requests"
MAX_JOBS = 4  # Megatron start-up (imports, torch.compile) is CPU-bound; more contend for the cores


def requests(set_file: str = "levers.json") -> dict[str, dict]:
    spec = json.loads((BENCH / set_file).read_text())["levers"]
    out = {}
    for name, lever in spec.items():
        req = json.loads((BENCH / lever["base"]).read_text())
        for key in lever.get("drop", []):
            req.pop(key, None)
        req.update(lever["set"])
        out[name] = req
    return out


def planned_peak_gib(req: dict) -> float:
    """The planner's peak per GPU for the request's layout (all stages, allowance included)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from megatron_skill.contract import Context, call, load_schema

    keys = set(load_schema("render", "request")["properties"])
    env = call("render", {k: v for k, v in req.items() if k in keys}, Context(dry_run=True, progress=lambda m: None))
    return env["result"]["prediction"]["peak_gib"] if env["ok"] else 1e9


def row(name: str, stdout: str, err_file: Path) -> str | None:
    try:
        res = json.loads(stdout)["result"]
        m = res["measured"]
    except (ValueError, KeyError, TypeError):
        return None
    if "fake_rank" in res:
        return (f"| {name} | {res['label']} rank {res['fake_rank']} (stage {res['pipeline_stage']}) | "
                f"{res['predicted']['allocated_gib']} GiB | {m['max_allocated_gib']} GiB | "
                f"{res['error_pct']['memory']} % |")
    return (f"| {name} | {res['label']} | {m['tokens_per_s']:,} | {m['tflops_per_gpu']} | {m['mfu']:.1%} | "
            f"{m['max_allocated_gib']} GiB |")


def main() -> int:
    argv = sys.argv[1:]
    set_file, budget = "levers.json", 120.0
    while argv[:1] in (["--set"], ["--memory-gib"]) and len(argv) > 1:
        if argv[0] == "--set":
            set_file = argv[1]
        else:
            budget = float(argv[1])
        argv = argv[2:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = requests(set_file)
    names = argv[1:] or list(todo)
    python = os.environ.get("PYTHON", sys.executable)
    cmd = [python, str(ROOT / "tools" / "launch.py"), "bench", "--request", "-", "--runs-root", str(out_dir / "runs")]
    fake = all(todo[n].get("fake_rank") is not None for n in names)
    need = {n: planned_peak_gib(todo[n]) if fake else budget for n in names}
    queue = sorted(names, key=lambda n: -need[n]) if fake else list(names)
    running: dict[str, tuple[subprocess.Popen, object]] = {}
    rc = 0

    def finish(name: str) -> None:
        nonlocal rc
        proc, err = running.pop(name)
        stdout = proc.stdout.read()  # type: ignore[union-attr]
        proc.wait()
        err.close()  # type: ignore[attr-defined]
        (out_dir / f"{name}.json").write_text(stdout)
        line = row(name, stdout, out_dir / f"{name}.err")
        if line is None:
            rc = 1
            line = f"| {name} | failed: exit {proc.returncode} | see {out_dir / (name + '.err')} |"
        print(line, flush=True)

    while queue or running:
        in_use = sum(need[n] for n in running)
        start = next((n for n in queue if not running or (in_use + need[n] <= budget and len(running) < MAX_JOBS)),
                     None)
        if start is not None:
            queue.remove(start)
            print(f"== {start}", file=sys.stderr, flush=True)
            err = open(out_dir / f"{start}.err", "w")
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
            proc.stdin.write(json.dumps(todo[start]))  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
            running[start] = (proc, err)
            continue
        done = [n for n, (p, _) in running.items() if p.poll() is not None]
        for n in done:
            finish(n)
        if not done:
            time.sleep(1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
