"""The logs tool: a Megatron training log summarised, with the known failures explained."""
from __future__ import annotations

import dataclasses
import stat
import time
from pathlib import Path
from typing import Any, Iterator

from ..adapter import described
from ..adapter import log as megatron_log
from ..contract import Context, Tool, invoke
from ..core.catalog import GPUSpec, get_gpu
from ..core.flops import padded_vocab_size
from ..core.layout import Layout, broken_rules
from ..core.memory import GIB, MemoryOptions, memory_report, peak
from ..core.model import ModelConfig
from ..core.options import RuntimeOptions
from ..core.planner import error_pct, predict
from ..core.timing import StepTime, calibration
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
    try:
        parsed = megatron_log.parse(read_lines(path, ctx))
    except OSError as e:
        raise ToolError("not_found", f"cannot read {path}: {e.strerror}", where="/log", fix=fix) from None
    # The log's own argument dump gives the sequence length and layout; flags only override.
    dumped = parsed.get("arguments", {})
    seq = req.get("seq_length") or (dumped.get("seq_length") if isinstance(dumped.get("seq_length"), int) else None)
    summary = megatron_log.summarize(parsed, seq, peak)
    if dumped:
        summary["arguments"] = {k: v for k, v in dumped.items() if k in megatron_log.ARGS_READ}
        summary["prediction"] = _prediction(dumped, req.get("gpu"), summary, ctx)
        slow = why_slow(dumped, req.get("gpu"), summary)
        if slow is not None:
            summary["why_slow"] = slow
    _stall(summary, path, dumped)
    if not summary.get("logged_iterations") and not summary.get("failures"):
        raise ToolError("invalid_script", f"no Megatron iteration lines in {path}", where="/log",
                        fix="give the log of a Megatron run with --log-interval set (and --log-throughput for TFLOP/s)")
    curve = summary.get("loss_curve", [])
    if len(curve) > req["max_points"]:
        step = len(curve) / req["max_points"]
        summary["loss_curve"] = [curve[int(i * step)] for i in range(req["max_points"])] + [curve[-1]]
        summary["lr_curve"] = summary.get("lr_curve", [])[:: max(1, int(step))]
    hints = [f"{f['code']}: {f['meaning']} -> {f['fix']}" for f in summary.get("failures", [])]
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
            hints.append("NaN loss: lower the learning rate, check --clip-grad, and the data; with FP8 try BF16")
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
    summary["hints"] = hints
    if req.get("plot"):
        summary["plot"] = _plot(parsed, Path(req["plot"]))
    ctx.progress(f"logs: {summary.get('logged_iterations', 0)} iterations, final loss {summary.get('final_loss')}, "
                 f"{len(hints)} hint(s)")
    return summary


def _prediction(dumped: dict, gpu_name: str | None, summary: dict, ctx: Context) -> dict[str, Any] | None:
    """What the planner predicts for the log's own model and layout (read from its argument
    dump), beside what the log measured; where the GPU is named, plan's best layout for the
    same model and GPU count too."""
    ns = described.Args(dumped)
    assumed: dict[str, str] = {}
    model, why = described.model_from_args(ns, assumed)
    if model is None:
        return {"skipped": why}
    lay = described.layout_from_args(ns, model, None, assumed)
    try:
        mem = memory_report(model, lay, padded_vocab_size(model.vocab_size, lay.tp), described.memory_options(ns, assumed))
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
        request = {"model": {"name": "from the log", **fields}, "gpu": gpu_name, "num_gpus": lay.world_size,
                   "seq_length": lay.seq_length, "global_batch_size": lay.gbs, "top": 1,
                   "transformer_engine": described.transformer_engine(ns)}
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


# ---- why slow -------------------------------------------------------------------------
# The planner costs the attention kernels a run should use (TE's flash, or torch SDPA's causal
# kernel on the local layers). What slower attention a log's arguments show costs on top is
# counted here. Torch SDPA handed Megatron's explicit [s, s] mask runs the whole square with a
# slower kernel: on one H200 the 1B shape's attention took 995 ms an iteration with the mask and
# 338 ms with the causal kernel (references/benchmarks.md, "Throughput levers").
MASKED_SDPA_FACTOR = 995 / 338
# Megatron's local DotProductAttention (unfused) computes the whole [b, heads, s, s] score
# matrix with two batched GEMMs and passes over it in between. Bytes per score element,
# counted pass by pass in its 0.19 code: the GEMMs' own traffic (scores written, probabilities
# read forward; the probabilities' gradient written, the probabilities and the scores' gradient
# twice read backward) 12; the mask filled in place (read, write, mask) 5 and softmax (read,
# write) 4 forward, softmax's gradient (two reads, a write) 6, the mask's (5) and the scale's (4)
# backward: 24. Attention dropout adds its mask and output both ways (10); the softmax in fp32
# its casts and wider passes (12).
UNFUSED_GEMM_BYTES = 12
# How far the real kernels may fall behind that count before the rest of a gap is called
# unexplained: kernels at a quarter of the HBM roofline, which is where torch's separate
# element-wise kernels over large tensors land at worst.
MAX_COUNT_SCALE = 4.0
UNFUSED_PASS_BYTES = 24
UNFUSED_DROPOUT_BYTES = 10
UNFUSED_FP32_SOFTMAX_BYTES = 12


def unfused_attention_s(model: ModelConfig, gpu: GPUSpec, lay: Layout, fp32_softmax: bool, dropout: bool) -> float:
    """Seconds of one layer's unfused core attention, forward and backward, for one micro-batch:
    the score GEMMs over the whole square (at the calibrated GEMM rate, a head dimension's small
    K taken as the step-time model takes it) and the passes over the scores at the calibrated
    HBM rate."""
    cal = calibration(gpu.key)
    d = model.head_dim
    scores = lay.mbs * model.num_attention_heads / lay.tp * float(lay.seq_length) ** 2
    rate = gpu.bf16_dense_tflops * 1e12 * cal["gemm_bf16"] / (1 + cal["gemm_small_dim"] / d)
    hbm = gpu.hbm_gbps * 1e9 * cal["hbm"]
    gemm = max(3 * 2 * 2 * scores * d / rate, UNFUSED_GEMM_BYTES * scores / hbm)
    passes = UNFUSED_PASS_BYTES + UNFUSED_DROPOUT_BYTES * dropout + UNFUSED_FP32_SOFTMAX_BYTES * fp32_softmax
    return gemm + passes * scores / hbm


@dataclasses.dataclass(frozen=True)
class _Variant:
    """One way to run the log's model: the layout, the runtime paths, the attention kernel
    (flash, sdpa, sdpa_masked, unfused) and the memory options."""
    lay: Layout
    opts: RuntimeOptions
    attention: str
    mem: MemoryOptions


def _cost(model: ModelConfig, gpu: GPUSpec, v: _Variant, fp32_softmax: bool,
          dropout: bool) -> tuple[float, float, float]:
    """(the planner's seconds a step, what the variant's attention costs beyond the kernel the
    planner assumes, on every micro-batch and in the pipeline's bubble, the predicted peak GiB)."""
    padded = padded_vocab_size(model.vocab_size, v.lay.tp)
    c = predict(model, gpu, v.lay, padded, v.opts, memory_report(model, v.lay, padded, v.mem))
    return c.time.total, _attention_extra_s(model, gpu, v, c.time, fp32_softmax, dropout), c.peak_gib


def _attention_extra_s(model: ModelConfig, gpu: GPUSpec, v: _Variant, t: StepTime, fp32_softmax: bool,
                       dropout: bool) -> float:
    lay = v.lay
    m = lay.num_microbatches
    bubble = 1 + (lay.pp - 1) / (lay.vp * m)
    if v.attention == "sdpa_masked":
        return (MASKED_SDPA_FACTOR - 1) * t.attention * bubble
    if v.attention == "unfused":
        layers = -(-model.num_layers // lay.pp)
        return max(0.0, unfused_attention_s(model, gpu, lay, fp32_softmax, dropout) * layers * m - t.attention) * bubble
    return 0.0


def why_slow(dumped: dict, gpu_name: str | None, summary: dict) -> dict[str, Any] | None:
    """The measured speed against the planner's prediction for the log's own arguments, and each
    lever with its predicted gain, biggest first. A lever's gain is the planner's ratio of the
    step as run to the step with that lever alone, applied to the measured speed; levers overlap,
    so their gains do not add up ("best" is all of them at once: plan's best layout)."""
    ns = described.Args(dumped)
    if not summary.get("tokens_per_s") or not summary.get("iter_ms_median"):
        return None
    if not gpu_name:
        return {"skipped": "name the GPU the run used (gpu) to compare its speed with the planner's prediction"}
    gpu = get_gpu(gpu_name, where="/gpu")
    assumed: dict[str, str] = {}
    model, why = described.model_from_args(ns, assumed)
    if model is None:
        return {"skipped": why}
    lay = described.layout_from_args(ns, model, None, assumed)
    if lay.sequence_parallel and lay.tp == 1:
        lay = dataclasses.replace(lay, sequence_parallel=False)
    opts = described.runtime_options(ns)
    path, path_why = described.attention_path(ns)
    attention = "sdpa_masked" if path == "sdpa" and described.explicit_mask(ns) else path
    mem = described.memory_options(ns, assumed)
    fp32_softmax = bool(ns.attention_softmax_in_fp32 or ns.apply_query_key_layer_scaling)
    dropout = (ns.attention_dropout if ns.attention_dropout is not None else 0.1) > 0
    as_run = _Variant(lay, opts, attention, mem)
    try:
        base, extra, _ = _cost(model, gpu, as_run, fp32_softmax, dropout)
    except (ZeroDivisionError, ValueError) as e:
        return {"skipped": f"the log's layout cannot be costed: {e}"}
    step = base + extra
    measured = summary["iter_ms_median"] / 1e3
    tokens = lay.gbs * lay.seq_length
    out: dict[str, Any] = {
        "gpu": gpu.key, "measured_tokens_per_s": summary["tokens_per_s"], "measured_step_ms": summary["iter_ms_median"],
        "predicted_tokens_per_s": round(tokens / step), "predicted_step_ms": round(step * 1e3, 1),
        "prediction_error_pct": error_pct(tokens / step, summary["tokens_per_s"]),
        "as_run": {"layout": lay.label(), "transformer_engine": opts.te, "attention": attention,
                   "attention_why": path_why + (" with the dataloader's explicit mask (the whole square)"
                                                if attention == "sdpa_masked" else ""),
                   "attention_extra_ms": round(extra * 1e3, 1),
                   "skill_paths": {k: v for k, v in opts.to_json().items() if k != "sdpa_backend"}},
    }
    if assumed:
        out["assumed"] = assumed
    # The planner's costs are calibrated on GPUs; the slow attention's extra cost is only counted
    # here (a roofline count). Where a run has such a cost, the part of the measured step that
    # the prediction misses is put on it, up to MAX_COUNT_SCALE times its count; what is left is
    # spread over the whole step (every variant scaled by the same ratio) and said to be
    # unexplained where it is more than 15 %.
    residual = measured - step
    attributed = min(max(residual, 0.0), (MAX_COUNT_SCALE - 1) * extra)
    scale = 1 + attributed / extra if extra > 0 else 1.0
    ratio = measured / (base + extra * scale)
    if attributed > 0:
        out["attributed"] = (f"{attributed * 1e3:,.0f} of the {residual * 1e3:,.0f} ms a step that the prediction "
                             f"misses put on the {attention} attention, the one cost here counted rather than "
                             f"calibrated on GPUs (x{scale:.2f} its count: {extra * scale * 1e3:,.0f} ms a step)")

    def expected(v_base: float, v_extra: float) -> float:
        """The step a variant is expected to take on this machine."""
        return (v_base + v_extra * scale) * ratio

    levers, not_levers = [], []
    for name, variant, fix in _levers(model, gpu, as_run, ns):
        try:
            v_base, v_extra, p = _cost(model, gpu, variant, fp32_softmax, dropout)
        except (ZeroDivisionError, ValueError) as e:
            not_levers.append({"lever": name, "why": f"cannot be costed: {e}"})
            continue
        if p > gpu.memory_gib:
            not_levers.append({"lever": name, "why": f"predicted {p:.1f} GiB per GPU, more than {gpu.key}'s "
                                                     f"{gpu.memory_gib} GiB"})
            continue
        t = expected(v_base, v_extra)
        gain = measured / t - 1
        if gain < 0.02:
            not_levers.append({"lever": name, "why": f"predicted gain {gain * 100:+.0f} %: not worth it here"})
            continue
        levers.append({"lever": name, "gain_pct": round(gain * 100, 1), "tokens_per_s": round(tokens / t),
                       "predicted_peak_gib": round(p, 1), "fix": fix})
    levers.sort(key=lambda x: -x["gain_pct"])
    out["levers"] = levers
    out["not_levers"] = not_levers
    if abs(ratio - 1) > 0.15:
        out["unexplained"] = (f"the measured step is {ratio:.2f}x the prediction for these very arguments"
                              + (" after the attention's share" if attributed > 0 else "") + ": beyond the levers, "
                              "look at the data loader, the host (CPU threads, Python, kernel launches of a small "
                              "model), clocks and other jobs on the GPUs, or a GPU other than the one named; the "
                              "gains assume the gap stays in proportion")
    out["note"] = ("each lever alone, the rest of the run as it is; levers overlap, so their gains do not add up "
                   "('launch.py plan' for this model and GPUs gives them all at once)")
    return out


def _levers(model: ModelConfig, gpu: GPUSpec, run: _Variant, ns: Any) -> Iterator[tuple[str, _Variant, str]]:
    """(lever, the run with only that lever changed, the fix in Megatron's flags) for each lever
    that this run does not pull yet."""
    lay, opts = run.lay, run.opts
    if run.attention == "unfused":
        yield ("fused attention instead of the unfused DotProductAttention, which writes and reads the whole "
               f"S x S score matrix ({lay.seq_length}^2 per head) several times",
               dataclasses.replace(run, attention="sdpa", mem=dataclasses.replace(run.mem, score_bytes=0.0)),
               "run the skill's entry script (tools/pretrain_gpt.py: torch SDPA, causal kernel) with "
               "--no-create-attention-mask-in-dataloader, or Transformer Engine's layers (--transformer-impl "
               "transformer_engine) with flash attention")
    elif run.attention == "sdpa_masked":
        yield ("causal attention kernel instead of SDPA over the dataloader's explicit mask (the whole square)",
               dataclasses.replace(run, attention="sdpa"), "add --no-create-attention-mask-in-dataloader")
    if not opts.te:
        skill = RuntimeOptions.from_request(None, te=False)
        skill = dataclasses.replace(skill, moe=opts.moe, megatron=opts.megatron, fp8_linear=opts.fp8_linear)
        if skill != opts:   # (the mask alone is the lever above)
            yield ("the skill's fused paths for the local layers (SDPA causal attention, fused output layer + "
                   "cross-entropy, fused weight-gradient accumulation, fused AdamW, compiled RoPE, native GQA)",
                   _Variant(lay, skill, "sdpa", skill.memory(lay)),
                   "launch the skill's tools/pretrain_gpt.py with --no-create-attention-mask-in-dataloader "
                   + " ".join(skill.entry_flags()) + " (what 'launch.py render' writes without TE)")
        te = dataclasses.replace(opts, te=True)
        yield ("Transformer Engine's layers (fused kernels, flash attention, TP communication overlap)",
               _Variant(lay, te, "flash", te.memory(lay)),
               "--transformer-impl transformer_engine where TE is installed (NGC's PyTorch container has it)")
    padded = padded_vocab_size(model.vocab_size, lay.tp)
    larger = [dataclasses.replace(lay, mbs=m) for m in (2, 4, 8, 16, 32) if m > lay.mbs and lay.gbs % (m * lay.dp) == 0]
    larger = [c for c in larger if not any(True for _ in broken_rules(c, model, gpu, c.world_size, te=opts.te,
                                                                      moe=opts.moe))]
    fitting = [c for c in larger if peak(memory_report(model, c, padded, run.mem)) / GIB <= gpu.memory_gib]
    chosen = fitting[-1] if fitting else (larger[0] if larger else None)   # the largest that fits
    if chosen is not None:
        yield (f"micro-batch {chosen.mbs} instead of {lay.mbs} (larger kernels, fewer steps of per-micro-batch "
               "work)", dataclasses.replace(run, lay=chosen),
               f"--micro-batch-size {chosen.mbs} (the global batch stays {lay.gbs})")
    if lay.recompute != "none":
        for lighter in ("none", "selective"):
            if lighter == lay.recompute:
                break
            cand = dataclasses.replace(lay, recompute=lighter, recompute_layers=0)
            if peak(memory_report(model, cand, padded, run.mem)) / GIB <= gpu.memory_gib:
                yield (f"{'no' if lighter == 'none' else 'selective'} recompute instead of {lay.recompute}",
                       dataclasses.replace(run, lay=cand),
                       "drop --recompute-granularity and its --recompute-* flags" if lighter == "none" else
                       "--recompute-granularity selective (drop --recompute-method / --recompute-num-layers)")
                break
    if lay.precision != "fp8" and gpu.supports_fp8:
        cand = dataclasses.replace(lay, precision="fp8")
        if opts.te:
            yield ("FP8 GEMMs (Transformer Engine)", dataclasses.replace(run, lay=cand, mem=opts.memory(cand)),
                   "--fp8-format hybrid --fp8-recipe tensorwise (check the loss against BF16 over a few hundred steps)")
        elif lay.tp == 1:
            fp8 = dataclasses.replace(opts, fp8_linear=True)
            yield ("FP8 linear layers (the skill's entry, no TE)",
                   dataclasses.replace(run, lay=cand, opts=fp8, mem=dataclasses.replace(run.mem, fp8_linear=True)),
                   "--skill-fp8-linear with the skill's tools/pretrain_gpt.py (check the loss against BF16)")


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
