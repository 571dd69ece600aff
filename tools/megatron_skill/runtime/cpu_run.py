"""train on CPU, planned here: the request checked against the CPU loop (the rule book, its size
and runtime limits) and turned into cpu_loop.py's config and torchrun command (gloo). Imports
neither torch nor Megatron: the loop does, in its own processes."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..core.catalog import GPUSpec
from ..core.flops import padded_vocab_size, training_flops
from ..core.layout import RULES, Layout, check_layout
from ..core.model import ModelConfig
from ..core.options import RuntimeOptions
from ..core.resolve import default_global_batch, resolve_model
from ..errors import ToolError

CPU_MAX_PARAMS = 60e6  # enough for tests and demos; anything larger belongs on a GPU
LOOP = Path(__file__).resolve().parent / "cpu_loop.py"


def estimate_seconds(step_flops: float, iters: int) -> float:
    """Wall time of a CPU run: start-up (imports, gloo, dataset indices) plus, per iteration, the
    measured time of the tiny model's step, scaled up for a step of more FLOPs (a smaller step
    is bound by Python and gloo, not arithmetic). Measured on the 2-core CI machine class
    (catalog/calibration.json, cpu_loop); a faster machine finishes sooner."""
    from ..core.catalog import CATALOG_DIR

    cal = json.loads((CATALOG_DIR / "calibration.json").read_text())["cpu_loop"]
    per_iter = cal["reference_iteration_s"] * max(1.0, step_flops / (cal["reference_step_gflop"] * 1e9))
    return round(cal["startup_s"] + iters * per_iter, 1)


def cpu_ranks(procs: int) -> GPUSpec:
    """The CPU loop's processes as the rule book's accelerator: all of them one shared-memory
    domain (TP may span them), no FP8 tensor cores, no memory limit the planner would cost."""
    return GPUSpec(key="cpu", name="CPU (gloo)", arch="cpu", compute_capability="0.0", memory_gib=float("inf"),
                   hbm_gbps=0.0, bf16_dense_tflops=0.0, fp8_dense_tflops=None, nvlink_gbps=0.0, nvlink_domain=procs,
                   gpus_per_node=procs, network_gbps=0.0, source="the CPU loop (runtime/cpu_loop.py)")


def cpu_layout(req: dict, model: ModelConfig, procs: int, seq: int) -> Layout:
    """The request's layout as the CPU loop would run it, checked by the rule book (the local
    layers, and the CPU loop's own limits): one ToolError naming the first rule it breaks."""
    given = {k: v for k, v in (req.get("layout") or {}).items() if k in {f.name for f in dataclasses.fields(Layout)}}
    fields = {"sequence_parallel": False, "distributed_optimizer": False, "precision": req["precision"], **given}
    tp, pp, cp = fields.get("tp", 1), fields.get("pp", 1), fields.get("cp", 1)
    fields.setdefault("dp", max(1, procs // (tp * pp * cp)))
    dp, mbs = fields["dp"], fields.get("mbs", 1)
    gbs = req.get("global_batch_size") or min(default_global_batch(seq), 8 * dp * mbs)
    lay = Layout(**{**fields, "seq_length": seq, "gbs": gbs})
    rule = check_layout(lay, model, cpu_ranks(procs), procs, te=False, cpu_loop=True)
    if rule:
        raise ToolError("infeasible", f"the layout {lay.label()} cannot run in the CPU loop on {procs} "
                        f"process(es): it breaks the rule {rule!r}: {RULES[rule].message}", where="/layout",
                        fix=f"{RULES[rule].for_request()} (num_gpus is the CPU run's processes)")
    return lay


def plan_cpu_run(req: dict, run_dir: Path, run_id: str) -> dict[str, Any]:
    model = resolve_model(req)
    if model.total_params() > CPU_MAX_PARAMS:
        raise ToolError("environment", f"no GPU here, and {model.name} ({model.total_params() / 1e9:.2f}B "
                        f"parameters) is too large for the CPU loop (at most {CPU_MAX_PARAMS / 1e6:.0f}M)",
                        where="/model", fix="run on a GPU machine, or train model tiny-gpt on CPU")
    if model.multi_latent_attention or model.mtp_num_layers:
        raise ToolError("environment", "the CPU loop does not build MLA or MTP models", where="/model",
                        fix="run on a GPU machine")
    procs = req.get("num_gpus") or 1
    cores = os.cpu_count() or 1
    if procs > cores:
        raise ToolError("bad_request", f"a CPU run of {procs} processes on {cores} cores: each process of the CPU "
                        "loop is one rank, and more ranks than cores only wait on each other", where="/num_gpus",
                        fix=f"give num_gpus (the CPU run's processes) of at most {cores}, or run on GPUs")
    seq = req.get("seq_length") or model.default_seq_length or 256
    lay = cpu_layout(req, model, procs, seq)
    runtime = cpu_runtime(req.get("runtime"))
    tp, pp, mbs, gbs = lay.tp, lay.pp, lay.mbs, lay.gbs
    from ..convert.pretrained import training_settings  # fine-tuning's defaults from pretrained weights, as render's
    from ..data.datasets import is_weight, match_tokenizer
    t = match_tokenizer(training_settings(model, req["training"]), model.vocab_size)
    start = None
    if t.get("pretrained"):
        from ..convert import checkpoint, pretrained

        start = pretrained.describe(t["pretrained"], model, tp, need_local=True)
        if start["tokenizer"] and not t.get("tokenizer_model"):
            t["tokenizer_model"] = start["tokenizer"]
    iters = t["train_iters"]
    warm = t.get("lr_warmup_iters")
    config = {
        "model": {k: v for k, v in model.to_fields().items() if v is not None and k not in ("source",)},
        "tp": tp, "pp": pp, "seq_length": seq, "vocab_size": t.get("vocab_size") or model.vocab_size,
        "padded_vocab_size": start["padded_vocab"] if start else padded_vocab_size(model.vocab_size, tp),
        # weights only, while the run has no checkpoint of its own (Megatron's --pretrained-checkpoint)
        "pretrained": str(checkpoint.iteration_dir(Path(t["pretrained"]).absolute())) if start else None,
        "seed": t["seed"], "lr": t["lr"], "min_lr": t["min_lr"],
        "lr_warmup_iters": min(100, iters // 10) if warm is None else warm,
        "weight_decay": t["weight_decay"], "init_method_std": t["init_method_std"], "train_iters": iters,
        "global_batch_size": gbs, "micro_batch_size": mbs, "log_interval": t["log_interval"],
        "save_interval": t["save_interval"], "save": str(run_dir / "checkpoints"),
        # The loop runs in the run directory: dataset prefixes become absolute (weights stay).
        "data_path": [p if is_weight(p) else str(Path(p).resolve()) for p in t["data_path"]]
        if t.get("data_path") else None,
        "data_cache": str(run_dir / "data_cache"),
        **runtime.loop_config(),
    }
    cfg_path = run_dir / "cpu_run.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
               str(LOOP), str(cfg_path)]

    def write() -> None:
        cfg_path.write_text(json.dumps(config, indent=1))

    padded = padded_vocab_size(model.vocab_size, tp)
    return {"actions": [f"write {cfg_path}", " ".join(command)], "write": write, "command": command,
            "estimated_seconds": estimate_seconds(training_flops(model, seq, gbs, padded), iters),
            "seq_length": seq, "env": {"OMP_NUM_THREADS": "1"},
            "layout": lay.to_json(), "runtime": runtime.to_json(), "prediction": None, "pretrained": start}


# SDPA kernels torch has on CPU; cudnn and efficient are CUDA kernels only.
CPU_SDPA_BACKENDS = ("auto", "flash", "math")


@dataclasses.dataclass(frozen=True)
class CPURuntime:
    """The request's runtime options as the CPU loop runs them. Without a runtime object the loop
    runs Megatron's plain local layers; with one, every path it has follows the request."""
    linear_cross_entropy: bool = False
    compiled_rope: bool = False
    native_gqa: bool = False
    sdpa_backend: str = "auto"
    fp8_linear: bool = False
    fp8_scaling: str = "current"
    fused_adam: bool = False
    # The loop's weights and gradients are fp32: each weight gradient is added into an fp32
    # gradient by autograd, which is what the fused accumulation buys on a GPU. Nothing to switch.
    fused_wgrad_accumulation: bool = True

    def loop_config(self) -> dict[str, Any]:
        """The loop's own config keys (runtime/cpu_loop.py)."""
        return {"fused_head": self.linear_cross_entropy, "compiled_rope": self.compiled_rope,
                "native_gqa": self.native_gqa, "sdpa_backend": self.sdpa_backend, "fp8_linear": self.fp8_linear,
                "fp8_scaling": self.fp8_scaling, "fused_adam": self.fused_adam}

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cpu_runtime(runtime: dict | None) -> CPURuntime:
    """The runtime options of the request for the CPU loop; one ToolError for one it cannot run."""
    if runtime is None:
        return CPURuntime()
    opts = RuntimeOptions.from_request(runtime, te=False)
    if opts.sdpa_backend not in CPU_SDPA_BACKENDS:
        raise ToolError("bad_request", f"the SDPA backend {opts.sdpa_backend!r} is a CUDA kernel: torch has "
                        f"{', '.join(CPU_SDPA_BACKENDS)} on CPU", where="/runtime/sdpa_backend",
                        fix="give sdpa_backend auto, flash or math for a CPU run, or train on GPUs (backend gpu)")
    return CPURuntime(linear_cross_entropy=opts.linear_cross_entropy, compiled_rope=opts.compiled_rope,
                      native_gqa=opts.native_gqa, sdpa_backend=opts.sdpa_backend, fp8_linear=opts.fp8_linear,
                      fp8_scaling=opts.fp8_scaling, fused_adam=opts.fused_adam,
                      fused_wgrad_accumulation=opts.fused_wgrad_accumulation)
