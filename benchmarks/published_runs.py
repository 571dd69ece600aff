"""The planner against published multi-GPU runs (core/catalog/published_runs.json): each run's
exact layout costed by the planner (Transformer Engine's layers, the run's precision), beside
what its publisher measured: the error in tokens/s per GPU (TFLOP/s per GPU where only that is
published). plan's forecasts carry the error band of these rows (core/evidence.py).

    python benchmarks/published_runs.py          # prints the table and the summary
    python benchmarks/published_runs.py --fit    # re-fits the five fitted constants of calibration.json

The fit, in two steps: gemm_te_fraction (the share of the measured GEMM rate TE's GEMMs reach in
these multi-GPU runs) on the dense H100 runs whose whole layout is published; then
ep_overlap_exposed, moe_us_per_token_expert, moe_dropless_us_per_token and
moe_dropless_us_per_token_expert on a grid, against the H100 MoE runs only (no dense row depends
on them; dropless and token-drop alike), keeping the four with the smallest sum of squared errors;
last moe_overhead_hbm_share (the share of that overhead that scales with a GPU's memory rate) on
the Blackwell MoE runs, by the smallest sum of absolute errors (one of the five, Qwen3-30B-A3B at
micro-batch 4 on GB200s, is off by half whatever the share: squared, it alone would set it).
Each run is also predicted by the constants fitted without it (leave one out); the Blackwell
dense rows stay out of the fit (they check how far it carries to another GPU), as the rows marked
held_out (read after the fit) check how far it carries to runs it has not seen.
"""
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from megatron_skill.core import evidence, timing  # noqa: E402

DENSE_GRID = [round(0.70 + 0.01 * i, 2) for i in range(31)]   # 0.70 .. 1.00
GRID = {"moe_dropless_us_per_token": (0.0, 0.04, 0.08, 0.1, 0.12, 0.14, 0.16, 0.2, 0.3),
        "moe_dropless_us_per_token_expert": (0.0, 0.05, 0.1, 0.12, 0.14, 0.15, 0.16, 0.18, 0.2, 0.25),
        "ep_overlap_exposed": (0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0),
        "moe_us_per_token_expert": (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06)}
HBM_SHARE_GRID = [round(0.05 * i, 2) for i in range(21)]   # 0 .. 1


def summary(rows) -> dict:
    out = {}
    incomplete = [r for r in rows if not r.get("layout_complete", True)]
    rows = [r for r in rows if r.get("layout_complete", True)]   # the goal counts runs whose whole layout is known
    arch = {r["gpu"]: evidence.get_gpu(r["gpu"]).arch for r in rows}
    hopper = [r for r in rows if arch[r["gpu"]] == "hopper"]
    for name, kind in (("all", rows), ("dense", [r for r in rows if not r["moe"]]),
                       ("moe", [r for r in rows if r["moe"]]), ("hopper", hopper),
                       ("hopper_dense", [r for r in hopper if not r["moe"]]),
                       ("hopper_moe", [r for r in hopper if r["moe"]]),
                       ("ampere", [r for r in rows if arch[r["gpu"]] == "ampere"]),
                       ("blackwell", [r for r in rows if arch[r["gpu"]] == "blackwell"])):
        errors = [abs(r["error_pct"]) for r in kind]
        out[name] = {"runs": len(kind), "median_abs_error_pct": round(statistics.median(errors), 1),
                     "max_abs_error_pct": round(max(errors), 1)}
    held = [abs(r["error_pct"]) for r in rows if r.get("held_out")]
    if held:   # the runs no constant was fitted to
        out["held_out"] = {"runs": len(held), "median_abs_error_pct": round(statistics.median(held), 1),
                           "max_abs_error_pct": round(max(held), 1)}
    out["layout_incomplete"] = {"runs": len(incomplete), "errors_pct": [round(r["error_pct"], 1) for r in incomplete]}
    # rows off the goal for a path of their software the planner does not cost yet (each says which)
    misses = [r for r in rows if r.get("known_miss")]
    out["known_misses"] = {"runs": len(misses), "errors_pct": [round(r["error_pct"], 1) for r in misses],
                           "refused_for_memory": sum(not r["fits"] for r in misses)}
    # a published layout ran: the memory model refusing one is a defect of the model (or of the
    # options the row records)
    out["refused_for_memory"] = sum(not r["fits"] for r in rows)
    # does the band a forecast carries hold the published figure of a run it was not built from?
    inside = 0
    for r in rows:
        others = [o["error_pct"] for o in evidence.band_runs(r["moe"], evidence.get_gpu(r["gpu"]).arch, r)[0]]
        lo, hi = evidence.band(others) if others else (0.0, 0.0)
        inside += lo <= r["error_pct"] <= hi
    out["band_holds_leave_one_out"] = {"runs": len(rows), "inside": inside}
    return out


def _fitted_on() -> list[dict]:
    """The rows the constants are fitted to: all but those marked held_out (read after the fit and
    kept out of it, so that they check it as runs it has never seen)."""
    return [r for r in evidence.published_runs() if not r.get("held_out")]


def _sse(errors, skip=None) -> float:
    return sum(e * e for i, e in enumerate(errors) if i != skip)


def fit_dense(cal: dict) -> dict:
    """gemm_te_fraction over the dense H100 runs (no MoE constant touches them), and each of them
    predicted by the fraction fitted without it."""
    runs = [r for r in _fitted_on() if r.get("moe") is None and r["gpu"] == "h100-sxm" and r.get("layout_complete", True)]
    table = []
    for value in DENSE_GRID:
        cal["gemm_te_fraction"] = value
        timing.clear_caches_keep_calibration()
        table.append((value, [evidence.compare(r)["error_pct"] for r in runs]))
    value, errors = min(table, key=lambda t: _sse(t[1]))
    held_out = {f"{r['model']} {r['source']}": round(min(table, key=lambda t: _sse(t[1], i))[1][i], 1)
                for i, r in enumerate(runs)}
    cal["gemm_te_fraction"] = value
    timing.clear_caches_keep_calibration()
    return {"gemm_te_fraction": value, "errors_pct": [round(e, 1) for e in errors],
            "leave_one_out_errors_pct": held_out}


def fit_hbm_share(cal: dict) -> dict:
    """moe_overhead_hbm_share over the Blackwell MoE runs (the H100's constants fitted before it,
    which it leaves unchanged on the H100), and each of them predicted by the share fitted without it."""
    runs = [r for r in _fitted_on() if r.get("moe") is not None and evidence.get_gpu(r["gpu"]).arch == "blackwell"]
    blackwell = {r["gpu"] for r in runs}
    cals = [cal] + [timing.calibration(g) for g in sorted(blackwell)]
    for c in cals[1:]:   # the H100's fitted values, not the catalog's
        c.update({k: cal[k] for k in ("gemm_te_fraction", *GRID)})
    table = []
    for value in HBM_SHARE_GRID:
        for c in cals:
            c["moe_overhead_hbm_share"] = value
        timing.clear_caches_keep_calibration()
        table.append((value, [evidence.compare(r)["error_pct"] for r in runs]))

    def best(skip: int | None = None):
        return min(table, key=lambda t: sum(abs(e) for i, e in enumerate(t[1]) if i != skip))

    value, errors = best()
    held_out = {f"{r['model']} {r['gpu']} {r['source']}": round(best(skip=i)[1][i], 1) for i, r in enumerate(runs)}
    return {"moe_overhead_hbm_share": value, "errors_pct": [round(e, 1) for e in errors],
            "leave_one_out_errors_pct": held_out}


def fit() -> dict:
    """First the dense share of the GEMM rate (fit_dense), then the grid's best values over the
    MoE runs with it, and each MoE run predicted by the values fitted without it (leave one
    out: how far the fit carries to a run it has not seen)."""
    # the H100's runs: the calibration they are costed with is the one the fit changes (the
    # Blackwell rows stay out of the fit: they check how far it carries to another GPU)
    cal = timing.calibration("h100-sxm")
    dense = fit_dense(cal)
    runs = [r for r in _fitted_on() if r.get("moe") is not None and r["gpu"] == "h100-sxm"]
    table = []   # (values, errors of every run)
    for values in itertools.product(*GRID.values()):
        cal.update(zip(GRID, values))
        timing.clear_caches_keep_calibration()
        table.append((dict(zip(GRID, values)), [evidence.compare(r)["error_pct"] for r in runs]))

    def best(skip: int | None = None):
        return min(table, key=lambda t: sum(e * e for i, e in enumerate(t[1]) if i != skip))

    values, errors = best()
    held_out = {f"{r['model']} {r['source']}": round(best(skip=i)[1][i], 1) for i, r in enumerate(runs)}
    cal.update(values)
    blackwell = fit_hbm_share(cal)
    return {"best": {"gemm_te_fraction": dense["gemm_te_fraction"], **values,
                     "moe_overhead_hbm_share": blackwell["moe_overhead_hbm_share"]}, "dense": dense, "blackwell_moe": blackwell,
            "max_abs_error_pct": round(max(map(abs, errors)), 1),
            "errors_pct": [round(e, 1) for e in errors], "runs": [f"{r['model']} {r['source']}" for r in runs],
            "leave_one_out_errors_pct": held_out}


def main() -> None:
    if "--fit" in sys.argv:
        print(json.dumps(fit(), indent=1))
        return
    rows = evidence.checked()
    print("| model | GPUs | precision | layout | published | predicted | error | peak GiB predicted | source |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        layout = r["layout"].replace("|", "\\|")   # a layout string's chunks, not table cells
        if not r.get("layout_complete", True):
            layout += " (layout incomplete)"
        print(f"| {r['model']} | {r['num_gpus']:,} {r['gpu']} | {r['precision']} | {layout} | "
              f"{r['published']:,} {r['metric']} | {r['predicted']:,.0f} | {r['error_pct']:+.1f} % | "
              f"{r['peak_gib']:.1f}{'' if r['fits'] else ' (more than the GPU)'} | {r['source']} |")
    print()
    print(json.dumps(summary(rows)))


if __name__ == "__main__":
    main()
