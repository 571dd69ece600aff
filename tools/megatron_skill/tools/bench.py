"""The bench tool: measured throughput and MFU of a configuration, beside the planner's prediction.

A benchmark is a short train run (warm-up plus timed iterations, no checkpoints, memory
reported every iteration) through the same rendered script as train.  TFLOP/s/GPU is
Megatron's own log figure (its num_floating_point_operations), MFU is that over the dense
BF16 peak of the GPU found here, and every measured figure stands beside the prediction
for the same layout with the error in %.  With calibrate, it measures GEMM, attention and
HBM efficiency on this GPU instead, the figures the step-time model uses.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from .. import files
from ..adapter import log as megatron_log
from ..contract import Context, Tool, invoke, request_fields
from ..core.catalog import get_gpu, gpu_by_device_name
from ..core.flops import padded_vocab_size
from ..core.layout import Layout
from ..core.memory import GIB, fused_head_runs, peak, stage_memory
from ..core.options import RuntimeOptions
from ..core.planner import error_pct, predict
from ..core.resolve import fake_rank, pipeline_stage, resolve_model
from ..environment import gpu_count_and_name, have_transformer_engine
from ..errors import ToolError


def _gpu(req: dict):
    n, name = gpu_count_and_name()
    if req.get("gpu"):
        return get_gpu(req["gpu"], where="/gpu"), n
    if name:
        found = gpu_by_device_name(name)
        if found:
            return found, n
        raise ToolError("not_found", f"the GPU here ({name}) is not in the catalog", where="/gpu",
                        fix="give gpu explicitly, or add it to catalog/gpus.json")
    return None, 0


def _calibrate(req: dict, ctx: Context, out_dir: Path) -> dict[str, Any]:
    gpu, n = _gpu(req)
    if not n:
        raise ToolError("environment", "calibration needs a CUDA GPU", where="/calibrate", fix="run it on the GPU")
    from ..runtime import calibrate

    ctx.progress(f"bench: calibrating {gpu.key} (GEMM, attention, HBM)")
    result = calibrate.measure(gpu.bf16_dense_tflops, gpu.fp8_dense_tflops, gpu.hbm_gbps)
    result.update(gpu=gpu.key, date=time.strftime("%Y-%m-%d"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "calibration.json").write_text(json.dumps(result, indent=1))
    out = {"calibration": result, "catalog_entry": catalog_entry(result, gpu),
           "files": [str(out_dir / "calibration.json")]}
    if req.get("store_calibration"):
        out["files"].append(store_calibration(gpu, out["catalog_entry"], result["date"]))
    return out


def catalog_entry(result: dict, gpu) -> dict[str, Any]:
    """What catalog/calibration.json keeps of a calibration for the step-time model: the
    large-GEMM rates as fractions of the dense peaks (its roofline charges smaller shapes
    itself), HBM, and the causal attention rate by sequence and head dimension."""
    entry = {"gemm_bf16": round(result["gemm_bf16_tflops"]["square_8192"] / gpu.bf16_dense_tflops, 2),
             "hbm": round(result["calibration"]["hbm"], 2), "attention_tflops": dict(result["attention_tflops"])}
    if result.get("gemm_fp8_tflops") and gpu.fp8_dense_tflops:
        entry["gemm_fp8"] = round(result["gemm_fp8_tflops"]["square_8192"] / gpu.fp8_dense_tflops, 2)
    return entry


def store_calibration(gpu, entry: dict, date: str) -> str:
    """Write a calibration into catalog/calibration.json for this GPU type, keeping the
    figures calibrate does not measure (the profile-derived factors)."""
    from ..core.catalog import CATALOG_DIR

    path = CATALOG_DIR / "calibration.json"
    data = json.loads(path.read_text())
    cur = data["gpus"].setdefault(gpu.key, {})
    cur.update(entry)
    note = f"gemm_bf16, gemm_fp8, hbm, attention_tflops measured by 'bench --calibrate' on {date}"
    cur["status"] = note + "; " + cur["status"].split("; ", 1)[-1] if "status" in cur else note
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    from ..core.timing import clear_caches
    clear_caches()
    return str(path)


def run(req: dict, ctx: Context) -> dict[str, Any]:
    run_id = ctx.request_id
    # a runs_root that is a file, lies below one or loops is the request's error, said here
    out_dir = files.output_folder(files.output_folder(req["runs_root"], "/runs_root", "runs_root folder") / run_id,
                                  "/runs_root", "run folder").resolve()
    if req["calibrate"]:
        if ctx.dry_run:
            return {"dry_run": True, "actions": ["measure GEMM / attention / HBM", f"write {out_dir}/calibration.json"]
                    + (["update catalog/calibration.json for this GPU"] if req.get("store_calibration") else [])}
        return _calibrate(req, ctx, out_dir)
    model = resolve_model(req)
    if not ctx.dry_run and not gpu_count_and_name()[0]:
        raise ToolError("environment", "bench measures on GPUs, and no CUDA GPU is visible here", where="gpu",
                        fix="run bench on a GPU machine (--dry-run shows its actions anywhere); without a GPU, "
                            "train --backend cpu --model tiny-gpt runs a real Megatron-Core model on CPU")
    gpu, _ = _gpu(req)
    if gpu is None:
        gpu = get_gpu("h100-sxm")
    # The run itself is train's, asked through the contract like any caller would.
    result = invoke("train", _train_request(req, gpu.key, ctx.dry_run), ctx)
    if ctx.dry_run:
        return result
    parsed = megatron_log.parse(Path(result["log"]).read_text(errors="replace").splitlines())
    if req.get("fake_rank") is not None:
        return _fake_rank_result(req, result, parsed, model, gpu, run_id)
    return _measured_result(req, result, parsed, model, gpu, run_id)


def _train_request(req: dict, gpu_key: str, dry_run: bool) -> dict[str, Any]:
    """The train request of the benchmark: warm-up and timed iterations, every one logged with
    its memory, no checkpoint or evaluation, on mock data unless the request gives its own (a
    benchmark measures speed and memory)."""
    iters = req["warmup_iters"] + req["timed_iters"]
    given = req.get("training", {})
    training = {**given, "mock_data": bool(given.get("mock_data") or not given.get("data_path")), "train_iters": iters,
                "log_interval": 1,
                "log_memory_interval": 1,
                "checkpoint": False, "eval_iters": 0, "eval_interval": iters + 1, "lr_warmup_iters": 1}
    treq = {k: v for k, v in req.items() if k in request_fields("train") - {"dry_run"}}
    treq.update(training=training, backend="gpu", gpu=gpu_key, runs_root=req["runs_root"], resume=False,
                launcher="torchrun", dry_run=dry_run)
    if req["profile"]:   # written by the runtime within the run directory
        treq["env"] = {**treq.get("env", {}), "MEGATRON_SKILL_PROFILE": "profile.json",
                       "MEGATRON_SKILL_PROFILE_ITER": str(req["warmup_iters"] + 1)}
    return treq


def _measured_result(req: dict, result: dict, parsed: dict, model, gpu, run_id: str) -> dict[str, Any]:
    """The timed iterations' medians and peak memory beside the planner's prediction of the same
    layout and runtime; the report's files, and the kernel profile's summary where one was taken."""
    timed = [r for r in parsed["iterations"] if r["iteration"] > req["warmup_iters"]]
    if not timed:
        raise ToolError("runtime", "the benchmark logged no timed iteration", where=result["log"],
                        fix="raise timed_iters, or read the log")
    lay_json = result["layout"]
    world = lay_json["world_size"]
    iter_ms = statistics.median(r["iter_ms"] for r in timed)
    tokens = lay_json["gbs"] * lay_json["seq_length"] / (iter_ms / 1e3)
    tflops = statistics.median(r["tflops_per_gpu"] for r in timed if "tflops_per_gpu" in r)
    mem = parsed["memory"]
    max_alloc = max((m["max_allocated_mb"] for m in mem.values()), default=0.0) / 1024
    lay = Layout.from_json(lay_json)
    te = have_transformer_engine()
    opts = RuntimeOptions.from_request(req.get("runtime"), te=te, moe=req.get("moe"),
                                       megatron=req.get("megatron_options"))
    padded = padded_vocab_size(model.vocab_size, lay.tp)
    pred = predict(model, gpu, lay, padded, opts)
    pred_alloc = peak(pred.memory, "allocated") / GIB
    head = "fused" if opts.fused_head and not model.mtp_num_layers and fused_head_runs(
        lay.mbs * lay.seq_length / lay.cp, model.hidden_size, padded / lay.tp) else "megatron"
    out = {
        "run_id": run_id, "run_dir": result["run_dir"], "gpu": gpu.key, "num_gpus": world,
        "model": model.summary(), "label": lay.label(), "layout": lay_json,
        "runtime": None if te else opts.to_json(), "output_head": head,
        "measured": {"iter_ms": round(iter_ms, 1), "tokens_per_s": round(tokens), "tokens_per_s_per_gpu": round(tokens / world),
                     "tflops_per_gpu": round(tflops, 1), "mfu": round(tflops / gpu.bf16_dense_tflops, 4),
                     "max_allocated_gib": round(max_alloc, 2),
                     "max_reserved_gib": round(max((m["max_reserved_mb"] for m in mem.values()), default=0.0) / 1024, 2),
                     "final_loss": timed[-1].get("loss")},
        "predicted": {"iter_ms": round(pred.time.total * 1e3, 1), "tokens_per_s": round(pred.tokens_per_s),
                      "tflops_per_gpu": round(pred.tflops_per_gpu, 1), "mfu": round(pred.mfu, 4),
                      "allocated_gib": round(pred_alloc, 2)},
        "loss_curve": [[r["iteration"], r.get("loss")] for r in parsed["iterations"]],
    }
    out["error_pct"] = {"tokens_per_s": error_pct(pred.tokens_per_s, tokens),
                        "memory": error_pct(pred_alloc, max_alloc) if max_alloc else None}
    out["files"] = _write_reports(out, Path(result["run_dir"]), parsed)
    profile_path = Path(result["run_dir"]) / "profile.json"
    if req["profile"] and profile_path.exists():
        prof = json.loads(profile_path.read_text())
        out["profile"] = {"gpu_ms": prof["gpu_ms"], "by_family": prof["by_family"],
                          "top_kernels": prof["top_kernels"][:5]}
        out["files"].append(str(profile_path))
    return out


def _fake_rank_result(req: dict, result: dict, parsed: dict, model, gpu, run_id: str) -> dict[str, Any]:
    """One rank of a larger layout, run alone: its peak memory against the planner's for its
    pipeline stage.  No NCCL buffers exist in a fake process group, and the planner's
    allocated figure leaves them out too (they are in its allowance, outside the allocator)."""
    lay_json = result["layout"]
    lay = Layout.from_json(lay_json)
    rank = fake_rank(req["fake_rank"], lay)
    mem = parsed["memory"].get(rank)
    if not mem:
        raise ToolError("runtime", f"rank {rank} reported no memory", where=result["log"],
                        fix="read the log: the run may have failed before its first iteration")
    stage = pipeline_stage(rank, lay)
    opts = RuntimeOptions.from_request(req.get("runtime"), te=have_transformer_engine(), moe=req.get("moe"),
                                  megatron=req.get("megatron_options"))
    pred = stage_memory(model, lay, stage, padded_vocab_size(model.vocab_size, lay.tp), opts.memory(lay))
    measured = mem["max_allocated_mb"] / 1024
    out = {"run_id": run_id, "run_dir": result["run_dir"], "gpu": gpu.key, "num_gpus": lay.world_size,
           "model": model.summary(), "label": lay.label(), "layout": lay_json,
           "fake_rank": rank, "pipeline_stage": stage,
           "measured": {"max_allocated_gib": round(measured, 2),
                        "max_reserved_gib": round(mem["max_reserved_mb"] / 1024, 2)},
           "predicted": {"allocated_gib": round(pred.allocated / GIB, 2), "stage": pred.to_json()},
           "error_pct": {"memory": error_pct(pred.allocated / GIB, measured)},
           "note": "one rank under a fake process group: memory only (collectives skipped, no NCCL buffers)"}
    run_dir = Path(result["run_dir"])
    (run_dir / "bench.json").write_text(json.dumps(out, indent=1))
    out["files"] = [str(run_dir / "bench.json")]
    return out


def _write_reports(out: dict, run_dir: Path, parsed: dict) -> list[str]:
    (run_dir / "bench.json").write_text(json.dumps(out, indent=1))
    m, p = out["measured"], out["predicted"]
    md = [f"# bench {out['run_id']}: {out['model']['name']} on {out['num_gpus']} x {out['gpu']}, {out['label']}",
          "", "| | measured | predicted | error |", "|---|---|---|---|",
          f"| tokens/s | {m['tokens_per_s']:,} | {p['tokens_per_s']:,} | {out['error_pct']['tokens_per_s']} % |",
          f"| TFLOP/s/GPU | {m['tflops_per_gpu']} | {p['tflops_per_gpu']} | |",
          f"| MFU | {m['mfu']:.1%} | {p['mfu']:.1%} | |",
          f"| peak allocated GiB | {m['max_allocated_gib']} | {p['allocated_gib']} | {out['error_pct']['memory']} % |", ""]
    (run_dir / "bench.md").write_text("\n".join(md))
    files = [str(run_dir / "bench.json"), str(run_dir / "bench.md")]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        its = parsed["iterations"]
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        ax[0].plot([r["iteration"] for r in its], [r.get("tflops_per_gpu", 0) for r in its], marker=".")
        ax[0].set(xlabel="iteration", ylabel="TFLOP/s/GPU", title="throughput")
        ax[1].plot([r["iteration"] for r in its], [r.get("loss") for r in its], marker=".")
        ax[1].set(xlabel="iteration", ylabel="lm loss", title="loss")
        fig.suptitle(f"{out['model']['name']} {out['label']} on {out['gpu']}")
        fig.tight_layout()
        fig.savefig(run_dir / "bench.png", dpi=100)
        files.append(str(run_dir / "bench.png"))
    except ImportError:
        pass
    return files


TOOL = Tool(name="bench", summary="Measure tokens/s, TFLOP/s/GPU, MFU and peak memory of a configuration "
                     "on the GPUs here, beside the planner's prediction; or calibrate the planner.", run=run)
