"""The CPU side of train: a tiny model through runtime/cpu_loop.py under torchrun (gloo)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..core.flops import padded_vocab_size, training_flops
from ..core.resolve import default_global_batch, resolve_model, with_training_defaults
from ..errors import ToolError

CPU_MAX_PARAMS = 60e6  # enough for tests and demos; anything larger belongs on a GPU
LOOP = Path(__file__).resolve().parents[1] / "runtime" / "cpu_loop.py"


def estimate_seconds(step_flops: float, iters: int) -> float:
    """Wall time of a CPU run: start-up (imports, gloo, dataset indices) plus, per iteration, the
    measured time of the tiny model's step, scaled up for a step of more FLOPs (a smaller step
    is bound by Python and gloo, not arithmetic). Measured on the 2-core CI machine class
    (catalog/calibration.json, cpu_loop); a faster machine finishes sooner."""
    from ..core.catalog import CATALOG_DIR

    cal = json.loads((CATALOG_DIR / "calibration.json").read_text())["cpu_loop"]
    per_iter = cal["reference_iteration_s"] * max(1.0, step_flops / (cal["reference_step_gflop"] * 1e9))
    return round(cal["startup_s"] + iters * per_iter, 1)


def plan_cpu_run(req: dict, run_dir: Path, run_id: str) -> dict[str, Any]:
    model = resolve_model(req)
    if model.total_params() > CPU_MAX_PARAMS:
        raise ToolError("environment", f"no GPU here, and {model.name} ({model.total_params() / 1e9:.2f}B "
                        f"parameters) is too large for the CPU loop (at most {CPU_MAX_PARAMS / 1e6:.0f}M)",
                        where="/model", fix="run on a GPU machine, or train model tiny-gpt on CPU")
    if model.multi_latent_attention or model.mtp_num_layers:
        raise ToolError("environment", "the CPU loop does not build MLA or MTP models", where="/model",
                        fix="run on a GPU machine")
    layout = req.get("layout") or {}
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    procs = req.get("num_gpus") or 1
    cores = os.cpu_count() or 1
    if procs > cores:
        raise ToolError("bad_request", f"a CPU run of {procs} processes on {cores} cores: each process of the CPU "
                        "loop is one rank, and more ranks than cores only wait on each other", where="/num_gpus",
                        fix=f"give num_gpus (the CPU run's processes) of at most {cores}, or run on GPUs")
    if procs % (tp * pp) or model.num_attention_heads % tp or model.query_groups % tp:
        raise ToolError("bad_request", f"TP {tp} x PP {pp} does not divide the processes ({procs}), or TP the heads",
                        where="/layout/tp", fix="use a TP that divides the heads and TP x PP that divides the processes")
    if pp > 1 and (model.num_layers % pp or not model.untie_embeddings_and_output_weights):
        raise ToolError("bad_request", f"the CPU loop splits {model.num_layers} layers evenly into {pp} stages, "
                        "with untied embeddings", where="/layout/pp", fix="use a PP that divides the layers")
    dp = procs // (tp * pp)
    seq = req.get("seq_length") or model.default_seq_length or 256
    gbs = req.get("global_batch_size") or min(default_global_batch(seq), 8 * dp)
    mbs = layout.get("mbs", 1)
    if gbs % (mbs * dp):
        raise ToolError("bad_request", f"global batch {gbs} is not divisible by micro-batch {mbs} x DP {dp}",
                        where="/global_batch_size", fix="make it a multiple of micro-batch x DP")
    from .prepare_data import is_weight, match_tokenizer
    t = match_tokenizer(with_training_defaults(model, req["training"]),
                        model.vocab_size)
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
            "layout": {"tp": tp, "pp": pp, "dp": dp, "mbs": mbs, "gbs": gbs, "seq_length": seq}, "prediction": None,
            "pretrained": start}
