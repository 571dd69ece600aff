#!/usr/bin/env python3
"""The planner's predictions beside what bench measured, for the results on record.

    python benchmarks/planner_vs_measured.py [RESULTS_DIR]     # default: references/results/h200-2026-12-03

Predicts each bench result again with the current planner (the GPU, layout and runtime
options the result records) and prints the Markdown tables of references/benchmarks.md:
  1. single-GPU runs (levers/, ranking/): step time and peak allocated memory, predicted,
     measured, error in %;
  2. single ranks of 64-GPU layouts under a fake process group (ranks/): peak memory of the
     rank against the planner's for its pipeline stage;
  3. the ranking: the single-GPU candidates of the 1B shape, planner's order beside measured.
Run it after changing the model or the calibration data.
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from megatron_skill.core.catalog import get_gpu  # noqa: E402
from megatron_skill.core.flops import padded_vocab_size  # noqa: E402
from megatron_skill.core.layout import Layout  # noqa: E402
from megatron_skill.core.memory import GIB, MemoryOptions, peak, stage_memory  # noqa: E402
from megatron_skill.core.options import RuntimeOptions  # noqa: E402
from megatron_skill.core.planner import error_pct, predict, rank  # noqa: E402
from megatron_skill.core.resolve import resolve_model  # noqa: E402

SHAPES = {"llama-1b-shape": "llama-1b-shape-bf16.json", "llama-3b-shape": "llama-3b-shape-bf16.json",
          "Qwen2ForCausalLM": "qwen2.5-1.5b-shape-bf16.json"}  # an hf_config model is named by its class
CATALOG = {"llama3-8b": "llama3-8b", "mixtral-8x7b": "mixtral-8x7b"}


def runtime_of(res: dict, path: Path) -> dict:
    """The runtime options of a result: recorded in it, or (results made before bench
    recorded them) what its lever entry set: FP8 by name, GQA expanded in the first levers."""
    if res.get("runtime"):
        # Results record every option with its default filled in; one without
        # fused_wgrad_accumulation ran before the option existed, unfused.
        return res["runtime"]
    return {"fp8_linear": "fp8" in path.stem,
            "native_gqa": path.stem not in ("1b-fused", "3b-fused-mbs4", "1b-fused-fp8")}


def load(path: Path) -> dict | None:
    res = json.loads(path.read_text())
    return res.get("result") if res.get("ok", True) else None


def model_of(res: dict):
    name = res["model"]["name"]
    if name in SHAPES:
        req = json.loads((ROOT / "benchmarks" / "requests" / SHAPES[name]).read_text())
        return resolve_model({k: v for k, v in req.items() if k in ("model", "hf_config")})
    return resolve_model({"model": CATALOG[name]})


def layout_of(res: dict) -> Layout:
    return Layout.from_json(res["layout"])


def _ref(path: Path) -> str:
    """A result file as references/benchmarks.md names it (relative to references/)."""
    try:
        return str(path.resolve().relative_to(ROOT / "references"))
    except ValueError:
        return str(path)


def single_gpu(results: Path) -> list[dict]:
    out = []
    folders = ("levers", "ranking", "default-path")
    for path in [p for f in folders for p in sorted((results / f).glob("*.json"))]:
        if path.name.endswith(".profile.json") or not (res := load(path)):
            continue
        model, lay, rt = model_of(res), layout_of(res), runtime_of(res, path)
        # a result without fused_wgrad_accumulation ran before the option existed: unfused
        opts = RuntimeOptions.from_request({"fused_wgrad_accumulation": False, **rt}, te=False)
        c = predict(model, get_gpu(res["gpu"]), lay, padded_vocab_size(model.vocab_size, lay.tp), opts)
        notes = (["FP8 linear"] if rt.get("fp8_linear") else []) + ([] if rt.get("native_gqa", True) else
                                                                     ["K/V expanded"])
        if rt.get("fused_wgrad_accumulation") is False:          # turned off on purpose (a lever)
            notes.append("unfused wgrad")
        out.append({"result": _ref(path), "model": res["model"]["name"], "lay": lay,
                    "label": f"{res['model']['name']} {lay.label()}" + (f" ({', '.join(notes)})" if notes else ""),
                    "iter_ms": (round(c.time.total * 1e3), res["measured"]["iter_ms"]),
                    "gib": (round(peak(c.memory, "allocated") / GIB, 2),
                            res["measured"]["max_allocated_gib"]), "default": not notes and lay.precision == "bf16",
                    "current": rt.get("native_gqa", True)})
    return out


def fake_ranks(results: Path) -> list[dict]:
    out = []
    for path in sorted((results / "ranks").glob("*.json")):
        if not (res := load(path)):
            continue
        model, lay = model_of(res), layout_of(res)
        st = stage_memory(model, lay, res["pipeline_stage"], padded_vocab_size(model.vocab_size, lay.tp),
                          MemoryOptions(fused_head=True))
        out.append({"result": _ref(path), "label": f"{res['model']['name']} {lay.label()}",
                    "rank": res["fake_rank"], "stage": res["pipeline_stage"],
                    "gib": (round(st.allocated / GIB, 2), res["measured"]["max_allocated_gib"]),
                    "reserved": res["measured"]["max_reserved_gib"], "allowance": round(st.allowance / GIB, 2)})
    return out


def ranking(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """The 1B shape's single-GPU candidates (the newest result per micro-batch and recompute on
    the default BF16 path) in the planner's order (its own rule, planner.rank, on the
    predictions for the path each ran) and in measured order."""
    cands = {}
    for r in rows:
        if r["model"] == "llama-1b-shape" and r["default"]:
            cands[(r["lay"].mbs, r["lay"].recompute)] = r
    # (these rows name no GPU: the memory margin of planner.tight never applies to them; every one
    # of them left more than it on the H200)
    by_pred = rank(list(cands.values()), speed=lambda r: 1 / r["iter_ms"][0], peak=lambda r: r["gib"][0])
    return by_pred, sorted(cands.values(), key=lambda r: r["iter_ms"][1])


def main() -> None:
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "references" / "results" / "h200-2026-12-03"
    rows = single_gpu(results)
    print("| configuration | step ms predicted | measured | error | peak GiB predicted | measured | error | result |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        (pt, mt), (pm, mm) = r["iter_ms"], r["gib"]
        print(f"| {r['label']} | {pt:,} | {mt:,.0f} | {error_pct(pt, mt):+.1f} % | {pm} | {mm:.2f} | "
              f"{error_pct(pm, mm):+.1f} % | `{r['result']}` |")
    print()
    print("| layout (64 GPUs) | rank (stage) | peak GiB predicted | measured | error | reserved GiB | "
          "NCCL + context allowance GiB | result |")
    print("|---|---|---|---|---|---|---|---|")
    for r in fake_ranks(results):
        (pm, mm) = r["gib"]
        print(f"| {r['label']} | {r['rank']} ({r['stage']}) | {pm} | {mm:.2f} | {error_pct(pm, mm):+.1f} % | "
              f"{r['reserved']:.2f} | {r['allowance']} | `{r['result']}` |")
    print()
    by_pred, by_meas = ranking(rows)
    print("| 1B candidate | planner's rank | predicted ms | measured rank | measured ms |")
    print("|---|---|---|---|---|")
    for r in by_pred:
        print(f"| {r['lay'].label()} | {by_pred.index(r) + 1} | {r['iter_ms'][0]:,} | {by_meas.index(r) + 1} | "
              f"{r['iter_ms'][1]:,.0f} |")


if __name__ == "__main__":
    main()
