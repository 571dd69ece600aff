"""The validate tool: check a launch script (the skill's or anyone's) or a render request.

For a script: the Megatron argument vector is read out of it (script_args), then checked
for unknown and obsolete flags (each with its replacement or a "did you mean"), for values
Megatron's parser refuses, and for the combinations Megatron or the hardware reject: world
size against the parallel sizes, the divisibility rules, --tp-comm-overlap without
--sequence-parallel, --fp8-param-gather or --overlap-param-gather without the distributed
optimizer, FP8 before Hopper, TP without CUDA_DEVICE_MAX_CONNECTIONS=1, and a layout the
planner predicts will not fit in memory.  Every finding names its fix.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import stat
from pathlib import Path
from typing import Any

from . import megatron_args, megatron_flags, megatron_parser, script_args
from .catalog import get_gpu
from .contract import Context, Tool, register
from .errors import ToolError
from .flops import padded_vocab_size
from .layout import RULES, Layout, check_layout
from .memory import GIB, memory_report
from .model import build_spec

# Layout rules that validate reports with a fix of its own words.
RULE_FIXES = {
    "world_size": "make TP x PP x CP divide the number of GPUs the script starts (DP is what is left)",
    "tp_heads": "choose a TP that divides --num-attention-heads",
    "tp_query_groups": "choose a TP that divides --num-query-groups",
    "tp_within_nvlink": "keep TP within one node (8 GPUs on HGX); use PP or CP across nodes",
    "ep_experts": "choose an --expert-model-parallel-size that divides --num-experts",
    "ep_without_moe": "drop --expert-model-parallel-size for a dense model",
    "expert_folding": "make EP x expert-TP divide TP x CP x DP",
    "moe_needs_sp": "add --sequence-parallel (MoE with TP > 1 requires it)",
    "pp_layers": "choose a PP that divides --num-layers, or add --account-for-embedding-in-pipeline-split "
                 "--account-for-loss-in-pipeline-split, or set --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers",
    "vp_layers": "choose virtual stages that divide the layers per pipeline rank",
    "vp_needs_pp": "drop the virtual pipeline flags, or use PP > 1",
    "vp_microbatches": "make global batch / (micro-batch x DP) a multiple of PP",
    "cp_sequence": "make --seq-length divisible by 2 x CP",
    "gbs_divisible": "make --global-batch-size a multiple of --micro-batch-size x DP",
    "fp8_arch": "drop --fp8-format (FP8 needs Ada, Hopper or newer)",
    "cp_needs_te": "install Transformer Engine (or run in an NGC PyTorch container), or set "
                   "--context-parallel-size 1",
    "qk_norm_sp_needs_te": "use Transformer Engine's layers (--transformer-impl transformer_engine), or drop "
                           "--sequence-parallel",
    "sp_needs_tp": "drop --sequence-parallel, or use TP > 1",
    "recompute_layers": "set --recompute-num-layers between 1 and the layers per stage",
    "seq_positions": "raise --max-position-embeddings or lower --seq-length",
}


def _finding(code: str, message: str, fix: str, where: str | None = None, severity: str = "error") -> dict:
    out = {"code": code, "severity": severity, "message": message, "fix": fix}
    if where:
        out["where"] = where
    return out


def _line_of(text: str, needle: str) -> str | None:
    for n, line in enumerate(text.splitlines(), 1):
        if needle in line.split("#", 1)[0] or (needle in line and not line.lstrip().startswith("#")):
            return f"line {n}"
    return None


def _parse_values(args: list[str]) -> argparse.Namespace:
    parser = megatron_flags.manifest_parser()
    ns, _ = parser.parse_known_args(args)
    return ns


def _model_and_layout(ns: argparse.Namespace, world: int | None) -> tuple[Any, Layout | None, str | None]:
    required = ("num_layers", "hidden_size", "num_attention_heads")
    if any(getattr(ns, k, None) is None for k in required):
        return None, None, "the script does not set " + ", ".join(f"--{k.replace('_', '-')}" for k in required)
    fields = {
        "num_layers": ns.num_layers, "hidden_size": ns.hidden_size,
        "ffn_hidden_size": ns.ffn_hidden_size or 4 * ns.hidden_size,
        "num_attention_heads": ns.num_attention_heads, "vocab_size": ns.vocab_size or 32000,
        "num_query_groups": ns.num_query_groups if ns.group_query_attention else None,
        "kv_channels": ns.kv_channels,
        "max_position_embeddings": ns.max_position_embeddings or ns.seq_length or 4096,
        "untie_embeddings_and_output_weights": bool(ns.untie_embeddings_and_output_weights),
        "activation": "swiglu" if ns.swiglu else ("squared_relu" if ns.squared_relu else "gelu"),
        "normalization": ns.normalization if ns.normalization in ("RMSNorm", "LayerNorm") else "LayerNorm",
        "position_embedding_type": "rope" if ns.position_embedding_type in ("rope", "yarn", "mrope") else "learned_absolute",
        "add_bias_linear": ns.add_bias_linear,
        "num_experts": ns.num_experts, "moe_router_topk": ns.moe_router_topk or 2,
        "moe_ffn_hidden_size": ns.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": ns.moe_shared_expert_intermediate_size,
        "multi_latent_attention": bool(ns.multi_latent_attention),
    }
    if ns.multi_latent_attention:
        fields.update(q_lora_rank=ns.q_lora_rank, kv_lora_rank=ns.kv_lora_rank, qk_head_dim=ns.qk_head_dim,
                      qk_pos_emb_head_dim=ns.qk_pos_emb_head_dim, v_head_dim=ns.v_head_dim)
    if ns.moe_layer_freq not in (None, 1):
        fields["moe_layer_freq"] = ns.moe_layer_freq if isinstance(ns.moe_layer_freq, (int, list)) else str(ns.moe_layer_freq)
    try:
        model = build_spec("script", {k: v for k, v in fields.items() if v is not None}, where="script")
    except ToolError as e:
        return None, None, e.message
    tp, pp, cp = ns.tensor_model_parallel_size or 1, ns.pipeline_model_parallel_size or 1, ns.context_parallel_size or 1
    vp = ns.num_virtual_stages_per_pipeline_rank or 1
    if ns.num_layers_per_virtual_pipeline_stage:
        per_rank = ns.num_layers // pp
        vp = max(1, per_rank // ns.num_layers_per_virtual_pipeline_stage)
    world = world or tp * pp * cp
    dp = max(1, world // (tp * pp * cp))
    mbs = ns.micro_batch_size or 1
    gbs = ns.global_batch_size or mbs * dp
    recompute = ns.recompute_granularity or "none"
    lay = Layout(tp=tp, pp=pp, vp=vp, cp=cp, ep=ns.expert_model_parallel_size or 1,
                 etp=ns.expert_tensor_parallel_size or 1, dp=dp, mbs=mbs, gbs=gbs,
                 seq_length=ns.seq_length or 4096, recompute=recompute,
                 recompute_layers=ns.recompute_num_layers or (0 if recompute != "full" else 1),
                 distributed_optimizer=bool(ns.use_distributed_optimizer),
                 sequence_parallel=bool(ns.sequence_parallel),
                 precision="fp8" if ns.fp8 else "bf16",
                 **_pipeline_split(ns, model.num_layers, pp))
    return model, lay, None


def _pipeline_split(ns: argparse.Namespace, num_layers: int, pp: int) -> dict[str, Any]:
    """Layout fields of the script's pipeline split. With only one of the first / last counts
    given, Megatron spreads the rest evenly over the other ranks, the other end included."""
    first, last = ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers
    if first is None and last is None:
        return {"pipeline_split": "embedding_loss" if ns.account_for_embedding_in_pipeline_split else "even"}
    others = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    share = rest // others if others > 0 and rest % others == 0 else 0  # 0: not whole, refused as pp_uneven
    return {"pipeline_split": "uneven", "first_stage_layers": share if first is None else first,
            "last_stage_layers": share if last is None else last}


def check_args(args: list[str], text: str, world: int | None, env: dict[str, str], gpu_name: str | None) -> dict[str, Any]:
    findings: list[dict] = []
    known = megatron_flags.known_flags()
    clean: list[str] = []
    skip_values = False
    for a in args:
        if a.startswith("--"):
            flag = a.split("=", 1)[0]
            if flag in megatron_flags.OBSOLETE:
                if flag in known:  # Megatron 0.19 still parses it: deprecated, ignored or translated
                    findings.append(_finding("obsolete_flag", f"{flag} is deprecated: Megatron 0.19 accepts it and "
                                             "ignores or translates it", f"use {megatron_flags.OBSOLETE[flag]}",
                                             _line_of(text, flag), severity="warning"))
                    skip_values = False
                    clean.append(a)
                    continue
                findings.append(_finding("obsolete_flag", f"{flag} is obsolete or not a Megatron flag",
                                         f"use {megatron_flags.OBSOLETE[flag]}", _line_of(text, flag)))
                skip_values = True
                continue
            if flag not in known:
                hint = megatron_flags.suggest(flag)
                findings.append(_finding("unknown_flag", f"{flag} is not a flag of Megatron's pretrain_gpt.py",
                                         hint or "remove it", _line_of(text, flag)))
                skip_values = True
                continue
            skip_values = False
        elif skip_values:
            continue
        clean.append(a)
    try:
        megatron_flags.check(clean)
    except ToolError as e:
        findings.append(_finding("bad_value", e.message, e.fix or "correct the value"))
        return {"findings": findings, "megatron_args": args}
    ns = _parse_values(clean)
    model, lay, why = _model_and_layout(ns, world)
    if ns.tp_comm_overlap and not ns.sequence_parallel:
        findings.append(_finding("tp_comm_overlap_needs_sp", "--tp-comm-overlap without --sequence-parallel",
                                 "add --sequence-parallel (Megatron overlaps TP communication only with it)",
                                 _line_of(text, "--tp-comm-overlap")))
    if ns.fp8_param_gather and not ns.use_distributed_optimizer:
        findings.append(_finding("fp8_param_gather_needs_distopt", "--fp8-param-gather without the distributed optimizer",
                                 "add --use-distributed-optimizer", _line_of(text, "--fp8-param-gather")))
    if ns.overlap_param_gather and not ns.use_distributed_optimizer:
        findings.append(_finding("overlap_param_gather_needs_distopt",
                                 "--overlap-param-gather without the distributed optimizer",
                                 "add --use-distributed-optimizer (or drop --overlap-param-gather)",
                                 _line_of(text, "--overlap-param-gather")))
    gpu = None
    if gpu_name:
        gpu = get_gpu(gpu_name, where="/gpu")
    result: dict[str, Any] = {"megatron_args": args}
    if lay is None:
        findings.append(_finding("incomplete", f"cannot check the layout: {why}", "set the model-size flags",
                                 severity="warning"))
    else:
        result["layout"] = lay.to_json()
        if world is not None and world % (lay.tp * lay.pp * lay.cp):
            findings.append(_finding("world_size", f"{world} GPUs cannot be split into TP {lay.tp} x PP {lay.pp} x "
                                     f"CP {lay.cp} (DP would be {world / (lay.tp * lay.pp * lay.cp):.2f})",
                                     RULE_FIXES["world_size"]))
        elif gpu is not None or world is not None:
            # Every --transformer-impl the script names, in any branch: one that picks TE where it
            # imports runs TE's layers there.
            impls = {args[i + 1] for i, a in enumerate(args[:-1]) if a == "--transformer-impl"}
            impls |= set(re.findall(r"--transformer-impl[= ]+(\w+)", text or ""))
            rule = check_layout(lay, model, gpu or get_gpu("h100-sxm"), lay.world_size, te=impls != {"local"})
            if rule == "sp_needs_tp":  # Megatron's validate_args turns it off, with a warning
                findings.append(_finding(rule, "sequence parallel at TP 1: Megatron switches it off (a warning, "
                                         "not an error)", RULE_FIXES[rule], severity="warning"))
                lay = dataclasses.replace(lay, sequence_parallel=False)
                rule = check_layout(lay, model, gpu or get_gpu("h100-sxm"), lay.world_size, te=impls != {"local"})
            if rule and rule != "world_size" and not (rule == "fp8_arch" and gpu is None):
                findings.append(_finding(rule, RULES[rule], RULE_FIXES.get(rule, "see the rule")))
        if (lay.tp > 1 or lay.cp > 1) and env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1" and \
                (gpu is None or float(gpu.compute_capability) < 10):
            findings.append(_finding("cuda_device_max_connections",
                                     "TP or CP > 1 without CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron refuses to start "
                                     "on Hopper and older)", "export CUDA_DEVICE_MAX_CONNECTIONS=1 before the launch"))
        if gpu is not None and lay.precision == "fp8" and not gpu.supports_fp8:
            findings.append(_finding("fp8_arch", f"FP8 on {gpu.key} ({gpu.arch})", RULE_FIXES["fp8_arch"],
                                     _line_of(text, "--fp8")))
        if gpu is not None and not any(f["severity"] == "error" for f in findings):
            padded = padded_vocab_size(model.vocab_size, lay.tp)
            # A rendered script picks TE or the local layers at run time: the fused head counts
            # only where the local path is the one it will run.
            local_only = "--skill-linear-cross-entropy" in args and "transformer_engine" not in args
            mem = memory_report(model, lay, padded, fused_head=local_only)
            peak = max(m.total for m in mem.values()) / GIB
            result["predicted_peak_gib"] = round(peak, 2)
            if peak > gpu.memory_gib:
                findings.append(_finding("out_of_memory", f"predicted {peak:.1f} GiB per GPU on {gpu.key} "
                                         f"({gpu.memory_gib} GiB)",
                                         "add recompute, lower --micro-batch-size, or raise TP/PP; "
                                         "'launch.py plan' lists layouts that fit"))
    impl = getattr(ns, "transformer_impl", None)
    if impl == "local":
        skill_entry = any(a.startswith("--skill-") for a in args)   # only the skill's entry knows them
        missing = [f for f in megatron_args.no_te_flags_needed(skill_entry) if f not in args]
        if missing:
            findings.append(_finding("local_needs_no_fusion", "--transformer-impl local without " + " ".join(missing),
                                     "add them where Transformer Engine and apex are absent (the fused paths import "
                                     "them and fail)", severity="warning"))
    if world is not None and megatron_parser.available() and not any(f["severity"] == "error" for f in findings):
        try:
            megatron_parser.check(clean, world_size=world, env={"CUDA_DEVICE_MAX_CONNECTIONS":
                                                                  env.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")})
        except ToolError as e:
            findings.append(_finding("megatron_validate_args", e.message, "fix the combination Megatron names"))
    result["findings"] = findings
    return result


MAX_SCRIPT_BYTES = 1 << 20  # launch scripts are kilobytes; more is not a launch script
MAX_ARGS = 4096  # Megatron's parser (argparse) slows down with the square of the argument count


def read_script(path: Path) -> str:
    """A launch script's text: a regular file of at most MAX_SCRIPT_BYTES, without NUL bytes
    (a binary file is not a script). Read, never run."""
    fix = "give the path of a launch script (bash, as text)"
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ToolError("bad_request", f"{path} is not a regular file", where="/script", fix=fix)
        if info.st_size > MAX_SCRIPT_BYTES:
            raise ToolError("bad_request", f"{path} is {info.st_size:,} bytes, more than a launch script "
                            f"({MAX_SCRIPT_BYTES:,} at most)", where="/script", fix=fix)
        with open(path, "rb") as f:
            data = f.read(MAX_SCRIPT_BYTES + 1)
    except OSError as e:
        raise ToolError("not_found", f"cannot read {path}: {e.strerror}", where="/script", fix=fix)
    if b"\0" in data:
        raise ToolError("bad_request", f"{path} holds NUL bytes: a binary file, not a script", where="/script",
                        fix=fix)
    return data.decode("utf-8", errors="replace")


def split_arg_strings(args: list[str]) -> list[str]:
    """An argument vector, where an item holding several shell words (--args "--fp8-hybrid --bf16")
    is split as the shell would split it."""
    out: list[str] = []
    for item in args:
        if item.startswith("-") and any(c.isspace() for c in item):
            try:
                out += shlex.split(item)
                continue
            except ValueError:
                pass
        out.append(item)
    return out


def flag_fragment(text: str) -> list[str] | None:
    """The flags of a text that holds nothing but flags and their values (comments, blank lines
    and line continuations aside), as conf snippets and notes do; None for anything else."""
    lines = [ln.split(" #")[0].strip() for ln in text.replace("\\\n", " ").splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if not lines or not all(ln.startswith("--") for ln in lines):
        return None
    try:
        return shlex.split(" ".join(lines))
    except ValueError:
        return None


def run(req: dict, ctx: Context) -> dict[str, Any]:
    sources = [k for k in ("script", "script_text", "args", "render_request") if req.get(k) is not None]
    if len(sources) != 1:
        raise ToolError("bad_request", "give exactly one of script, script_text, args or render_request", where="/",
                        fix="validate --script launch.sh")
    if req.get("render_request") is not None:
        return _validate_request(req["render_request"], ctx)
    if req.get("script"):
        text = read_script(Path(req["script"]))
    elif req.get("script_text") is not None:
        text = req["script_text"]
    else:
        text = ""
    fragment = flag_fragment(text) if req.get("args") is None else None
    if req.get("args") is not None:
        args, env, world, info = split_arg_strings(req["args"]), dict(req.get("env") or {}), req.get("num_gpus"), {}
    elif fragment is not None:  # a file or text of flags only (a conf snippet): the flags themselves
        args, env, world, info = fragment, dict(req.get("env") or {}), req.get("num_gpus"), {"fragment": True}
    else:
        ex = script_args.extract(text)
        if not ex.args and ex.entry is None:
            raise ToolError("invalid_script", "no Megatron launch found (no line running a *.py)", where="script",
                            fix="give the script that runs pretrain_gpt.py (or the skill's tools/pretrain_gpt.py)")
        args, env = ex.args, {**ex.env, **(req.get("env") or {})}
        world = req.get("num_gpus") or script_args.world_size(ex)
        info = script_args.summary(ex)
    if len(args) > MAX_ARGS:
        raise ToolError("bad_request", f"{len(args):,} arguments reach Megatron; a launch passes a few hundred "
                        f"(at most {MAX_ARGS:,} are checked)", where="/args" if req.get("args") else "/script",
                        fix="give the launch script itself, not a generated or repeated one")
    result = check_args(args, text, world, env, req.get("gpu"))
    errors = [f for f in result["findings"] if f["severity"] == "error"]
    warnings = [f for f in result["findings"] if f["severity"] == "warning"]
    ctx.progress(f"validate: {len(errors)} error(s), {len(warnings)} warning(s)")
    return {"valid": not errors, "errors": errors, "warnings": warnings, "world_size": world,
            "layout": result.get("layout"), "predicted_peak_gib": result.get("predicted_peak_gib"),
            "script": info, "num_megatron_args": len(args)}


def _validate_request(sub: dict, ctx: Context) -> dict[str, Any]:
    """A render request: every error render would raise, then the checks on its arguments."""
    from . import render
    from .contract import request_id, validate_request

    try:
        full = validate_request("render", sub)
        sub_ctx = Context(dry_run=True, progress=ctx.progress)
        sub_ctx.request_id = request_id("render", full)  # type: ignore[attr-defined]
        built = render.build(full, sub_ctx)
    except ToolError as e:
        err = _finding(e.code, e.message, e.fix or "", e.where)
        return {"valid": False, "errors": [err], "warnings": [], "world_size": None, "layout": None,
                "predicted_peak_gib": None, "script": {}, "num_megatron_args": 0}
    lay = built["layout"]
    result = check_args(built["megatron_args"], "", lay["world_size"], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
                        full.get("gpu"))
    errors = [f for f in result["findings"] if f["severity"] == "error"]
    return {"valid": not errors, "errors": errors,
            "warnings": [f for f in result["findings"] if f["severity"] == "warning"],
            "world_size": lay["world_size"], "layout": lay, "predicted_peak_gib": result.get("predicted_peak_gib"),
            "script": {}, "num_megatron_args": len(built["megatron_args"])}


TOOL = register(Tool(name="validate", summary="Check a launch script or argument vector: unknown / obsolete flags, "
                     "Megatron's rules, memory fit; every error names its fix.", run=run))
