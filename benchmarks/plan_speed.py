"""How long plan takes for the frontier cases, in this process (imports and the first call's
catalog loading not counted), each run three times from a cold start (no remembered search or
cached cost) and the median kept.

    python benchmarks/plan_speed.py
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

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
]


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


if __name__ == "__main__":
    main()
