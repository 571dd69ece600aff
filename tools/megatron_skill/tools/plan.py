"""The plan tool: rank Megatron-Core layouts for a model on a cluster."""
from __future__ import annotations

import math
import time
from typing import Any

from ..adapter import arguments as megatron_args
from ..contract import Context, Tool
from ..core import evidence
from ..core.flops import padded_vocab_size
from ..core.layout import Layout
from ..core.memory import CONTEXT_GIB, FRAGMENTATION, NCCL_GIB_PER_GROUP, PLAN_MARGIN_GIB
from ..core.options import RuntimeOptions, fp8_local_note
from ..core.planner import Candidate, rank, search
from ..core.resolve import check_precision, default_global_batch, default_seq_length, resolve_cluster, resolve_model
from ..core.timing import calibration
from ..errors import ToolError

ASSUMPTIONS = [
    "Peaks are the dense BF16/FP8 figures; MFU is model FLOPs by Megatron's formula "
    "(num_floating_point_operations: causal attention halved, recompute not counted) over the dense BF16 peak, also for FP8.",
    "Memory: bf16 weights, fp32 gradients, fp32 master weights and Adam moments (sharded over DPxCP "
    "by the distributed optimizer); flash attention; no dropout; fp32 copy of the logits in the loss.",
    f"allowance_gib is outside torch's allocator (CUDA context, cuBLAS workspace, NCCL buffers: "
    f"{CONTEXT_GIB:g} GiB + {NCCL_GIB_PER_GROUP:g} GiB per kind of process group; Transformer Engine's "
    f"userbuffers where TP communication overlap is on) plus {FRAGMENTATION:.0%} fragmentation of activations.",
    "Step time: GEMM roofline at calibrated efficiency (catalog/calibration.json), flash attention, "
    "memory-bound elementwise work, TP collectives not overlapped in forward, DP reduce/gather overlapped "
    "with the last micro-batch, pipeline bubble (PP-1)/VP micro-batch slots.",
    "MoE: balanced routing (no capacity overflow, no imbalance); the MoE options of the request's `moe` "
    "(dispatcher, grouped GEMM, dropless or capacity, router precision, all-to-all overlap) as costed in "
    "core/timing.py; an MoE layer's cost per token and local expert beyond its modelled work "
    "(time.moe_experts_ms: a part every layer pays, a larger one where dropless routing reads the counts back "
    "to the host) is fitted to NVIDIA's published H100 MoE runs (references/benchmarks.md).",
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
                                + megatron_args.layout_args(lay, model, gpu, opts.moe) + opts.megatron.flags()
                                + (megatron_args.te_only_args(lay, gpu, False, model, opts.moe, opts.megatron)
                                   if opts.te else []))
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
    opts.megatron.check_request(req["precision"], opts.te, (req.get("constraints") or {}).get("distributed_optimizer"))
    check_precision(req["precision"], gpu)
    res = search(model, gpu, n_gpus, seq, gbs, precisions, req.get("constraints") or {},
                 headroom_gib=req["headroom_gib"], opts=opts)
    ranked = rank(res.candidates)
    rejected = dict(sorted(res.rejected.items(), key=lambda kv: -kv[1]["count"]))
    if not ranked:
        reasons = "; ".join(f"{k} ({v['count']}): {v['rule']}" for k, v in list(rejected.items())[:4])
        nearest = nearest_feasible(
            lambda n, b: search(model, gpu, n, seq, b, precisions, req.get("constraints") or {},
                                headroom_gib=req["headroom_gib"], opts=opts),
            n_gpus, per_node, gbs, budget=NEAREST_WORK * max(_work(res), NEAREST_MIN_WORK),
            more_gpus_only=next(iter(rejected), None) == "out_of_memory")
        raise ToolError("infeasible", f"no layout of {model.name} fits {n_gpus} x {gpu.key} "
                        f"at seq_length {seq}, global batch {gbs}",
                        where="/num_gpus",
                        fix=_nearest_in_words(nearest, n_gpus, gbs) + "rejected: " + reasons,
                        details={"model": model.summary(), "rejected": rejected, "nearest_feasible": nearest})
    top = ranked[: req["top"]]
    best = top[0]
    elapsed = time.perf_counter() - started
    ctx.progress(f"plan: {len(ranked)} feasible layouts, best {best.layout.label()} "
                 f"{best.tokens_per_s:,.0f} tokens/s ({elapsed:.2f}s)")
    result = {
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
    # the same lines the terminal's summary ends with: an agent reads only the JSON
    result["warnings"] = _warnings(result)
    return result


# ---- an infeasible request: the nearest values that fit ---------------------------------

# Nearby searches stop when they have costed NEAREST_WORK times the layouts of the request's own
# search: a budget of work, not of time, so the same request names the same values on an idle and
# on a loaded machine (on this 2-core machine about the plan's second for the catalog's models).
NEAREST_WORK = 8
NEAREST_MIN_WORK = 2_000  # a small request's own search (10 GPUs) is too little to reach the next nodes
NEAREST_WANTED = 3       # feasible values of each kind worth naming


def _by_distance(values: set[int], centre: int) -> list[int]:
    """Positive values, nearest first on a log scale (twice and half are equally near)."""
    return sorted((v for v in values if v > 0 and v != centre), key=lambda v: (abs(math.log(v / centre)), v))


def gpu_counts_near(n_gpus: int, per_node: int) -> list[int]:
    """GPU counts worth trying beside n_gpus: whole nodes (or powers of two below one node), a
    node or two either way of the whole nodes around n_gpus (10 GPUs on 8-GPU nodes: 8, 16,
    24, 32), and halves and doublings."""
    unit = per_node if n_gpus >= per_node else 1
    below = n_gpus // unit * unit     # the whole nodes at or below n_gpus
    near = {below + k * unit for k in (-2, -1, 0, 1, 2, 3)} | {n_gpus * f for f in (2, 4, 8, 16)}
    near |= {n_gpus // f for f in (2, 4) if n_gpus % f == 0}
    near |= {2 ** k for k in range(0, 15) if 2 ** k < per_node}
    def whole(c: int) -> bool:  # whole nodes, or a power of two inside one
        return c % per_node == 0 or (c < per_node and (c & (c - 1)) == 0)
    return [c for c in _by_distance(near, n_gpus) if whole(c)]


def batches_near(gbs: int, n_gpus: int) -> list[int]:
    """Global batches worth trying beside gbs: halves and doublings, and the multiples of the GPU
    count on either side (data parallelism divides the batch)."""
    near = {gbs // 2, gbs // 4, gbs * 2, gbs * 4, -(-gbs // n_gpus) * n_gpus, gbs // n_gpus * n_gpus}
    return _by_distance(near, gbs)


def _work(res) -> int:
    """Layouts a search considered (the rules accepted or refused them): its size, whatever the
    machine's speed and however many of them the bound left uncosted."""
    return res.considered


def nearest_feasible(feasible_search, n_gpus: int, per_node: int, gbs: int, budget: int,
                     more_gpus_only: bool = False) -> dict[str, Any]:
    """The nearest GPU counts (at this batch) and global batches (on these GPUs) with a layout
    that fits, each with its best layout; searched nearest first while the layouts costed stay
    within budget. more_gpus_only: the model does not fit in memory, which fewer GPUs cannot mend."""
    found: dict[str, list] = {"num_gpus": [], "global_batch_size": [], "searched": []}
    tries = [("num_gpus", n, gbs) for n in gpu_counts_near(n_gpus, per_node) if n > n_gpus or not more_gpus_only]
    tries += [("global_batch_size", n_gpus, b) for b in batches_near(gbs, n_gpus)]
    tries.sort(key=lambda t: abs(math.log((t[1] / n_gpus) if t[0] == "num_gpus" else (t[2] / gbs))))
    spent = 0
    for kind, n, b in tries:
        if spent >= budget:
            break
        if len(found[kind]) >= NEAREST_WANTED:
            continue
        found["searched"].append({"num_gpus": n, "global_batch_size": b})
        try:
            res = feasible_search(n, b)
        except ToolError:   # a value the search itself refuses has no layout
            continue
        spent += _work(res)
        ranked = rank(res.candidates)
        if ranked:
            best = ranked[0]
            found[kind].append({"num_gpus": n, "global_batch_size": b, "best": best.layout.label(),
                                "tokens_per_s": round(best.tokens_per_s), "peak_gib": round(best.peak_gib, 2)})
    for kind in ("num_gpus", "global_batch_size"):
        found[kind].sort(key=lambda f: f[kind])
    return found


def _nearest_in_words(nearest: dict[str, Any], n_gpus: int, gbs: int) -> str:
    counts = [str(f["num_gpus"]) for f in nearest["num_gpus"]]
    batches = [str(f["global_batch_size"]) for f in nearest["global_batch_size"]]
    said = []
    if counts:
        said.append(f"{' or '.join(counts)} GPUs at global batch {gbs}")
    if batches:
        said.append(f"global batch {' or '.join(batches)} on {n_gpus} GPUs")
    if not said:
        tried = sorted({t["num_gpus"] for t in nearest["searched"]})
        return (f"none of the {len(nearest['searched'])} nearby values tried fits (GPU counts {tried}, "
                "global batches beside the one given): plan with more GPUs, a shorter sequence or a larger GPU; ")
    return "nearest that fit: " + "; ".join(said) + "; "


# ---- a short summary for a person at the terminal (stderr; stdout keeps the JSON) -------------

def _row(p: dict[str, Any]) -> str:
    mem = p["memory"]
    return (f"  {p['rank']:>2}  {p['label']:<34} {mem['peak_gib']:>6.1f}/{mem['gpu_gib']:<6.1f} "
            f"{p['tokens_per_s']:>12,}  {p['mfu']:>5.3f}  {p['bottleneck']}")


def _warnings(result: dict[str, Any]) -> list[str]:
    """What a reader should know about the first plan, in plain words."""
    best = result["plans"][0]
    out = [f"speed forecast: {w}" for w in best.get("forecast", {}).get("beyond_evidence") or []]
    margin = PLAN_MARGIN_GIB
    free = [p["memory"]["gpu_gib"] - p["memory"]["peak_gib"] for p in result["plans"][:5]]
    if free[0] < margin:
        out.append(f"no plan leaves {margin:g} GiB free (a plan with less ran out of memory where one with more "
                   "ran): the best is the fastest of those that fit the model")
    behind = [p["rank"] for p, f in zip(result["plans"][1:5], free[1:])
              if f < margin <= free[0] and p["tokens_per_s"] > best["tokens_per_s"]]
    if behind:
        out.append(f"plan {', '.join(f'#{r}' for r in behind)} is faster but leaves less than {margin:g} GiB free "
                   "(less than a measured run needed): ranked after the plans that do")
    left = best["memory"]["gpu_gib"] - best["memory"]["peak_gib"]
    if margin <= left < 0.05 * best["memory"]["gpu_gib"]:
        out.append(f"the best layout leaves only {left:.1f} GiB of {best['memory']['gpu_gib']} GiB free: "
                   "memory the planner does not model can still run it out of memory")
    if ((result.get("request") or {}).get("megatron_options") or {}).get("cuda_graph_impl", "none") != "none":
        out.append("CUDA graphs: the memory of their static buffers is not counted in the peak")
    lay = Layout.from_json(best["layout"])
    if lay.precision == "fp8" and not (result.get("request") or {}).get("transformer_engine", True) and lay.tp > 1:
        # labelled FP8 (the flags ask for it), costed as what runs: BF16 linear layers
        out.append(f"FP8 without Transformer Engine: {fp8_local_note(lay)} (costed so); TP 1 keeps FP8")
    if best["bottleneck"] not in ("gemm", "attention"):
        out.append(f"the best layout spends most of its step in {best['bottleneck']}, not in compute")
    return out


def summary(envelope: dict[str, Any]) -> str:
    """A few lines for a person: the best layouts as a table and warnings, or what went wrong
    and, for an infeasible request, the nearest GPU counts and batches that fit."""
    if not envelope.get("ok"):
        err = envelope.get("error") or {}
        lines = [f"plan: {err.get('code', 'error')}: {err.get('message', '')}"]
        near = (err.get("details") or {}).get("nearest_feasible") or {}
        for f in near.get("num_gpus", []) + near.get("global_batch_size", []):
            lines.append(f"  fits: {f['num_gpus']} GPUs, global batch {f['global_batch_size']}: {f['best']}, "
                         f"{f['tokens_per_s']:,} tokens/s, peak {f['peak_gib']} GiB")
        if err.get("fix"):
            lines.append(f"  fix: {err['fix']}")
        return "\n".join(lines)
    result = envelope["result"]
    cluster = result["cluster"]
    lines = [f"plan: {result['model'].get('name')} on {cluster['num_gpus']} x {cluster['gpu']}, sequence "
             f"{result['seq_length']}, global batch {result['global_batch_size']}: {result['feasible']} costed layouts fit",
             f"   #  {'layout':<34} {'peak/GPU GiB':>13} {'tokens/s':>12}  {'MFU':>5}  bottleneck"]
    lines += [_row(p) for p in result["plans"][:5]]
    warnings = result.get("warnings") or []
    if warnings:
        lines.append("warnings:")
        lines += [f"  - {w}" for w in warnings]
    return "\n".join(lines)


TOOL = Tool(name="plan", summary="Rank Megatron-Core parallel layouts with predicted memory, "
                     "step time, tokens/s and MFU.", run=run)
