"""How long plan takes for the frontier cases and for the model and GPUs of each request in
benchmarks/requests/ (as a plan request: the fields plan reads).

    python benchmarks/plan_speed.py

Two tables: in this process (imports and the first call's catalog loading not counted), each
run three times from a cold start (no remembered search or cached cost), median kept; and as a
user runs it, `python tools/launch.py plan --request FILE` in a new interpreter each time
(start-up, imports and catalogs counted), median of three wall times.
"""
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from megatron_skill.contract import call  # noqa: E402
from megatron_skill.core import planner  # noqa: E402

CASES = [
    {"model": "llama3.1-405b", "num_gpus": 16384, "gpu": "h100-sxm", "seq_length": 8192, "global_batch_size": 2048},
    {"model": "llama3-70b", "num_gpus": 1024, "gpu": "h100-sxm", "seq_length": 8192},
    {"model": "mixtral-8x7b", "num_gpus": 64, "gpu": "h100-sxm"},
    {"model": "qwen3-30b-a3b", "num_gpus": 64, "gpu": "h100-sxm", "seq_length": 4096},
    {"model": "deepseek-v3", "num_gpus": 1024, "gpu": "h100-sxm", "seq_length": 4096},
    {"model": "deepseek-v3", "num_gpus": 2048, "gpu": "h100-sxm", "seq_length": 4096},
    {"model": "qwen3-235b-a22b", "num_gpus": 2048, "gpu": "h100-sxm", "seq_length": 4096},
    # every size a list of 1..64 (a request an agent may well write): ran for minutes before the
    # search dropped the values no layout can take once instead of in every combination
    {"model": "deepseek-v3", "num_gpus": 4096, "gpu": "h100-sxm", "precision": "any",
     "constraints": {k: list(range(1, 65)) for k in ("tp", "pp", "vp", "cp", "ep", "etp", "mbs")}},
]


PLAN_FIELDS = ("model", "hf_config", "gpu", "num_gpus", "nodes", "gpus_per_node", "seq_length", "global_batch_size",
               "precision", "transformer_engine", "moe", "megatron_options")


def request_cases() -> list[tuple[str, dict]]:
    """Each single request of benchmarks/requests/ (not the lever tables) as a plan request."""
    out = []
    for path in sorted((ROOT / "benchmarks" / "requests").glob("*.json")):
        req = json.loads(path.read_text())
        if "levers" in req:
            continue
        plan_req = {k: v for k, v in req.items() if k in PLAN_FIELDS}
        if "hf_config" in plan_req:
            plan_req["hf_config"] = str(ROOT / plan_req["hf_config"])
        plan_req.setdefault("gpu", "h100-sxm")
        out.append((path.name, plan_req))
    return out


def wall_seconds(req: dict) -> tuple[float, dict]:
    """Median of three wall times of plan in a new interpreter, and its answer."""
    times = []
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(req, f)
        f.flush()
        for _ in range(3):
            started = time.perf_counter()
            done = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), "plan", "--request", f.name],
                                  capture_output=True, text=True)
            times.append(time.perf_counter() - started)
    return statistics.median(times), json.loads(done.stdout)


def main() -> None:
    call("plan", {"model": "tiny-gpt", "num_gpus": 1, "gpu": "h100-sxm"})   # imports and catalogs, once
    print("| model | GPUs | seconds (median of 3) | layouts costed | best |\n|---|---|---|---|---|")
    for req in CASES:
        times = []
        for _ in range(3):
            planner.forget()   # every run searches and costs anew
            started = time.perf_counter()
            res = call("plan", {**req, "top": 1})["result"]
            times.append(time.perf_counter() - started)
        print(f"| {req['model']} | {req['num_gpus']:,} | {statistics.median(times):.2f} | {res['feasible']:,} | "
              f"{res['plans'][0]['label']} |")
    print("\n| request | GPUs | wall seconds with start-up (median of 3) | best |\n|---|---|---|---|")
    cases = [(f"{c['model']} (frontier)", c) for c in CASES] + request_cases()
    for name, req in cases:
        seconds, answer = wall_seconds(req)
        best = answer["result"]["plans"][0]["label"] if answer.get("ok") else "error: " + answer["error"]["message"]
        print(f"| {name} | {req.get('num_gpus', 1):,} | {seconds:.2f} | {best} |")


if __name__ == "__main__":
    main()
