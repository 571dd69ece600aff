"""Turn the model and cluster parts of a request into specs, and a fake_rank into the rank it names;
shared by every tool."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..errors import ToolError
from . import catalog
from .catalog import GPUSpec
from .layout import Layout
from .model import ModelConfig, build_spec, from_hf_config


def resolve_model(req: dict[str, Any]) -> ModelConfig:
    model, hf = req.get("model"), req.get("hf_config")
    if model is not None and hf is not None:
        raise ToolError("bad_request", "give model or hf_config, not both", where="/hf_config",
                        fix="drop one of the two")
    if hf is not None:
        return from_hf_config(hf)
    if model is None:
        raise ToolError("bad_request", "no model given", where="/model",
                        fix=f"name one ({', '.join(catalog.model_names())}), give its fields, or hf_config")
    if isinstance(model, str):
        return catalog.get_model(model, where="/model")
    fields = dict(model)
    name = str(fields.pop("name", "custom"))
    return build_spec(name, fields, where="/model")


def check_precision(precision: str, gpu: GPUSpec) -> None:
    """FP8 asked of a GPU without FP8 tensor cores is refused as such: no GPU count, batch or
    layout changes it (a search would only find that nothing fits, and say so as if they could)."""
    from .layout import RULES

    if precision == "fp8" and not gpu.supports_fp8:
        raise ToolError("infeasible", f"{RULES['fp8_arch'].message}; {gpu.key} has none", where="/precision",
                        fix=f"precision bf16 (or any) on {gpu.key}, or an FP8 GPU (h100-sxm, h200, b200, ...)")


def resolve_cluster(req: dict[str, Any]) -> tuple[GPUSpec, int, int]:
    """(GPU, GPUs in all, GPUs per node).  With a node size other than the GPU's usual one, the
    GPU's spec says so too: its NVLink domain shrinks to the node when it was the node."""
    gpu = catalog.get_gpu(req["gpu"], where="/gpu")
    per_node = req.get("gpus_per_node") or gpu.gpus_per_node
    if per_node != gpu.gpus_per_node:
        domain = min(gpu.nvlink_domain, per_node) if gpu.nvlink_domain <= gpu.gpus_per_node else gpu.nvlink_domain
        gpu = dataclasses.replace(gpu, gpus_per_node=per_node, nvlink_domain=domain)
    if req.get("num_gpus") is not None:
        n = req["num_gpus"]
        if req.get("nodes") is not None and req["nodes"] * per_node != n:
            raise ToolError("bad_request", f"num_gpus {n} differs from nodes x gpus_per_node "
                            f"({req['nodes']} x {per_node})", where="/num_gpus",
                            fix="give num_gpus, or nodes (and gpus_per_node), not a mismatch")
    elif req.get("nodes") is not None:
        n = req["nodes"] * per_node
    else:
        raise ToolError("bad_request", "no GPU count given", where="/num_gpus",
                        fix="give num_gpus, or nodes (with gpus_per_node if not the GPU's usual)")
    return gpu, n, per_node


# Iterations when a request names none: a real run on GPUs; on CPU, what the tiny model
# finishes in about a minute on a 2-core machine (references/benchmarks.md, "CPU runs").
DEFAULT_TRAIN_ITERS = {"gpu": 1000, "cpu": 50}


def default_seq_length(model: ModelConfig) -> int:
    return model.default_seq_length or min(8192, model.max_position_embeddings)


def default_global_batch(seq_length: int) -> int:
    """About 4M tokens a step (the Llama 3 and DeepSeek-V3 regime), as a power of two."""
    return 2 ** round(math.log2(max(1, 4 * 2**20 // seq_length)))


def with_training_defaults(model, training: dict[str, Any]) -> dict[str, Any]:
    """A request's training fields over the defaults for the model's size; a learning rate given
    without its floor gets the recipe's ratio of floor to peak (a fine-tuning rate below the
    table's floor would otherwise be refused by Megatron: min_lr <= lr)."""
    defaults = training_defaults(model, training["train_iters"])
    if "lr" in training and "min_lr" not in training:
        defaults["min_lr"] = training["lr"] * defaults["min_lr"] / defaults["lr"]
    return {**defaults, **training}


def training_defaults(model, train_iters: int) -> dict[str, Any]:
    """Learning rate, its floor and warm-up, weight decay and init std for a model of this size
    (core/catalog/training_defaults.json, a source per row). Warm-up is the recipe's, or a tenth
    of a shorter run; the fields a request gives replace these."""
    table = catalog._load("training_defaults.json")
    if model.is_moe:
        row = table["moe"]
    else:
        size_b = model.total_params() / 1e9
        row = next(r for r in table["dense"] if r["up_to_params_b"] is None or size_b <= r["up_to_params_b"])
    std = table["init_method_std"]
    init = min(std["at_most"], std["anchor_std"] * math.sqrt(std["anchor_hidden"] / model.hidden_size))
    return {"lr": row["lr"], "min_lr": row["min_lr"], "lr_warmup_iters": min(row["warmup_iters"], train_iters // 10),
            "weight_decay": table["weight_decay"]["value"], "init_method_std": round(init, 4)}


def fake_rank(value: int | str, lay: Layout) -> int:
    """The global rank a fake_rank request names.  Megatron orders ranks tp-cp-ep-dp-pp (PP
    outermost), so rank 0 and the first rank of the last stage are TP and DP rank 0, the
    ranks whose memory report Megatron prints."""
    if value == "first-stage":
        return 0
    if value == "last-stage":
        return (lay.pp - 1) * (lay.world_size // lay.pp)
    if value >= lay.world_size:
        raise ToolError("bad_request", f"fake_rank {value} is not a rank of {lay.label()} ({lay.world_size} ranks)",
                        where="/fake_rank", fix=f"give a rank below {lay.world_size}, or first-stage / last-stage")
    return int(value)


def pipeline_stage(rank: int, lay: Layout) -> int:
    """The pipeline stage of a global rank (PP outermost in Megatron's order)."""
    return rank // (lay.world_size // lay.pp)
