#!/usr/bin/env python3
"""A GPU's calibration entry from what benchmarks/calibrate_card.sh measured on it, with the
leave-one-out check of every fitted figure.

    python benchmarks/fit_calibration.py RESULTS_DIR [--store]

RESULTS_DIR holds calibrate.json (bench --calibrate) and levers/*.json (bench results with a
kernel profile of one iteration). What comes from where:
- gemm_bf16, gemm_fp8, hbm, attention_tflops: the kernel rates bench --calibrate measured;
- elementwise_local_factor: the profile's element-wise, copy and norm kernel time of the BF16
  runs, less the loss and gradient-accumulation kernels the model charges apart, over the
  model's fused byte count at the calibrated HBM rate (median over runs);
- fp8_cast_factor: the same of the FP8 runs, less their BF16 element-wise share, over the
  model's FP8 cast bytes (median);
- layer_overhead_local_ms: wall time of an iteration beyond its kernel time (the GPU idle while the
  host launches), per layer and micro-batch, less the per-micro-batch share the catalog keeps
  (median): the local layers launch a few dozen kernels a layer.
Each run is then predicted twice: with every run in the fit (in-sample) and with the figures
fitted without it (leave-one-out: the error to quote). --store writes the entry into
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
FITTED = ("elementwise_local_factor", "fp8_cast_factor", "layer_overhead_local_ms")
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


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    results = Path(args[0])
    calib = json.loads((results / "calibrate.json").read_text())["result"]
    runs = [r for r in load_runs(results) if r["profile"]]
    gpu = runs[0]["gpu"].key
    defaults = json.loads((CATALOG_DIR / "calibration.json").read_text())["default"]
    base = {**defaults, **calib["catalog_entry"]}
    fitted = fit(runs, base)
    entry = {**calib["catalog_entry"], **fitted}
    print(f"## {gpu}: {json.dumps(entry)}\n")
    print("| run | layout | measured tokens/s | predicted (in-sample) | error | predicted (leave-one-out) | error |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        pin = _predict(r, {**base, **fitted}).tokens_per_s
        others = [o for o in runs if o is not r]
        if any(o["fp8"] == r["fp8"] for o in others) and any(not o["fp8"] for o in others):
            ploo = _predict(r, {**base, **fit(others, base)}).tokens_per_s
            loo = f"{ploo:,.0f} | {error_pct(ploo, r['tokens_per_s']):+.1f} %"
        else:   # no other run of its kind to fit without it: no leave-one-out figure
            loo = "n/a | n/a"
        print(f"| {r['name']} | {r['lay'].label()} | {r['tokens_per_s']:,} | {pin:,.0f} | "
              f"{error_pct(pin, r['tokens_per_s']):+.1f} % | {loo} |")
    if "--store" in sys.argv:
        store(gpu, entry, calib)
    return 0


def store(gpu: str, entry: dict, calib: dict) -> None:
    path = CATALOG_DIR / "calibration.json"
    data = json.loads(path.read_text())
    cur = data["gpus"].setdefault(gpu, {})
    cur.update(entry)
    measured = calib["calibration"]
    cur["status"] = (f"measured on one {measured['gpu']} ({measured['date']}): gemm_bf16, gemm_fp8, hbm and "
                     f"attention_tflops by 'bench --calibrate'; {', '.join(FITTED)} fitted to kernel profiles of "
                     f"the planner's first layouts of the single-GPU benchmark requests (benchmarks/calibrate_card.sh, "
                     f"benchmarks/fit_calibration.py; leave-one-out errors in references/benchmarks.md). The rest "
                     f"from 'default'")
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
