"""Why a logged run is slow: its measured speed against the planner's prediction for the log's own
arguments, and each lever with its predicted gain, biggest first (logs' `why_slow`).

A lever's gain is the planner's ratio of the step as run to the step with that lever alone,
applied to the measured speed; levers overlap, so their gains do not add up. The slower attention
kernels a stock script asks for are costed by the step-time model (core/attention_kernels.py),
but from a count of their bytes and FLOPs, not calibrated on GPUs: where a run has such a kernel,
the part of the measured step that the prediction misses is put on it, up to MAX_COUNT_SCALE
times its count; what is left is spread over the whole step (every variant scaled by the same
ratio) and said to be unexplained where it is more than 15 %.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from ..core.attention_kernels import PLANNED
from ..core.catalog import GPUSpec, get_gpu
from ..core.flops import padded_vocab_size
from ..core.layout import RULES, Layout, broken_rules
from ..core.memory import GIB, MemoryOptions, memory_report, peak
from ..core.model import ModelConfig
from ..core.options import RuntimeOptions
from ..core.planner import error_pct, predict
from . import described

# How far the slow kernels may fall behind their count before the rest of a gap is called
# unexplained: kernels at a quarter of the HBM roofline, which is where torch's separate
# element-wise kernels over large tensors land at worst.
MAX_COUNT_SCALE = 4.0
UNEXPLAINED = 0.15      # a measured step this far from the prediction (after attribution) is said to be
MIN_GAIN = 0.02         # a lever that gains less is not worth its change
# The layout rules Megatron itself asserts before a run's first step: a log whose arguments break
# one was damaged or edited, and its prediction would be of no run (the planner's own preferences,
# such as TP inside a node, are not among them).
MEGATRON_REFUSES = ("tp_heads", "tp_query_groups", "ep_experts", "pp_layers", "gbs_divisible")


@dataclasses.dataclass(frozen=True)
class _Variant:
    """One way to run the log's model: the layout, the runtime paths (the attention kernel among
    them) and the memory options."""
    lay: Layout
    opts: RuntimeOptions
    mem: MemoryOptions


def _cost(model: ModelConfig, gpu: GPUSpec, v: _Variant) -> tuple[float, float, float]:
    """(the step's seconds with the planned attention kernel, what the variant's slower kernel
    adds to them, the predicted peak GiB)."""
    padded = padded_vocab_size(model.vocab_size, v.lay.tp)
    mem = memory_report(model, v.lay, padded, v.mem)
    c = predict(model, gpu, v.lay, padded, v.opts, mem)
    if v.opts.attention_kernel == PLANNED:
        return c.time.total, 0.0, c.peak_gib
    planned = predict(model, gpu, v.lay, padded, dataclasses.replace(v.opts, attention_kernel=PLANNED), mem)
    return planned.time.total, c.time.total - planned.time.total, c.peak_gib


def why_slow(dumped: dict, gpu_name: str | None, summary: dict) -> dict[str, Any] | None:
    """The why_slow section of a log's summary, or None where the log has no speed to explain."""
    if not summary.get("tokens_per_s") or not summary.get("iter_ms_median"):
        return None
    if not gpu_name:
        return {"skipped": "name the GPU the run used (gpu) to compare its speed with the planner's prediction"}
    gpu = get_gpu(gpu_name, where="/gpu")
    ns, model, lay, assumed, why = described.logged_run(dumped)
    if model is None:
        return {"skipped": why}
    refused = [r for r in broken_rules(lay, model, gpu, lay.world_size, te=described.transformer_engine(ns))
               if r in MEGATRON_REFUSES]
    if refused:
        return {"skipped": "these arguments describe no run Megatron starts: "
                           + "; ".join(RULES[r].message for r in refused)}
    if lay.sequence_parallel and lay.tp == 1:
        lay = dataclasses.replace(lay, sequence_parallel=False)
    as_run = _Variant(lay, described.runtime_options(ns), described.memory_options(ns, lay, assumed))
    try:
        base, extra, _ = _cost(model, gpu, as_run)
    except (ZeroDivisionError, ValueError) as e:
        return {"skipped": f"the log's layout cannot be costed: {e}"}
    out = _as_run(ns, as_run, gpu, base + extra, summary)
    if assumed:
        out["assumed"] = assumed
    scale, ratio = _attribute(out, base, extra, summary["iter_ms_median"] / 1e3, described.attention_name(ns))
    out["levers"], out["not_levers"] = _lever_table(model, gpu, as_run, ns, summary["iter_ms_median"] / 1e3,
                                                    lambda b, e: (b + e * scale) * ratio)
    if abs(ratio - 1) > UNEXPLAINED:
        out["unexplained"] = (f"the measured step is {ratio:.2f}x the prediction for these very arguments"
                              + (" after the attention's share" if "attributed" in out else "") + ": beyond the "
                              "levers, look at the data loader, the host (CPU threads, Python, kernel launches of a "
                              "small model), clocks and other jobs on the GPUs, or a GPU other than the one named; "
                              "the gains assume the gap stays in proportion")
    out["note"] = ("each lever alone, the rest of the run as it is; levers overlap, so their gains do not add up "
                   "('launch.py plan' for this model and GPUs gives them all at once)")
    return out


def _as_run(ns: Any, run: _Variant, gpu: GPUSpec, step: float, summary: dict) -> dict[str, Any]:
    """The measured and predicted speed of the run as its arguments say it ran."""
    tokens = run.lay.gbs * run.lay.seq_length
    path_why = described.attention_path(ns)[1]
    attention = described.attention_name(ns)
    return {"gpu": gpu.key, "measured_tokens_per_s": summary["tokens_per_s"],
            "measured_step_ms": summary["iter_ms_median"],
            "predicted_tokens_per_s": round(tokens / step), "predicted_step_ms": round(step * 1e3, 1),
            "prediction_error_pct": error_pct(tokens / step, summary["tokens_per_s"]),
            "as_run": {"layout": run.lay.label(), "transformer_engine": run.opts.te, "attention": attention,
                       "attention_why": path_why + (" with the dataloader's explicit mask (the whole square)"
                                                    if attention == "sdpa_masked" else ""),
                       "attention_extra_ms": None,
                       # the fused paths on or off (the settings of a path, sdpa_backend and fp8_scaling, are not paths)
                       "skill_paths": {k: v for k, v in run.opts.to_json().items() if isinstance(v, bool)}}}


def _attribute(out: dict, base: float, extra: float, measured: float, attention: str) -> tuple[float, float]:
    """(the factor on the slow kernel's count, the ratio left over the whole step): what the
    prediction misses is put on the slow kernel first, up to MAX_COUNT_SCALE times its count."""
    out["as_run"]["attention_extra_ms"] = round(extra * 1e3, 1)
    residual = measured - (base + extra)
    attributed = min(max(residual, 0.0), (MAX_COUNT_SCALE - 1) * extra)
    scale = 1 + attributed / extra if extra > 0 else 1.0
    if attributed > 0:
        out["attributed"] = (f"{attributed * 1e3:,.0f} of the {residual * 1e3:,.0f} ms a step that the prediction "
                             f"misses put on the {attention} attention, the one cost here counted rather than "
                             f"calibrated on GPUs (x{scale:.2f} its count: {extra * scale * 1e3:,.0f} ms a step)")
    return scale, measured / (base + extra * scale)


def _lever_table(model: ModelConfig, gpu: GPUSpec, run: _Variant, ns: Any, measured: float,
                 expected) -> tuple[list[dict], list[dict]]:
    """The levers worth pulling, biggest gain first, and those that are not, with why."""
    tokens = run.lay.gbs * run.lay.seq_length
    levers, not_levers = [], []
    for name, variant, fix in _levers(model, gpu, run, ns):
        try:
            v_base, v_extra, p = _cost(model, gpu, variant)
        except (ZeroDivisionError, ValueError) as e:
            not_levers.append({"lever": name, "why": f"cannot be costed: {e}"})
            continue
        if p > gpu.memory_gib:
            not_levers.append({"lever": name, "why": f"predicted {p:.1f} GiB per GPU, more than {gpu.key}'s "
                                                     f"{gpu.memory_gib} GiB"})
            continue
        t = expected(v_base, v_extra)
        gain = measured / t - 1
        if gain < MIN_GAIN:
            not_levers.append({"lever": name, "why": f"predicted gain {gain * 100:+.0f} %: not worth it here"})
            continue
        levers.append({"lever": name, "gain_pct": round(gain * 100, 1), "tokens_per_s": round(tokens / t),
                       "predicted_peak_gib": round(p, 1), "fix": fix})
    levers.sort(key=lambda x: -x["gain_pct"])
    return levers, not_levers


def _levers(model: ModelConfig, gpu: GPUSpec, run: _Variant, ns: Any) -> Iterator[tuple[str, _Variant, str]]:
    """(lever, the run with only that lever changed, the fix in Megatron's flags) for each lever
    that this run does not pull yet."""
    yield from _kernel_levers(run, ns)
    yield from _layout_levers(model, gpu, run)
    yield from _precision_levers(gpu, run)


def _kernel_levers(run: _Variant, ns: Any) -> Iterator[tuple[str, _Variant, str]]:
    """The attention kernel, the skill's fused paths, Transformer Engine's layers."""
    lay, opts = run.lay, run.opts
    planned = dataclasses.replace(opts, attention_kernel=PLANNED)
    if opts.attention_kernel.kind == "unfused":
        yield ("fused attention instead of the unfused DotProductAttention, which writes and reads the whole "
               f"S x S score matrix ({lay.seq_length}^2 per head) several times",
               dataclasses.replace(run, opts=planned, mem=dataclasses.replace(run.mem, score_bytes=0.0)),
               "run the skill's entry script (tools/pretrain_gpt.py: torch SDPA, causal kernel) with "
               "--no-create-attention-mask-in-dataloader, or Transformer Engine's layers (--transformer-impl "
               "transformer_engine) with flash attention")
    elif opts.attention_kernel.kind == "sdpa_masked":
        yield ("causal attention kernel instead of SDPA over the dataloader's explicit mask (the whole square)",
               dataclasses.replace(run, opts=planned), "add --no-create-attention-mask-in-dataloader")
    if opts.te:
        return
    skill = RuntimeOptions.from_request(None, te=False)
    skill = dataclasses.replace(skill, moe=opts.moe, megatron=opts.megatron, fp8_linear=opts.fp8_linear)
    if skill != planned:   # (the mask alone is the lever above)
        yield ("the skill's fused paths for the local layers (SDPA causal attention, fused output layer + "
               "cross-entropy, fused weight-gradient accumulation, fused AdamW, compiled RoPE, native GQA)",
               _Variant(lay, skill, skill.memory(lay)),
               "launch the skill's tools/pretrain_gpt.py with --no-create-attention-mask-in-dataloader "
               + " ".join(skill.entry_flags()) + " (what 'launch.py render' writes without TE)")
    te = dataclasses.replace(planned, te=True)
    fix = "--transformer-impl transformer_engine where TE is installed (NGC's PyTorch container has it)"
    # TE trains in FP8 where --fp8-format asks (Megatron's local layers ignore it); the skill's
    # FP8 layers are local ones, so their run asks TE for FP8 by TE's own flags
    asks_fp8 = bool(getattr(ns, "fp8", None))
    te_lay = dataclasses.replace(lay, precision="fp8") if asks_fp8 else lay
    if lay.precision == "fp8" and not asks_fp8:
        fix += ", with --fp8-format hybrid --fp8-recipe tensorwise in place of --skill-fp8-linear"
    yield ("Transformer Engine's layers (fused kernels, flash attention, TP communication overlap)",
           _Variant(te_lay, te, te.memory(te_lay)), fix)


def _fits(model: ModelConfig, gpu: GPUSpec, lay: Layout, mem: MemoryOptions) -> bool:
    return peak(memory_report(model, lay, padded_vocab_size(model.vocab_size, lay.tp), mem)) / GIB <= gpu.memory_gib


def _layout_levers(model: ModelConfig, gpu: GPUSpec, run: _Variant) -> Iterator[tuple[str, _Variant, str]]:
    """A larger micro-batch (the largest that fits), lighter recompute."""
    lay, opts = run.lay, run.opts
    larger = [dataclasses.replace(lay, mbs=m) for m in (2, 4, 8, 16, 32) if m > lay.mbs and lay.gbs % (m * lay.dp) == 0]
    larger = [c for c in larger if not any(True for _ in broken_rules(c, model, gpu, c.world_size, te=opts.te,
                                                                      moe=opts.moe))]
    fitting = [c for c in larger if _fits(model, gpu, c, run.mem)]
    chosen = fitting[-1] if fitting else (larger[0] if larger else None)
    if chosen is not None:
        yield (f"micro-batch {chosen.mbs} instead of {lay.mbs} (larger kernels, fewer steps of per-micro-batch "
               "work)", dataclasses.replace(run, lay=chosen),
               f"--micro-batch-size {chosen.mbs} (the global batch stays {lay.gbs})")
    if lay.recompute == "none":
        return
    for lighter in ("none", "selective"):
        if lighter == lay.recompute:
            break
        cand = dataclasses.replace(lay, recompute=lighter, recompute_layers=0)
        if _fits(model, gpu, cand, run.mem):
            yield (f"{'no' if lighter == 'none' else 'selective'} recompute instead of {lay.recompute}",
                   dataclasses.replace(run, lay=cand),
                   "drop --recompute-granularity and its --recompute-* flags" if lighter == "none" else
                   "--recompute-granularity selective (drop --recompute-method / --recompute-num-layers)")
            break


def _precision_levers(gpu: GPUSpec, run: _Variant) -> Iterator[tuple[str, _Variant, str]]:
    """FP8 GEMMs: TE's, or the skill's FP8 linear layers at TP 1 without TE."""
    lay, opts = run.lay, run.opts
    if lay.precision == "fp8" or not gpu.supports_fp8:
        return
    cand = dataclasses.replace(lay, precision="fp8")
    if opts.te:
        tensorwise = dataclasses.replace(opts, te_fp8_delayed=False)   # the recipe the fix names
        yield ("FP8 GEMMs (Transformer Engine)", dataclasses.replace(run, lay=cand, mem=tensorwise.memory(cand)),
               "--fp8-format hybrid --fp8-recipe tensorwise (check the loss against BF16 over a few hundred steps)")
    elif lay.tp == 1:
        fp8 = dataclasses.replace(opts, fp8_linear=True)
        yield ("FP8 linear layers (the skill's entry, no TE)",
               dataclasses.replace(run, lay=cand, opts=fp8, mem=dataclasses.replace(run.mem, fp8_linear=True)),
               "--skill-fp8-linear with the skill's tools/pretrain_gpt.py (check the loss against BF16)")
