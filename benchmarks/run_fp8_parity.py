#!/usr/bin/env python3
"""FP8 against BF16 on real text: the same model, data and seed, a few hundred steps.

    python benchmarks/run_fp8_parity.py OUTDIR [--iters 300]

The text is the Python standard library's own source (code, comments and docstrings: real
text every Python install has, nothing downloaded), tokenized as UTF-8 bytes by
prepare-data.  Three train runs: BF16, BF16 with another seed (what run-to-run noise is),
and FP8 linear layers with the first seed, side by side on the GPU.  OUTDIR/fp8-parity.json holds the loss curves
and the comparison: the mean loss over the last 50 steps of each run, and the FP8 - BF16
gap against the gap between the two BF16 seeds.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

CORPUS_BYTES = 24 << 20
MODEL = {"name": "llama-250m-shape", "num_layers": 16, "hidden_size": 1024, "ffn_hidden_size": 4096,
         "num_attention_heads": 16, "num_query_groups": 4, "kv_channels": 64, "vocab_size": 257,
         "max_position_embeddings": 4096, "rotary_base": 500000, "untie_embeddings_and_output_weights": True}


def corpus(path: Path) -> int:
    """The standard library's .py files in sorted order, one document each, up to CORPUS_BYTES."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    total, docs = 0, 0
    with open(path, "w") as f:
        for src in sorted(lib.rglob("*.py")):
            if "site-packages" in src.parts:
                continue
            try:
                text = src.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():  # empty __init__.py files: prepare-data refuses empty documents
                continue
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode())
            docs += 1
            if total >= CORPUS_BYTES:
                break
    return docs


def launch(tool: str, req: dict, out_dir: Path, tag: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), tool, "--request", "-",
                           "--runs-root", str(out_dir / "runs")] if tool == "train" else
                          [sys.executable, str(ROOT / "tools" / "launch.py"), tool, "--request", "-"],
                          input=json.dumps(req), capture_output=True, text=True, cwd=ROOT)
    (out_dir / f"{tool}-{tag}.err").write_text(proc.stderr[-20000:])
    out = json.loads(proc.stdout)
    if not out.get("ok"):
        raise SystemExit(f"{tool} failed: {json.dumps(out)[:2000]}")
    return out["result"]


def losses(result: dict) -> list[tuple[int, float]]:
    from megatron_skill.adapter.log import parse

    lines = Path(result["log"]).read_text(errors="replace").splitlines()
    return [(r["iteration"], r["loss"]) for r in parse(lines)["iterations"] if r.get("loss") is not None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--fp8-scaling", choices=["current", "delayed"], default="current",
                    help="the FP8 run's runtime.fp8_scaling (default current)")
    a = ap.parse_args()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    docs = corpus(a.out_dir / "stdlib.jsonl")
    print(f"fp8-parity: corpus of {docs} files", file=sys.stderr, flush=True)
    prefix = str(a.out_dir / "stdlib_byte")
    launch("prepare-data", {"input": [str(a.out_dir / "stdlib.jsonl")], "output_prefix": prefix,
                            "tokenizer": "byte", "workers": min(8, os.cpu_count() or 1)}, a.out_dir, "corpus")
    base = {"model": MODEL, "num_gpus": 1, "seq_length": 2048, "global_batch_size": 16,
            "layout": {"tp": 1, "pp": 1, "mbs": 8},
            "training": {"train_iters": a.iters, "lr": 6e-4, "min_lr": 6e-5, "lr_warmup_iters": 30,
                         "log_interval": 1, "eval_iters": 0, "eval_interval": 100000, "checkpoint": False,
                         "data_path": [prefix], "split": "98,2,0"}}
    def one(name: str, seed: int, fp8: bool) -> dict:
        print(f"fp8-parity: {name}", file=sys.stderr, flush=True)
        req = json.loads(json.dumps(base))
        req["training"]["seed"] = seed
        req["runtime"] = {"fp8_linear": fp8, **({"fp8_scaling": a.fp8_scaling} if fp8 else {})}
        res = launch("train", req, a.out_dir, name)
        return {"request_id": res.get("run_id"), "seed": seed, "fp8_linear": fp8,
                "fp8_scaling": a.fp8_scaling if fp8 else None, "losses": losses(res)}

    # The three runs share the GPU at once: losses do not depend on speed, and a 250M model
    # leaves most of an H200 idle.
    plan = (("bf16", 1234, False), ("bf16-seed2", 4321, False), ("fp8", 1234, True))
    with concurrent.futures.ThreadPoolExecutor(len(plan)) as pool:
        futures = {name: pool.submit(one, name, seed, fp8) for name, seed, fp8 in plan}
        runs = {name: f.result() for name, f in futures.items()}
    tail = {n: r["losses"][-50:] for n, r in runs.items()}
    mean = {n: sum(v for _, v in t) / len(t) for n, t in tail.items()}
    summary = {
        "model": MODEL["name"], "tokens_per_step": 16 * 2048, "iters": a.iters,
        "mean_loss_last_50": {n: round(v, 4) for n, v in mean.items()},
        "fp8_minus_bf16": round(mean["fp8"] - mean["bf16"], 4),
        "bf16_seed_gap": round(mean["bf16-seed2"] - mean["bf16"], 4),
        "within_noise": abs(mean["fp8"] - mean["bf16"]) <= max(abs(mean["bf16-seed2"] - mean["bf16"]), 0.01),
    }
    (a.out_dir / "fp8-parity.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
