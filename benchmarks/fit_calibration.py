#!/usr/bin/env python3
"""A GPU's calibration entry from what benchmarks/calibrate_card.sh measured on it, with the
leave-one-out check of every fitted figure.

    python benchmarks/fit_calibration.py RESULTS_DIR [RESULTS_DIR ...] [--store]

Each RESULTS_DIR (one lease of one GPU type) holds calibrate.json (bench --calibrate) and
levers/*.json (bench results with a kernel profile of one iteration). Several leases are pooled:
a single lease's three fitted figures trade off against each other (two H100 leases of the same
requests gave element-wise 1.78 vs 1.51 for the same fit), their pool is steadier. What comes
from where:
- gemm_bf16, gemm_fp8, hbm, attention_tflops: the kernel rates bench --calibrate measured (the
  median over leases);
- gemm_local_bf16, gemm_local_fp8: the profile's GEMM kernel time against the model's GEMMs at
  the measured square-GEMM rate (median over runs of each precision; an FP8 run's output layer
  stays BF16 and is charged at the BF16 share);
- elementwise_local_factor: the profile's element-wise, copy and norm kernel time of the BF16
  runs, less the loss and gradient-accumulation kernels the model charges apart, over the
  model's fused byte count at the calibrated HBM rate (median over runs);
- fp8_cast_factor: the same of the FP8 runs, less their BF16 element-wise share, over the
  model's FP8 cast bytes (median);
- layer_overhead_local_ms: wall time of an iteration beyond its kernel time (the GPU idle while the
  host launches), per layer and micro-batch, less the per-micro-batch share the catalog keeps
  (median): the local layers launch a few dozen kernels a layer.
Each run is then predicted twice: with every run in the fit (in-sample) and with the figures
fitted without any run of its request and precision, in any lease (leave-one-shape-out: the
error to quote; leaving out one run only would keep its twin from the other lease in the fit). --store writes the entry into
catalog/calibration.json for the GPU the results name, with its sources.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from megatron_skill.core import timing  # noqa: E402
from megatron_skill.core.catalog import CATALOG_DIR, get_gpu  # noqa: E402
from megatron_skill.core.flops import padded_vocab_size  # noqa: E402
from megatron_skill.core.layout import Layout  # noqa: E402
from megatron_skill.core.options import RuntimeOptions  # noqa: E402
from megatron_skill.core.planner import error_pct, predict  # noqa: E402
from megatron_skill.core.resolve import resolve_model  # noqa: E402

REQUESTS = ROOT / "benchmarks" / "requests"
SHAPES = {"llama-1b-shape": "llama-1b-shape-bf16.json", "llama-3b-shape": "llama-3b-shape-bf16.json",
          "Qwen2ForCausalLM": "qwen2.5-1.5b-shape-bf16.json"}  # an hf_config model is named by its class
FITTED = ("gemm_local_bf16", "gemm_local_fp8", "elementwise_local_factor", "fp8_cast_factor", "layer_overhead_local_ms")
# Before the fused head's rule became memory-based (core.memory.fused_head_runs), it took only
# micro-batches of more than two 4096-token chunks; results without "output_head" ran that rule.
OLD_FUSED_HEAD_MIN_TOKENS = 2 * 4096


def load_runs(results: Path) -> list[dict]:
    runs = []
    for path in sorted((results / "levers").glob("*.json")):
        try:
            res = json.loads(path.read_text())["result"]
        except (ValueError, KeyError):
            continue   # a run that failed answered no result
        name = res["model"]["name"]
        req = json.loads((REQUESTS / SHAPES[name]).read_text())
        model = resolve_model({k: v for k, v in req.items() if k in ("model", "hf_config")})
        lay = Layout.from_json(res["layout"])
        runtime = dict(res["runtime"])
        if "output_head" not in res and lay.mbs * lay.seq_length <= OLD_FUSED_HEAD_MIN_TOKENS:
            runtime["linear_cross_entropy"] = False     # Megatron's output layer and loss ran
        elif res.get("output_head") == "megatron":
            runtime["linear_cross_entropy"] = False
        runs.append({"name": path.stem, "model": model, "lay": lay, "gpu": get_gpu(res["gpu"]),
                     "opts": RuntimeOptions.from_request(runtime, te=False),
                     "iter_ms": res["measured"]["iter_ms"], "tokens_per_s": res["measured"]["tokens_per_s"],
                     "profile": res.get("profile"), "fp8": lay.precision == "fp8"})
    return runs


def _predict(run: dict, cal: dict, **override):
    """The prediction of a run under the calibration `cal` with `override` on top."""
    live = timing.calibration(run["gpu"].key)
    saved = dict(live)
    live.update(cal, **override)
    timing.clear_caches_keep_calibration()
    try:
        lay = run["lay"]
        return predict(run["model"], run["gpu"], lay, padded_vocab_size(run["model"].vocab_size, lay.tp), run["opts"])
    finally:
        live.clear()
        live.update(saved)
        timing.clear_caches_keep_calibration()


def _other_kernels_ms(run: dict) -> float:
    fam = run["profile"]["by_family"]
    return sum(fam.get(k, {}).get("ms", 0.0) for k in ("copy_cast", "elementwise_other", "norm"))


def fit(runs: list[dict], base: dict) -> dict:
    """The fitted figures from these runs (each needs a profile), on top of the kernel rates."""
    out = {}
    bf16 = [r for r in runs if not r["fp8"]]
    # BF16 runs: every GEMM scales as 1 / share
    out["gemm_local_bf16"] = round(statistics.median(
        _predict(r, base, gemm_local_bf16=1.0).time.gemm / (r["profile"]["by_family"]["gemm"]["ms"] / 1e3)
        for r in bf16), 3)
    shares = []
    for r in (r for r in runs if r["fp8"]):
        # FP8 runs: the layers' GEMMs scale as 1 / share, the BF16 output layer does not:
        # time(share) = a / share + b, two predictions give a and b
        at1 = _predict(r, base, gemm_local_bf16=out["gemm_local_bf16"], gemm_local_fp8=1.0).time.gemm
        at2 = _predict(r, base, gemm_local_bf16=out["gemm_local_bf16"], gemm_local_fp8=2.0).time.gemm
        a, b = 2 * (at1 - at2), 2 * at2 - at1
        shares.append(a / (r["profile"]["by_family"]["gemm"]["ms"] / 1e3 - b))
    if shares:
        out["gemm_local_fp8"] = round(statistics.median(shares), 3)
    base = {**base, **out}
    factors = []
    for r in (r for r in runs if not r["fp8"]):
        unit = _predict(r, base, elementwise_local_factor=1.0, fp8_cast_factor=0.0).time
        factors.append((_other_kernels_ms(r) / 1e3 - unit.loss - unit.grad_accum) / unit.elementwise)
    out["elementwise_local_factor"] = round(statistics.median(factors), 2)
    casts = []
    for r in (r for r in runs if r["fp8"]):
        unit = _predict(r, base, elementwise_local_factor=out["elementwise_local_factor"], fp8_cast_factor=0.0).time
        cast = _predict(r, base, elementwise_local_factor=0.0, fp8_cast_factor=1.0).time.elementwise
        casts.append((_other_kernels_ms(r) / 1e3 - unit.loss - unit.grad_accum - unit.elementwise) / cast)
    if casts:
        out["fp8_cast_factor"] = round(statistics.median(casts), 2)
    per_layer = []
    for r in runs:
        gap_ms = r["iter_ms"] - r["profile"]["gpu_ms"]
        per_mb = gap_ms / r["lay"].num_microbatches - base["host_overhead_ms_per_microbatch"]
        per_layer.append(per_mb / r["model"].num_layers)
    out["layer_overhead_local_ms"] = round(max(statistics.median(per_layer), 0.0), 3)
    return out


def pooled_rates(calibs: list[dict]) -> dict:
    """The kernel rates of several leases: the median of each (of each attention shape)."""
    entries = [c["catalog_entry"] for c in calibs]
    out = {}
    for key in entries[0]:
        if isinstance(entries[0][key], dict):
            shapes = {s for e in entries for s in e.get(key, {})}
            out[key] = {s: round(statistics.median(e[key][s] for e in entries if s in e.get(key, {})), 1)
                        for s in sorted(shapes)}
        else:
            out[key] = round(statistics.median(e[key] for e in entries if key in e), 2)
    return out


def main() -> int:
    dirs = [Path(a) for a in sys.argv[1:] if not a.startswith("--")]
    if not dirs:
        print(__doc__, file=sys.stderr)
        return 2
    calibs = [json.loads((d / "calibrate.json").read_text())["result"] for d in dirs]
    runs = [dict(r, lease=d.name) for d in dirs for r in load_runs(d) if r["profile"]]
    gpus = {r["gpu"].key for r in runs}
    if len(gpus) != 1:
        print(f"the results name {len(gpus)} GPU types ({', '.join(sorted(gpus))}): fit one at a time", file=sys.stderr)
        return 2
    gpu = gpus.pop()
    defaults = json.loads((CATALOG_DIR / "calibration.json").read_text())["default"]
    rates = pooled_rates(calibs)
    base = {**defaults, **rates}
    fitted = fit(runs, base)
    entry = {**rates, **fitted}
    print(f"## {gpu}: {json.dumps(entry)}\n")
    print("| lease | run | layout | measured tokens/s | predicted (in-sample) | error | "
          "predicted (leave-one-shape-out) | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        pin = _predict(r, {**base, **fitted}).tokens_per_s
        others = [o for o in runs if o["name"] != r["name"]]
        if any(o["fp8"] == r["fp8"] for o in others) and any(not o["fp8"] for o in others):
            ploo = _predict(r, {**base, **fit(others, base)}).tokens_per_s
            loo = f"{ploo:,.0f} | {error_pct(ploo, r['tokens_per_s']):+.1f} %"
        else:   # no other run of its kind to fit without it: no leave-one-out figure
            loo = "n/a | n/a"
        print(f"| {r['lease']} | {r['name']} | {r['lay'].label()} | {r['tokens_per_s']:,} | {pin:,.0f} | "
              f"{error_pct(pin, r['tokens_per_s']):+.1f} % | {loo} |")
    if "--store" in sys.argv:
        store(gpu, entry, calibs, dirs)
    return 0


def store(gpu: str, entry: dict, calibs: list[dict], dirs: list[Path]) -> None:
    path = CATALOG_DIR / "calibration.json"
    data = json.loads(path.read_text())
    cur = data["gpus"].setdefault(gpu, {})
    cur.update(entry)
    cards = sorted({c["calibration"]["gpu"] for c in calibs})
    dates = sorted({c["calibration"]["date"] for c in calibs})
    folders = " ".join(f"references/results/{d.parent.name}/{d.name}" for d in dirs)
    cur["status"] = (f"measured on {len(calibs)} lease(s) of one {', '.join(cards)} ({', '.join(dates)}): gemm_bf16, "
                     f"gemm_fp8, hbm and attention_tflops by 'bench --calibrate' (median over leases); "
                     f"{', '.join(FITTED)} fitted to kernel profiles of the planner's first layouts of the "
                     f"single-GPU benchmark requests (benchmarks/calibrate_card.sh; python "
                     f"benchmarks/fit_calibration.py {folders}; leave-one-shape-out errors in "
                     f"references/benchmarks.md). The rest from 'default'")
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
