"""The plan tool: rank Megatron-Core layouts for a model on a cluster."""
from __future__ import annotations

import time
from typing import Any

from ..adapter import arguments as megatron_args
from ..contract import Context, Tool
from ..core import evidence
from ..core.flops import padded_vocab_size
from ..core.layout import Layout
from ..core.options import RuntimeOptions
from ..core.planner import Candidate, rank, search
from ..core.resolve import default_global_batch, default_seq_length, resolve_cluster, resolve_model
from ..core.timing import calibration
from ..errors import ToolError

ASSUMPTIONS = [
    "Peaks are the dense BF16/FP8 figures; MFU is model FLOPs by Megatron's formula "
    "(num_floating_point_operations: causal attention halved, recompute not counted) over the dense BF16 peak, also for FP8.",
    "Memory: bf16 weights, fp32 gradients, fp32 master weights and Adam moments (sharded over DPxCP "
    "by the distributed optimizer); flash attention; no dropout; fp32 copy of the logits in the loss.",
    "allowance_gib is outside torch's allocator (CUDA context, cuBLAS workspace, NCCL buffers: "
    "1 GiB + 0.5 GiB per kind of process group) plus 5% fragmentation of activations.",
    "Step time: GEMM roofline at calibrated efficiency (catalog/calibration.json), flash attention, "
    "memory-bound elementwise work, TP collectives not overlapped in forward, DP reduce/gather overlapped "
    "with the last micro-batch, pipeline bubble (PP-1)/VP micro-batch slots.",
    "MoE: balanced routing (no capacity overflow, no imbalance); the MoE options of the request's `moe` "
    "(dispatcher, grouped GEMM, dropless or capacity, router precision, all-to-all overlap) as costed in "
    "core/timing.py; a dropless layer's extra cost per token and local expert (time.moe_dropless_ms) is fitted "
    "to NVIDIA's published dropless runs (references/benchmarks.md).",
]


def _plan_json(rank: int, c: Candidate, gpu, model, include_args: bool, opts: RuntimeOptions) -> dict[str, Any]:
    lay: Layout = c.layout
    t = c.time.to_json()
    parts = {k: v for k, v in t.items() if k != "step_ms"}
    bottleneck = max(parts, key=parts.get)
    out = {
        "rank": rank,
        "label": lay.label(),
        "layout": lay.to_json(),
        "memory": {**{k: v.to_json() for k, v in c.memory.items()},
                   "peak_gib": round(c.peak_gib, 2), "gpu_gib": gpu.memory_gib},
        "time": t,
        "bottleneck": bottleneck.removesuffix("_ms"),
        "tokens_per_s": round(c.tokens_per_s),
        "tokens_per_s_per_gpu": round(c.tokens_per_s / lay.world_size, 1),
        "tflops_per_gpu": round(c.tflops_per_gpu, 1),
        "mfu": round(c.mfu, 4),
        "forecast": evidence.forecast(model, gpu.key, lay, calibration(gpu.key)["status"]),
    }
    if include_args:
        out["megatron_args"] = (megatron_args.model_args(model, lay.seq_length, opts.moe)
                                + megatron_args.layout_args(lay, model, gpu, opts.moe) + opts.megatron.flags())
    return out


def run(req: dict[str, Any], ctx: Context) -> dict[str, Any]:
    started = time.perf_counter()
    model = resolve_model(req)
    gpu, n_gpus, per_node = resolve_cluster(req)
    seq = req.get("seq_length") or default_seq_length(model)
    gbs = req.get("global_batch_size") or default_global_batch(seq)
    precisions = {"bf16": ["bf16"], "fp8": ["fp8"], "any": ["bf16", "fp8"]}[req["precision"]]
    opts = RuntimeOptions.from_request(None, te=req["transformer_engine"], moe=req.get("moe"),
                                       megatron=req.get("megatron_options"))
    res = search(model, gpu, n_gpus, seq, gbs, precisions, req.get("constraints") or {},
                 headroom_gib=req["headroom_gib"], opts=opts)
    ranked = rank(res.candidates)
    rejected = dict(sorted(res.rejected.items(), key=lambda kv: -kv[1]["count"]))
    if not ranked:
        reasons = "; ".join(f"{k} ({v['count']}): {v['rule']}" for k, v in list(rejected.items())[:4])
        raise ToolError("infeasible", f"no layout of {model.name} fits {n_gpus} x {gpu.key} "
                        f"at seq_length {seq}, global batch {gbs}",
                        where="/num_gpus",
                        fix="change the GPU count (a multiple of the divisors the rules need), the global "
                            "batch, or the sequence length; rejected: " + reasons,
                        details={"model": model.summary(), "rejected": rejected})
    top = ranked[: req["top"]]
    best = top[0]
    elapsed = time.perf_counter() - started
    ctx.progress(f"plan: {len(ranked)} feasible layouts, best {best.layout.label()} "
                 f"{best.tokens_per_s:,.0f} tokens/s ({elapsed:.2f}s)")
    return {
        "model": model.summary(),
        "cluster": {"gpu": gpu.key, "gpu_name": gpu.name, "num_gpus": n_gpus, "gpus_per_node": per_node,
                    "bf16_dense_tflops": gpu.bf16_dense_tflops, "memory_gib": gpu.memory_gib},
        "seq_length": seq,
        "global_batch_size": gbs,
        "tokens_per_step": seq * gbs,
        "padded_vocab_size": padded_vocab_size(model.vocab_size, best.layout.tp),
        "feasible": len(ranked),
        "plans": [_plan_json(i + 1, c, gpu, model, req["include_args"], opts) for i, c in enumerate(top)],
        "rejected": rejected,
        "assumptions": ASSUMPTIONS,
        "elapsed_s": round(elapsed, 3),
        "request": req,
    }


TOOL = Tool(name="plan", summary="Rank Megatron-Core parallel layouts with predicted memory, "
                     "step time, tokens/s and MFU.", run=run)
