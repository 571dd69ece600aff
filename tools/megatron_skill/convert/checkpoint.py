"""Megatron-Core checkpoints of converted weights.

Writing: one torchrun worker per TP x PP x EP rank (on the CPU, over gloo) builds its own piece of
GPTModel, fills it from the Hugging Face folder layer by layer and joins the collective save of
megatron.core.dist_checkpointing (the torch_dist format). That format stores every tensor whole
with its sharding, so the checkpoint loads into any other layout: the layout of the import only
decides how much each worker holds. It is written as a *release* checkpoint
(latest_checkpointed_iteration.txt says "release"), which Megatron's load_checkpoint reads
without optimizer or RNG state and from iteration 0 -- --pretrained-checkpoint / --finetune.

Reading: a torch_dist checkpoint loads whole into a one-rank model (dist_checkpointing reshards
on load); the CPU loop's per-rank files (Megatron's legacy mp_rank_TT[_PPP] layout) are joined
by convert.hf.tp_join and the stage offsets.

Run a worker as: python -m torch.distributed.run ... checkpoint.py CONFIG.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TRACKER = "latest_checkpointed_iteration.txt"  # files.TRACKER (this file also runs as a script: no imports here)
RELEASE = "release"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def iteration_dir(root: Path) -> Path:
    """The folder holding one checkpoint's files: the tracker's choice under a checkpoint root,
    or the folder itself when it is one."""
    from .. import files

    root = Path(root)
    it = files.read_tracker(root)
    if it is None:
        return root
    return root / (RELEASE if it == RELEASE else f"iter_{it:07d}")


def padded_vocab_of(folder: Path) -> int | None:
    """The embedding's rows in a torch_dist checkpoint folder (its metadata only), or None."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(folder))
    emb = meta.get("embedding.word_embeddings.weight")
    return int(emb.global_shape[0]) if emb is not None else None


def stored_dtype(folder: Path) -> str | None:
    """The dtype a torch_dist checkpoint folder keeps its model's weights in (its metadata only): bf16,
    fp16 or fp32, the one that holds most of the weights' elements (a bf16 checkpoint keeps its norms'
    weights in fp32; the optimizer's fp32 copies of a GPU run do not count), or None."""
    import math

    from megatron.core import dist_checkpointing

    names = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
    elements: dict[str, int] = {}
    for key, t in dist_checkpointing.load_tensors_metadata(str(folder)).items():
        name = names.get(str(getattr(t, "dtype", "")))
        if name and not key.startswith("optimizer") and "_extra_state" not in key:
            elements[name] = elements.get(name, 0) + math.prod(getattr(t, "global_shape", ()) or (1,))
    return max(elements, key=elements.get) if elements else None


def check_tracker(root: Path, where: str) -> None:
    """A tracker in root that is not one (a forged or damaged file) is an error, not a wrong folder."""
    from .. import files
    from ..errors import ToolError

    if files.has_tracker(root) and files.read_tracker(root) is None:
        raise ToolError("bad_request", f"{Path(root) / TRACKER} holds neither an iteration number nor 'release': "
                        "it is not a Megatron checkpoint tracker", where=where,
                        fix="give a checkpoint folder as Megatron or import-hf wrote it (its tracker holds one "
                            "iteration number, or release), or one iteration's folder")


def kind(folder: Path) -> str | None:
    """'torch_dist', 'legacy' (per-rank .pt files) or None."""
    from .. import files

    meta = folder / "metadata.json"  # megatron-core 0.19 keeps the common state inside the .distcp files
    if (files.read_record(meta) or {}).get("sharded_backend") == "torch_dist":
        return "torch_dist"
    if any(folder.glob("mp_rank_*")) or any(folder.glob("mp_rank_*.pt")):
        return "legacy"
    return None


def init_single_process() -> None:
    """A one-rank gloo group (Megatron's parallel state needs one) for reading a checkpoint. Its
    rendezvous is an in-memory store: one rank has no one to meet, and a file store would leave
    its file behind in the temporary folder after every conversion."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)


def model_config(spec, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str = "fp32",
                 padded_vocab: int | None = None) -> dict:
    """What runtime.cpu_loop.build_model takes, for a model of this spec at this layout. The
    vocabulary pads as Megatron pads at TP 1 unless the checkpoint says otherwise: one size for
    every layout (convert/pretrained.py)."""
    from ..core.flops import padded_vocab_size

    return {"model": {k: v for k, v in spec.to_fields().items() if v is not None and k != "source"},
            "tp": tp, "pp": pp, "ep": ep, "seq_length": 128, "params_dtype": dtype, "initialize": False,
            "padded_vocab_size": padded_vocab or padded_vocab_size(spec.vocab_size, 1)}


def read_whole(folder: Path, spec, dtype: str = "fp32", layout: dict | None = None) -> dict[str, Any]:
    """Every parameter of the model at TP 1, PP 1 under Megatron's names, from a torch_dist or a
    legacy checkpoint folder (one checkpoint's folder: see iteration_dir)."""
    import torch

    what = kind(folder)
    if what == "torch_dist":
        from megatron.core import dist_checkpointing

        from ..runtime import patches
        from ..runtime.cpu_loop import build_model

        patches.by_name("CPU stands in").apply()
        init_single_process()
        model = build_model(model_config(spec, dtype=dtype, padded_vocab=padded_vocab_of(folder)))
        stored = dist_checkpointing.load_tensors_metadata(str(folder))
        local, te = model.sharded_state_dict(), _te_layer_names(model)
        # A run of Transformer Engine's layers saved an MoE layer's pre-MLP norm under its own
        # name only; an import or a run of local layers under the fused name: ask for the one
        # stored.
        asked = {name: te[name] if getattr(sh, "key", None) not in stored and getattr(te[name], "key", None) in stored
                 else sh for name, sh in local.items()}
        loaded = dist_checkpointing.load({"model": asked}, str(folder))
        model.load_state_dict(loaded["model"], strict=False)
        return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    if what == "legacy":
        return _join_legacy(folder, spec, layout or {})
    from ..errors import ToolError
    raise ToolError("not_found", f"{folder} holds no Megatron checkpoint (no torch_dist metadata.json, no mp_rank_*)",
                    where="/checkpoint", fix="give a checkpoint folder (with latest_checkpointed_iteration.txt) "
                    "or one iteration's folder")


def _join_legacy(folder: Path, spec, layout: dict) -> dict[str, Any]:
    """Megatron's legacy per-rank files (mp_rank_TT or mp_rank_TT_PPP, each a folder with a .pt
    or a .pt itself) joined into one model: stage p holds layers p*L/PP onwards (the even split
    the CPU loop uses), TP pieces join as convert.hf.tp_join does."""
    import re

    import torch

    from .hf import tp_join

    files = {}
    for p in sorted(folder.glob("mp_rank_*")):
        m = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?(?:\.pt)?", p.name)
        if not m:
            continue
        f = p if p.is_file() else next(iter(sorted(p.glob("*.pt"))), None)
        if f is not None:
            files[(int(m.group(1)), int(m.group(2) or 0))] = f
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(s for _, s in files)
    per_stage = spec.num_layers // pp
    pieces: dict[str, list] = {}
    for (t, s), f in sorted(files.items()):
        state = torch.load(f, map_location="cpu", weights_only=False)["model"]
        for name, tensor in state.items():
            if not torch.is_tensor(tensor):
                continue
            if name.startswith("decoder.layers."):
                j, rest = name[len("decoder.layers."):].split(".", 1)
                name = f"decoder.layers.{int(j) + s * per_stage}.{rest}"
            pieces.setdefault(name, [None] * tp)[t] = tensor
    return {name: tp_join(name, parts, spec) for name, parts in pieces.items() if parts[0] is not None}


# ---- what a model of Transformer Engine's layers loads ------------------------------------
def _te_layer_names(model) -> dict[str, Any]:
    """model.sharded_state_dict() under the names a model of Transformer Engine's layers gives
    its tensors: the same but for an MoE layer's pre-MLP norm, which the local spec's
    sharded_state_dict_keys_map saves as mlp.linear_fc1.layer_norm_* (where a dense layer's TE
    linear fuses it) and TE's MoE layer keeps as pre_mlp_layernorm, a TENorm."""
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoELayer

    moe = [layer for layer in model.decoder.layers if isinstance(layer.mlp, MoELayer)]
    kept = [layer.submodules_config for layer in moe]
    try:
        for layer in moe:
            keys_map = {k: v for k, v in layer.submodules_config.sharded_state_dict_keys_map.items()
                        if k != "pre_mlp_layernorm."}
            layer.submodules_config = dataclasses.replace(layer.submodules_config, sharded_state_dict_keys_map=keys_map)
        return model.sharded_state_dict()
    finally:
        for layer, config in zip(moe, kept):
            layer.submodules_config = config


def te_loadable_state_dict(model) -> dict[str, Any]:
    """model.sharded_state_dict() (the local layers the import builds), and what a model of
    Transformer Engine's layers (Megatron's TE layer spec, the GPU run's) asks for beside it, so
    that Megatron's default strict load finds every key in the checkpoint:

    - an MoE layer's pre-MLP norm under its own name too: the local spec's
      sharded_state_dict_keys_map saves pre_mlp_layernorm as mlp.linear_fc1.layer_norm_* in
      every layer, where TE's layer spec fuses it into linear_fc1 only in dense layers (its MoE
      layer keeps pre_mlp_layernorm, a TENorm);
    - an empty _extra_state for every norm saved under its own name (final, QK and those MoE
      norms): each is a TE module in TE's spec, which saves an empty one outside FP8. The norms
      fused into a TE linear share the linear's, which Megatron's local linears already save.

    The keys and offsets are Megatron's own (the layers' sharded_state_dict, its helper for
    extra state); tests/test_convert_te_names.py loads the result into Megatron's TE layers."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    local, te = model.sharded_state_dict(), _te_layer_names(model)
    out = dict(local)
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            continue
        sh = te.get(f"{name}.weight")
        if not isinstance(sh, ShardedTensor) or not sh.key.endswith(f"{name.rsplit('.', 1)[-1]}.weight"):
            continue  # fused into a TE linear under TE's spec
        if sh.key != local[f"{name}.weight"].key:
            out[f"{name}.weight (TE)"] = sh
        offsets = [(axis, sh.global_offset[axis], sh.global_shape[axis]) for axis in range(sh.prepend_axis_num)]
        out[f"{name}._extra_state"] = make_sharded_object_for_checkpoint(
            torch.empty(0, dtype=torch.uint8), sh.key[:-len("weight")] + "_extra_state", offsets, replica_id=sh.replica_id)
    return out


# ---- the import worker ---------------------------------------------------------------------
def worker(config_path: str) -> None:
    """One rank of an import: build this rank's piece, fill it, join the collective save."""
    import argparse
    import resource

    import torch
    import torch.distributed as dist

    cfg = json.loads(Path(config_path).read_text())
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from ..core.model import from_hf_config
    from ..runtime import patches
    from ..runtime.cpu_loop import build_model
    from . import hf as conv

    patches.by_name("CPU stands in").apply()
    tp, pp, ep = cfg["tp"], cfg["pp"], cfg["ep"]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    rank = dist.get_rank()
    spec = from_hf_config(cfg["hf_model"])
    mcfg = model_config(spec, tp, pp, ep, cfg["dtype"])
    model = build_model(mcfg)
    first = get_transformer_layer_offset(model.config)
    local = len(model.decoder.layers)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
    conv.fill(model, conv.hf_reader(cfg["hf_model"]), spec, mcfg["padded_vocab_size"], tp,
              ps.get_tensor_model_parallel_rank(), first, local,
              first_expert=ps.get_expert_model_parallel_rank() * ((spec.num_experts or 0) // ep),
              progress=lambda i: say(f"import: layer {i + 1}/{spec.num_layers} converted (rank 0's stage)"))
    # What Megatron's load_checkpoint reads from a checkpoint's args: the layout it was saved
    # at, and that it carries neither optimizer nor RNG state.
    args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep, world_size=dist.get_world_size(),
                              data_parallel_size=1, no_save_optim=True, no_save_rng=True,
                              num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                              num_attention_heads=spec.num_attention_heads, ckpt_format="torch_dist")
    say(f"import: saving the torch_dist checkpoint to {cfg['out']}")
    dist_checkpointing.save({"model": te_loadable_state_dict(model), "checkpoint_version": 3.0, "iteration": 0,
                             "args": args}, cfg["out"])
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])  # KiB -> MiB
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(cfg["report"]).write_text(json.dumps({"peak_rss_mib_per_worker": round(peak.item(), 1)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_skill.convert.checkpoint import worker as _worker  # as a module: relative imports work

    _worker(sys.argv[1])
