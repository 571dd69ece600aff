"""The golden set: what plan, render and validate answer for a fixed set of requests, kept so
that a change of structure cannot change an answer unnoticed (tests/test_golden.py compares).
Regenerate only on purpose, when an answer is meant to change, and say why in the commit:

    .venv/bin/python tests/golden/make_golden.py
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tools"))

from megatron_skill.contract import call  # noqa: E402

PLANS = [
    {"model": "llama3-8b", "num_gpus": 8, "gpu": "h100-sxm"},
    {"model": "llama3-8b", "num_gpus": 8, "gpu": "h100-sxm", "precision": "fp8"},
    {"model": "llama3-8b", "num_gpus": 8, "gpu": "h100-sxm", "transformer_engine": False},
    {"model": "llama3-8b", "num_gpus": 16, "gpu": "a100-80gb", "seq_length": 4096},
    {"model": "llama3-70b", "num_gpus": 64, "gpu": "h100-sxm", "precision": "fp8"},
    {"model": "llama3-70b", "num_gpus": 128, "gpu": "h100-sxm", "seq_length": 32768},
    {"model": "llama3.2-1b", "num_gpus": 1, "gpu": "h200", "seq_length": 4096, "transformer_engine": False},
    {"model": "llama3.2-1b", "num_gpus": 1, "gpu": "h200", "seq_length": 4096, "precision": "fp8",
     "transformer_engine": False},
    {"model": "mixtral-8x7b", "num_gpus": 64, "gpu": "h100-sxm"},
    {"model": "qwen3-30b-a3b", "num_gpus": 16, "gpu": "h100-sxm", "seq_length": 4096},
    {"model": "deepseek-v3", "num_gpus": 1024, "gpu": "h100-sxm", "seq_length": 4096,
     "constraints": {"tp": 1, "pp": 16, "ep": 64}},
    {"model": "tiny-gpt", "num_gpus": 2, "gpu": "h100-sxm", "seq_length": 256},
    {"model": "llama3-8b", "num_gpus": 8, "gpu": "b200"},
    {"model": "llama3-8b", "num_gpus": 4, "gpu": "h100-sxm", "constraints": {"recompute": ["full"]}},
    {"hf_config": "tests/fixtures/hf/qwen2-7b", "num_gpus": 8, "gpu": "h800", "seq_length": 4096},
    {"hf_config": "tests/fixtures/hf/llama3.2-1b", "num_gpus": 8, "gpu": "h100-sxm"},
]
RENDERS = [
    {"model": "llama3-8b", "num_gpus": 8, "gpu": "h100-sxm", "launcher": "torchrun"},
    {"model": "llama3-70b", "num_gpus": 64, "gpu": "h100-sxm", "launcher": "slurm", "precision": "fp8"},
    {"model": "mixtral-8x7b", "num_gpus": 64, "gpu": "h100-sxm", "launcher": "torchrun-multinode"},
]
VALIDATES = [
    {"args": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
              "--max-position-embeddings", "4096", "--micro-batch-size", "2", "--global-batch-size", "64",
              "--tensor-model-parallel-size", "2", "--fp8-hybrid", "--use-mcore-models"],
     "num_gpus": 8, "gpu": "h100-sxm"},
    {"script": "tests/fixtures/scripts/good_torchrun.sh", "gpu": "h100-sxm"},
]


def _round(v):
    if isinstance(v, float):
        return round(v, 6)
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_round(x) for x in v]
    return v


def plan_answer(req: dict) -> dict:
    r = call("plan", {**req, "top": 3})
    assert r["ok"], r
    res = r["result"]
    return _round({"feasible": res["feasible"], "plans": [
        {"label": p["label"], "layout": p["layout"], "tokens_per_s": p["tokens_per_s"], "mfu": p["mfu"],
         "peak_gib": p["memory"]["peak_gib"]} for p in res["plans"]]})


def render_answer(req: dict, out_dir: str) -> dict:
    r = call("render", {**req, "output_dir": out_dir, "dry_run": True})
    assert r["ok"], r
    args = [a.replace(out_dir, "OUT") for a in r["result"]["megatron_args"]]
    return _round({"layout": r["result"]["layout"], "megatron_args": args})


def validate_answer(req: dict) -> dict:
    r = call("validate", req)
    assert r["ok"], r
    res = r["result"]
    return _round({"valid": res["valid"], "errors": sorted(e["code"] for e in res["errors"]),
                   "warnings": sorted(w["code"] for w in res["warnings"]),
                   "predicted_peak_gib": res["predicted_peak_gib"]})


def answers(out_dir: str) -> dict:
    return {"plan": [plan_answer(r) for r in PLANS], "render": [render_answer(r, out_dir) for r in RENDERS],
            "validate": [validate_answer(r) for r in VALIDATES]}


if __name__ == "__main__":
    import os
    import tempfile

    os.chdir(HERE.parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        (HERE / "answers.json").write_text(json.dumps(answers(tmp), indent=1) + "\n")
    print("wrote", HERE / "answers.json")
