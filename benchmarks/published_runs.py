"""The planner against published multi-GPU runs (core/catalog/published_runs.json): each run's
exact layout costed by the planner (Transformer Engine's layers, the run's precision), beside
what its publisher measured: the error in tokens/s per GPU (TFLOP/s per GPU where only that is
published). plan's forecasts carry the error band of these rows (core/evidence.py).

    python benchmarks/published_runs.py          # prints the table and the summary
"""
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from megatron_skill.core import evidence  # noqa: E402


def summary(rows) -> dict:
    out = {}
    for name, kind in (("all", rows), ("dense", [r for r in rows if not r["moe"]]),
                       ("moe", [r for r in rows if r["moe"]])):
        errors = [abs(r["error_pct"]) for r in kind]
        out[name] = {"runs": len(kind), "median_abs_error_pct": round(statistics.median(errors), 1),
                     "max_abs_error_pct": round(max(errors), 1)}
    return out


def main() -> None:
    rows = evidence.checked()
    print("| model | GPUs | precision | layout | published | predicted | error | source |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['num_gpus']:,} {r['gpu']} | {r['precision']} | {r['layout']} | "
              f"{r['published']:,} {r['metric']} | {r['predicted']:,.0f} | {r['error_pct']:+.1f} % | {r['source']} |")
    print()
    print(json.dumps(summary(rows)))


if __name__ == "__main__":
    main()
