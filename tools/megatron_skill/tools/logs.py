"""The logs tool: a Megatron training log summarised, with the known failures explained."""
from __future__ import annotations

import dataclasses
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from .. import files as guarded
from ..adapter import described, slow_run
from ..adapter import log as megatron_log
from ..contract import Context, Tool, invoke
from ..core.catalog import get_gpu
from ..core.flops import padded_vocab_size
from ..core.memory import GIB, memory_report, peak
from ..core.planner import error_pct
from ..errors import ToolError

# The model fields a plan request takes (schemas/common.json, model).
PLAN_MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "kv_channels", "vocab_size", "max_position_embeddings", "untie_embeddings_and_output_weights",
                     "activation", "normalization", "position_embedding_type", "add_bias_linear", "add_qkv_bias",
                     "qk_layernorm", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size", "moe_layer_freq", "multi_latent_attention", "q_lora_rank",
                     "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers")

MAX_LINE = 1 << 16  # characters of one line that are read; the rest of a longer line is skipped


def read_lines(path: Path, ctx: Context) -> Iterator[str]:
    """The lines of a regular file, streamed (a log can be larger than memory), each cut at
    MAX_LINE characters; progress on stderr for large files."""
    with open(path, encoding="utf-8", errors="replace") as f:
        size, shown = max(1, path.stat().st_size), time.time()
        while True:
            line = f.readline(MAX_LINE)
            if not line:
                return
            if not line.endswith("\n"):
                while (rest := f.readline(MAX_LINE)) and not rest.endswith("\n"):
                    pass  # the tail of an over-long line: nothing a log reader needs
            yield line.rstrip("\n")
            if time.time() - shown > 2:
                shown = time.time()
                ctx.progress(f"logs: {f.buffer.tell() / size:.0%} of {size / 2**20:,.0f} MiB read")


def run(req: dict, ctx: Context) -> dict[str, Any]:
    path = Path(req["log"])
    fix = "give the path of a Megatron training log (train writes RUN_DIR/logs/train.log)"
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise ToolError("bad_request", f"{path} is not a regular file (a pipe, device or folder)",
                            where="/log", fix=fix + "; save a stream to a file first")
    except OSError as e:
        raise ToolError("not_found", f"cannot read {path}: {e.strerror}", where="/log", fix=fix) from None
    peak = get_gpu(req["gpu"], where="/gpu").bf16_dense_tflops if req.get("gpu") else None
    plot = _plot_target(req["plot"]) if req.get("plot") else None   # before the log is read
    try:
        parsed = megatron_log.parse(read_lines(path, ctx))
    except OSError as e:
        raise ToolError("not_found", f"cannot read {path}: {e.strerror}", where="/log", fix=fix) from None
    # The log's own argument dump gives the sequence length and layout; flags only override.
    dumped, ignored = described.typed_arguments(parsed.get("arguments", {}))
    seq = req.get("seq_length") or dumped.get("seq_length")
    summary = megatron_log.summarize(parsed, seq, peak)
    if dumped:
        summary["arguments"] = {k: v for k, v in dumped.items() if k in megatron_log.ARGS_READ}
        summary["prediction"] = _prediction(dumped, req.get("gpu"), summary, ctx)
        slow = slow_run.why_slow(dumped, req.get("gpu"), summary)
        if slow is not None:
            summary["why_slow"] = slow
    if ignored:
        summary["arguments_ignored"] = ignored
    _stall(summary, path, dumped)
    if not summary.get("logged_iterations") and not summary.get("failures"):
        raise ToolError("invalid_script", f"no Megatron iteration lines in {path}", where="/log",
                        fix="give the log of a Megatron run with --log-interval set (and --log-throughput for TFLOP/s)")
    curve = summary.get("loss_curve", [])
    if len(curve) > req["max_points"]:
        step = len(curve) / req["max_points"]
        summary["loss_curve"] = [curve[int(i * step)] for i in range(req["max_points"])] + [curve[-1]]
        summary["lr_curve"] = summary.get("lr_curve", [])[:: max(1, int(step))]
    hints = _hints(summary)
    summary["hints"] = hints
    if plot is not None:
        summary["plot"] = _plot(parsed, plot)
    ctx.progress(f"logs: {summary.get('logged_iterations', 0)} iterations, final loss {summary.get('final_loss')}, "
                 f"{len(hints)} hint(s)")
    return summary


def _hints(summary: dict) -> list[str]:
    """One line of advice per failure, skipped step, anomaly and the three biggest speed levers."""
    hints = [f"{f['code']}: {f['meaning']} -> {f['fix']}" for f in summary.get("failures", [])]
    for f in summary.get("resumed_after", []):
        hints.append(f"resumed after {f['code']} (line {f['line']}, after iteration {f['after_iteration']}): the "
                     "same run started again; that failure ended an earlier start, not the run's state now")
    if summary.get("skipped_iterations"):
        hints.append(f"{summary['skipped_iterations']} iteration(s) skipped: Megatron drops a step whose gradients hold "
                     "NaN or Inf (and, with --check-for-nan-in-loss-and-grad, stops); a few early on are the loss "
                     "scale settling, a steady count is unstable training: lower the learning rate")
    fitting = (summary.get("prediction") or {}).get("plan")
    if fitting and any(f["code"] == "out_of_memory" for f in summary.get("failures", [])):
        hints.append(f"plan for this model on {fitting['num_gpus']} x {fitting['gpu']}: {fitting['label']} fits at "
                     f"{fitting['peak_gib']} GiB ('launch.py plan' with the same model gives the arguments)"
                     if "label" in fitting else f"plan for this model on these GPUs: {fitting['error']}")
    for a in summary.get("anomalies", []):
        if a["kind"] == "loss_spike":
            hints.append(f"loss spike at iteration {a['iteration']} ({a['before']:.3g} -> {a['loss']:.3g}): "
                         "lower the learning rate or raise warm-up; check the data around that step")
        elif a["kind"] == "nan":
            since = f" from iteration {a['iteration']} on" if a.get("iteration") is not None else ""
            hints.append(f"NaN loss{since} (the last finite loss: {summary.get('final_loss')} at iteration "
                         f"{summary.get('final_loss_iteration')}): lower the learning rate, check --clip-grad, and "
                         "the data; with FP8 try BF16")
        elif a["kind"] == "grad_norm_spike":
            hints.append(f"grad-norm spike at iteration {a['iteration']} ({a['before']:.3g} -> {a['grad_norm']:.3g}): "
                         "watch the loss after it; keep --clip-grad 1.0, lower the learning rate if spikes repeat")
        elif a["kind"] == "stalled":
            hints.append(f"no new line for {a['silent_s'] / 60:.0f} minutes after iteration {a['iteration']} (an "
                         f"iteration takes about {a['iteration_s']:.1f} s): the job may hang; look at its last lines "
                         "and at every rank (py-spy dump, NCCL_DEBUG=INFO)")
        elif a["kind"] == "divergence":
            hints.append(f"loss rising at the end (best {a['best']:.3g}, now {a['loss']:.3g}): lower the learning "
                         "rate or resume from an earlier checkpoint")
    slow = summary.get("why_slow") or {}
    for lever in slow.get("levers", [])[:3]:
        hints.append(f"slow: {lever['lever']}: about +{lever['gain_pct']:.0f} % tokens/s "
                     f"(to ~{lever['tokens_per_s']:,.0f}) -> {lever['fix']}")
    return hints


def _prediction(dumped: dict, gpu_name: str | None, summary: dict, ctx: Context) -> dict[str, Any] | None:
    """What the planner predicts for the log's own model and layout (read from its argument
    dump), beside what the log measured; where the GPU is named, plan's best layout for the
    same model and GPU count too."""
    ns, model, lay, assumed, why = described.logged_run(dumped)
    if model is None:
        return {"skipped": why}
    try:
        mem = memory_report(model, lay, padded_vocab_size(model.vocab_size, lay.tp), described.memory_options(ns, lay, assumed))
    except (ZeroDivisionError, ValueError) as e:
        return {"skipped": f"the log's layout cannot be costed: {e}"}
    size, source, read = described.vocabulary(ns)
    out: dict[str, Any] = {"layout": lay.label(), "predicted_peak_gib": round(peak(mem) / GIB, 2),
                           "assumed": assumed, "vocabulary": {"size": size, "source": source, "read": read}}
    if summary.get("max_allocated_gib"):
        out["measured_max_allocated_gib"] = summary["max_allocated_gib"]
        out["memory_error_pct"] = error_pct(peak(mem, "allocated") / GIB, summary["max_allocated_gib"])
    if gpu_name:
        out["gpu_gib"] = get_gpu(gpu_name, where="/gpu").memory_gib
        fields = {k: v for k, v in dataclasses.asdict(model).items() if k in PLAN_MODEL_FIELDS and v is not None}
        request = {"model": {"name": "the log's model", **fields}, "gpu": gpu_name, "num_gpus": lay.world_size,
                   "seq_length": lay.seq_length, "global_batch_size": lay.gbs, "top": 1,
                   "transformer_engine": described.transformer_engine(ns)}
        if lay.precision == "fp8" and get_gpu(gpu_name).supports_fp8:
            request["precision"] = "fp8"     # the log's own precision (TE's or the skill's FP8 layers)
        try:
            best = invoke("plan", request, ctx)
        except ToolError as e:
            out["plan"] = {"error": e.message}
        else:
            if best.get("plans"):
                p = best["plans"][0]
                out["plan"] = {"label": p["label"], "peak_gib": p["memory"]["peak_gib"], "gpu": gpu_name,
                               "num_gpus": lay.world_size, "tokens_per_s": p["tokens_per_s"]}
    return out


def _stall(summary: dict, path: Path, dumped: dict) -> None:
    """A job that stopped writing: no failure, not finished, and the log untouched for far longer
    than its logging interval takes (ten intervals, five minutes at least)."""
    if summary.get("state") != "stopped or running" or not summary.get("iter_ms_median"):
        return
    interval = summary["iter_ms_median"] / 1e3 * (dumped.get("log_interval") or 1)
    silent = time.time() - path.stat().st_mtime
    if silent > max(300.0, 10 * interval):
        summary["state"] = "stalled"
        summary.setdefault("anomalies", []).append(
            {"kind": "stalled", "iteration": summary["last_logged"]["iteration"], "silent_s": round(silent),
             "iteration_s": round(summary["iter_ms_median"] / 1e3, 2)})


def _plot_target(path: str) -> Path:
    """The plot's path, checked before any work: a new .png file (logs never replaces a file) in a
    folder that is one or can be made, with matplotlib importable to draw it."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ToolError("bad_request", f"{path}: the plot is written as PNG", where="/plot",
                        fix="give a path ending in .png")
    if guarded.kind_of(out) != "missing" or out.is_symlink():
        raise ToolError("conflict", f"{path} exists: logs writes its plot to a new file only", where="/plot",
                        fix="give a path where no file is (that one is left as it is)")
    guarded.output_folder(out.parent, "/plot", "plot's folder")
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise ToolError("environment", "matplotlib is not installed here: the plot cannot be drawn", where="/plot",
                        fix="pip install matplotlib, or leave plot out (the answer holds the loss curve)")
    return out


def _plot(parsed: dict, out: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    its = parsed["iterations"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot([r["iteration"] for r in its if "loss" in r], [r["loss"] for r in its if "loss" in r])
    ax[0].set(xlabel="iteration", ylabel="lm loss")
    timed = [r for r in its if "tflops_per_gpu" in r]
    ax[1].plot([r["iteration"] for r in timed], [r["tflops_per_gpu"] for r in timed])
    ax[1].set(xlabel="iteration", ylabel="TFLOP/s/GPU")
    fig.tight_layout()
    guarded.make_folder(out.parent, "/plot", "plot's folder")
    # drawn under a temporary name, then linked into place: a file that appeared there meanwhile stays
    fd, temp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
        os.link(temp, out)
    except FileExistsError:
        raise ToolError("conflict", f"{out} appeared while the plot was drawn: it is left as it is", where="/plot",
                        fix="give a path where no file is") from None
    except OSError as e:
        raise guarded.os_error(e, out, "/plot", "plot") from None
    finally:
        plt.close(fig)
        os.unlink(temp)
    return str(out)


TOOL = Tool(name="logs", summary="Summarise a Megatron training log: loss curve, speed, MFU, memory, "
                     "NaN / skipped iterations, and OOM, NCCL and divergence with hints.", run=run)
