"""What the planner's time figures rest on, and how far to trust them.

Two kinds of evidence: the calibration of the GPU type (catalog/calibration.json: measured on
that GPU, or assumed), and published multi-GPU runs (catalog/published_runs.json), each costed
with its exact layout here and compared with what its publisher measured. A forecast carries
the error band of the published runs of its kind (dense or mixture-of-experts) and says where
it reaches beyond them (another GPU type, a larger cluster, a precision no run used).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import statistics
from typing import Any

from .attention_kernels import AttentionKernel
from .catalog import CATALOG_DIR, get_gpu, get_model
from .flops import padded_vocab_size
from .layout import Layout, check_layout
from .model import ModelConfig
from .options import RuntimeOptions


def published_runs() -> list[dict[str, Any]]:
    return json.loads((CATALOG_DIR / "published_runs.json").read_text())["runs"]


def run_layout(run: dict[str, Any], model: ModelConfig) -> Layout:
    """The run's layout: its own layout string where it gave one, else an even split (counting
    the embedding and the loss as layers where the layers alone do not divide). Sequence
    parallel wherever TP > 1 and the distributed optimizer, unless the row says otherwise; a full
    recompute takes every layer of each chunk unless recompute_layers says how many."""
    dp = run["num_gpus"] // (run["tp"] * run["pp"] * run["cp"])
    if run.get("pipeline_layout"):
        split = {"pipeline_split": "layout", "pipeline_layout": run["pipeline_layout"]}
    else:
        split = {"pipeline_split": "even" if model.num_layers % run["pp"] == 0 else "embedding_loss"}
    lay = Layout(tp=run["tp"], pp=run["pp"], cp=run["cp"], vp=run["vp"], ep=run["ep"], dp=dp, mbs=run["mbs"],
                 gbs=run["gbs"], seq_length=run["seq_length"], precision=run["precision"],
                 sequence_parallel=run.get("sequence_parallel", run["tp"] > 1), recompute=run.get("recompute", "none"),
                 distributed_optimizer=run.get("distributed_optimizer", True), **split)
    if lay.recompute == "full":
        lay = lay.but(recompute_layers=run.get("recompute_layers") or max(lay.chunk_sizes(model.num_layers) or [1]))
    return lay


def run_options(run: dict[str, Any]) -> RuntimeOptions:
    """The runtime the run's software was: Transformer Engine's layers unless the row says not,
    the MoE and Megatron options its recipe set, and the core-attention kernel it names."""
    # A run without TE ran Megatron's own local layers: its output layer and loss, not the
    # skill's fused head (the skill's other fused paths stand in for the fused kernels of the
    # run's own Megatron: apex's wgrad accumulation, compiled element-wise work)
    opts = RuntimeOptions.from_request({"linear_cross_entropy": False}, te=run.get("transformer_engine", True),
                                       moe=run.get("moe"), megatron=run.get("megatron_options"))
    if run.get("attention_kernel"):
        opts = dataclasses.replace(opts, attention_kernel=AttentionKernel(**run["attention_kernel"]))
    return opts


def compare(run: dict[str, Any]) -> dict[str, Any]:
    """One published run beside the planner's prediction for its exact layout: the error in
    tokens/s per GPU, or in TFLOP/s per GPU where only that was published."""
    from .planner import error_pct, predict

    model, gpu = get_model(run["model"]), get_gpu(run["gpu"])
    lay = run_layout(run, model)
    opts = run_options(run)
    rule = check_layout(lay, model, gpu, run["num_gpus"], opts.te, opts.moe, opts.megatron)
    if rule:   # a published run is a layout Megatron ran: one the rule book refuses is a catalog error
        raise ValueError(f"published run {run['model']} ({run['source']}): its layout breaks {rule}")
    c = predict(model, gpu, lay, padded_vocab_size(model.vocab_size, lay.tp), opts)
    if run.get("tokens_per_s_per_gpu"):
        predicted, measured, metric = c.tokens_per_s / lay.world_size, run["tokens_per_s_per_gpu"], "tokens/s/GPU"
    else:
        predicted, measured, metric = c.tflops_per_gpu, run["tflops_per_gpu"], "TFLOP/s/GPU"
    return {"layout": lay.label(), "metric": metric, "published": measured, "predicted": predicted,
            "error_pct": error_pct(predicted, measured), "moe": model.is_moe, "peak_gib": c.peak_gib,
            "fits": c.peak_gib <= gpu.memory_gib}


@functools.lru_cache(maxsize=1)
def checked() -> tuple[dict[str, Any], ...]:
    return tuple({**run, **compare(run)} for run in published_runs())


def band_runs(moe: bool, arch: str, leave_out: dict[str, Any] | None = None) -> tuple[list, list, bool]:
    """The published runs a forecast's band rests on: those of its kind (dense or MoE), on GPUs of
    its architecture where any was checked; `leave_out` drops one (to check a band on a run it was
    not built from). Returns (the band's runs, every run of the kind, whether the architecture matched)."""
    # rows whose publisher left part of the layout unstated are shown, not used as evidence
    kind = [r for r in checked() if r["moe"] == moe and r.get("layout_complete", True) and r is not leave_out]
    same_arch = [r for r in kind if get_gpu(r["gpu"]).arch == arch]
    return same_arch or kind, kind, bool(same_arch)


def band(errors: list[float]) -> tuple[float, float]:
    """The error band a forecast carries, from the errors of the published runs like it: as wide
    as the largest of them either way (a new run's sign is not known), widened by their spread.
    Built without one run at a time, it held that run's published figure for 105 of 106 runs
    (benchmarks/published_runs.py, band_holds_leave_one_out; 104 of 106 before the last re-fit,
    88 of the first 90, 71 of the first 73, 50 of the first 53; 19 of the first 21, where the
    runs' own [min, max] held 13)."""
    reach = max(map(abs, errors)) + statistics.pstdev(errors)
    return -reach, reach


def forecast(model: ModelConfig, gpu_key: str, lay: Layout, calibration_status: str) -> dict[str, Any]:
    """The error band of the published runs like this forecast (dense or MoE; on GPUs of the same
    architecture where any was checked), and where the forecast goes beyond them."""
    arch = get_gpu(gpu_key).arch
    runs, kind, same_arch = band_runs(model.is_moe, arch)
    errors = [r["error_pct"] for r in runs]
    beyond = []
    if not any(r["gpu"] == gpu_key for r in kind):
        beyond.append(f"no published {'MoE' if model.is_moe else 'dense'} run on {gpu_key} has been checked")
    if lay.world_size > max(r["num_gpus"] for r in kind):
        beyond.append(f"{lay.world_size:,} GPUs: more than any checked run ({max(r['num_gpus'] for r in kind):,})")
    if not any(r["precision"] == lay.precision for r in runs):   # the band's own runs: another GPU's say little
        beyond.append(f"no checked run in {lay.precision}" + (f" on {arch} GPUs" if same_arch else ""))
    if not calibration_status.startswith("measured"):
        beyond.append(f"{gpu_key}'s kernel rates are assumed, not measured (bench --calibrate measures them)")
    fitted = ("; the share of the GEMM rate TE reaches" + (", the dropless cost and the all-to-all overlap are"
                                                            if model.is_moe else " is") + " fitted to the H100 ones")
    lo, hi = band(errors)
    return {"error_band_pct": [round(lo, 1), round(hi, 1)], "checked_runs": len(runs),
            "basis": f"{len(runs)} published {'MoE' if model.is_moe else 'dense'} runs"
                     f"{' on ' + arch + ' GPUs' if same_arch else ''} costed with their own layouts "
                     f"(references/benchmarks.md){fitted}; {gpu_key}'s calibration: {calibration_status[:120]}",
            "beyond_evidence": beyond}
