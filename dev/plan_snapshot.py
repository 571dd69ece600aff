"""The plans of every catalog model on a few clusters, to compare the planner before and after a
change of its search (not of its costs):

    python dev/plan_snapshot.py OUT.json            # at each of two commits
    python dev/plan_snapshot.py --compare A.json B.json

Each request asks for the 100 plans a request may show; an infeasible one keeps its error's fix
(the nearest GPU counts and batches that fit)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

CLUSTERS = ((8, "h100-sxm"), (64, "h100-sxm"), (512, "b200"), (16, "a100-80gb"))


def snapshot(out: str) -> None:
    from megatron_skill.contract import call
    from megatron_skill.core.catalog import _load

    plans = {}
    for model in _load("models.json")["models"]:
        for n, gpu in CLUSTERS:
            for precision in ("bf16", "any"):
                answer = call("plan", {"model": model, "num_gpus": n, "gpu": gpu, "top": 100, "precision": precision})
                plans[f"{model}/{n}/{gpu}/{precision}"] = (
                    [(p["label"], round(p["tokens_per_s"])) for p in answer["result"]["plans"]] if answer["ok"]
                    else answer["error"]["code"] + ": " + answer["error"].get("fix", ""))
    Path(out).write_text(json.dumps(plans, indent=0))


def compare(a_path: str, b_path: str) -> None:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    feasible = [k for k in a if isinstance(a[k], list)]
    print(f"{len(a)} requests, {len(feasible)} feasible in A; same best plan: "
          f"{sum(bool(b.get(k)) and a[k][0] == b[k][0] for k in feasible)}; same 100 places: "
          f"{sum(a[k] == b.get(k) for k in feasible)}; infeasible answers the same: "
          f"{sum(a[k] == b.get(k) for k in a if k not in feasible)} of {len(a) - len(feasible)}")
    for k in feasible:
        if a[k] != b.get(k) and isinstance(b.get(k), list):
            first = next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), min(len(a[k]), len(b[k])))
            print(f"  {k}: from place {first + 1}: A {a[k][first] if first < len(a[k]) else '-'}, "
                  f"B {b[k][first] if first < len(b[k]) else '-'}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        compare(*sys.argv[2:4])
    else:
        snapshot(sys.argv[1])
