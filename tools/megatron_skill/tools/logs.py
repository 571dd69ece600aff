"""The logs tool: a Megatron training log summarised, with the known failures explained."""
from __future__ import annotations

import stat
import time
from pathlib import Path
from typing import Any, Iterator

from ..adapter import log as megatron_log
from ..contract import Context, Tool
from ..core.catalog import get_gpu
from ..errors import ToolError

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
    try:
        parsed = megatron_log.parse(read_lines(path, ctx))
    except OSError as e:
        raise ToolError("not_found", f"cannot read {path}: {e.strerror}", where="/log", fix=fix) from None
    # The log's own argument dump gives the sequence length and layout; flags only override.
    dumped = parsed.get("arguments", {})
    seq = req.get("seq_length") or (dumped.get("seq_length") if isinstance(dumped.get("seq_length"), int) else None)
    summary = megatron_log.summarize(parsed, seq, peak)
    if dumped:
        summary["arguments"] = dumped
    if not summary.get("logged_iterations") and not summary.get("failures"):
        raise ToolError("invalid_script", f"no Megatron iteration lines in {path}", where="/log",
                        fix="give the log of a Megatron run with --log-interval set (and --log-throughput for TFLOP/s)")
    curve = summary.get("loss_curve", [])
    if len(curve) > req["max_points"]:
        step = len(curve) / req["max_points"]
        summary["loss_curve"] = [curve[int(i * step)] for i in range(req["max_points"])] + [curve[-1]]
        summary["lr_curve"] = summary.get("lr_curve", [])[:: max(1, int(step))]
    hints = [f"{f['code']}: {f['meaning']} -> {f['fix']}" for f in summary.get("failures", [])]
    for a in summary.get("anomalies", []):
        if a["kind"] == "loss_spike":
            hints.append(f"loss spike at iteration {a['iteration']} ({a['before']:.3g} -> {a['loss']:.3g}): "
                         "lower the learning rate or raise warm-up; check the data around that step")
        elif a["kind"] == "nan":
            hints.append("NaN loss: lower the learning rate, check --clip-grad, and the data; with FP8 try BF16")
        elif a["kind"] == "grad_norm_spike":
            hints.append(f"grad-norm spike at iteration {a['iteration']} ({a['before']:.3g} -> {a['grad_norm']:.3g}): "
                         "watch the loss after it; keep --clip-grad 1.0, lower the learning rate if spikes repeat")
        elif a["kind"] == "divergence":
            hints.append(f"loss rising at the end (best {a['best']:.3g}, now {a['loss']:.3g}): lower the learning "
                         "rate or resume from an earlier checkpoint")
    summary["hints"] = hints
    if req.get("plot"):
        summary["plot"] = _plot(parsed, Path(req["plot"]))
    ctx.progress(f"logs: {summary.get('logged_iterations', 0)} iterations, final loss {summary.get('final_loss')}, "
                 f"{len(hints)} hint(s)")
    return summary


def _plot(parsed: dict, out: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    its = parsed["iterations"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot([r["iteration"] for r in its if "loss" in r], [r["loss"] for r in its if "loss" in r])
    ax[0].set(xlabel="iteration", ylabel="lm loss")
    timed = [r for r in its if "tflops_per_gpu" in r]
    ax[1].plot([r["iteration"] for r in timed], [r["tflops_per_gpu"] for r in timed])
    ax[1].set(xlabel="iteration", ylabel="TFLOP/s/GPU")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return str(out)


TOOL = Tool(name="logs", summary="Summarise a Megatron training log: loss curve, speed, MFU, memory, "
                     "NaN / skipped iterations, and OOM, NCCL and divergence with hints.", run=run)
