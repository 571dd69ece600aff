"""The export-hf tool: a Megatron-Core checkpoint -> Hugging Face safetensors and config.json.

Any checkpoint the skill writes: an import's release checkpoint, a GPU run's torch_dist
checkpoint at any TP / PP / EP (resharded to one piece on load), a CPU run's per-rank files.
The model comes from the request, else from what lies beside the checkpoint (an import's
hf/config.json, a run's request.json). config.json is the original one where there is one,
otherwise written for the family the model's shape belongs to (convert.hf.hf_config_for).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from ..contract import Context, Tool
from ..convert import checkpoint, output
from ..errors import ToolError
from .import_hf import COMPANION_FILES

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _source(req: dict) -> dict[str, Any]:
    """The checkpoint root and iteration folder, the model, the original HF folder (or None) and
    the dtype to write."""
    from ..core.model import from_hf_config
    from ..core.resolve import resolve_model

    root = Path(req["checkpoint"])
    if not root.is_dir():
        raise ToolError("not_found", f"no folder {root}", where="/checkpoint",
                        fix="give a checkpoint folder (an import's output or a run's checkpoints folder)")
    folder = checkpoint.iteration_dir(root)
    what = checkpoint.kind(folder) if folder.is_dir() else None
    if what is None:
        raise ToolError("not_found", f"{folder} holds no Megatron checkpoint", where="/checkpoint",
                        fix="give a folder with latest_checkpointed_iteration.txt, or one iteration's folder")
    record = output.record_of(root) or {}
    hf_dir = None
    stored = None
    if record.get("tool") == "import-hf":
        hf_dir, stored = root / "hf", record["result"].get("dtype")
    run_request = None
    for cand in (root.parent / "request.json", root.parent.parent / "request.json"):
        if cand.is_file():
            run_request = json.loads(cand.read_text())
            break
    if req.get("model") is not None or req.get("hf_config") is not None:
        model = resolve_model(req)
        if req.get("hf_config") is not None:
            p = Path(req["hf_config"])
            hf_dir = p if p.is_dir() else p.parent
    elif hf_dir is not None:
        model = from_hf_config(hf_dir)
    elif run_request is not None:
        model = resolve_model(run_request)
        if run_request.get("hf_config"):
            p = Path(run_request["hf_config"])
            hf_dir = p if p.is_dir() else p.parent
    else:
        raise ToolError("bad_request", f"nothing beside {root} says which model it holds", where="/model",
                        fix="give model or hf_config (the model the checkpoint was trained as)")
    tokenizer_dir = hf_dir
    if run_request is not None:
        tok = (run_request.get("training") or {}).get("tokenizer_model")
        if tok and Path(tok).is_dir():
            tokenizer_dir = Path(tok)
    dtype = req["dtype"]
    if dtype == "auto":
        dtype = stored or ("fp32" if what == "legacy" else "bf16")
    layout = (run_request or {}).get("layout") or {}
    return {"root": root, "folder": folder, "kind": what, "model": model, "hf_dir": hf_dir,
            "tokenizer_dir": tokenizer_dir, "dtype": dtype, "layout": layout}


def run(req: dict, ctx: Context) -> dict[str, Any]:
    from ..convert import hf as conv

    src = _source(req)
    model = src["model"]
    if src["hf_dir"] is not None and (src["hf_dir"] / "config.json").is_file():
        config = json.loads((src["hf_dir"] / "config.json").read_text())
        conv.check_config(config, where="/hf_config")
    else:
        config = conv.hf_config_for(model)
    config["torch_dtype"] = config["dtype"] = TORCH_DTYPES[src["dtype"]]
    out = Path(req["output"]).absolute()
    rid = ctx.request_id
    done = output.already(out, "export-hf", rid, req["overwrite"], ctx)
    if done is not None:
        return done
    summary = {"output": str(out), "checkpoint": str(src["folder"]), "checkpoint_format": src["kind"],
               "model": model.name, "architecture": config["architectures"][0], "dtype": src["dtype"]}
    if ctx.dry_run:
        return {"dry_run": True, **summary, "actions": [
            f"load {src['folder']} ({src['kind']}) whole on the CPU, as one TP 1 PP 1 piece",
            f"write config.json ({'the original' if src['hf_dir'] else 'written for ' + config['model_type']}), "
            f"safetensors shards of at most {req['max_shard_gib']} GiB in {src['dtype']}, and the tokenizer files, "
            f"in a hidden folder beside {out}, then rename it to {out}"]}
    with output.claim(out, "export-hf", rid, req["overwrite"], ctx) as done:
        return done if done is not None else _export(req, src, model, config, summary, out, rid, ctx)


def _export(req: dict, src: dict, model, config: dict, summary: dict, out: Path, rid: str,
            ctx: Context) -> dict[str, Any]:
    """Load the checkpoint, write the Hugging Face folder beside out and put it in place (the
    caller holds the output's lock)."""
    from ..convert import hf as conv

    try:
        import torch
        from safetensors.torch import save_file
    except ImportError as e:
        raise ToolError("environment", f"the export needs torch, megatron-core and safetensors: {e}",
                        where="/checkpoint", fix="run tools/setup.sh") from None

    started = time.time()
    ctx.progress(f"export-hf: loading {src['folder']}")
    whole = checkpoint.read_whole(src["folder"], model, src["dtype"], src["layout"])
    missing = sorted(set(conv.megatron_shapes(model, 0)) - set(whole) - {"embedding.word_embeddings.weight",
                                                                          "output_layer.weight"})
    if missing:
        raise ToolError("bad_model", f"the checkpoint lacks {len(missing)} of the model's parameters, e.g. "
                        f"{missing[:3]}", where="/checkpoint", fix="give the model the checkpoint was trained as")
    tmp = output.staging(out, rid)
    try:
        limit = int(req["max_shard_gib"] * 2**30)
        dt = getattr(torch, TORCH_DTYPES[src["dtype"]])
        shard: dict[str, Any] = {}
        written: list[list[str]] = []  # each shard's tensor names, in the order written
        size = total = 0

        def flush() -> None:  # one shard at a time: the model and one shard are all that is held
            written.append(list(shard))
            save_file(shard, str(tmp / f"part-{len(written)}.safetensors"), metadata={"format": "pt"})
            ctx.progress(f"export-hf: wrote shard {len(written)} ({total / 2**30:.2f} GiB so far)")
            shard.clear()

        for name, tensor in conv.to_hf(whole.__getitem__, model):
            t = tensor.to(dt).contiguous()
            nbytes = t.numel() * t.element_size()
            if shard and size + nbytes > limit:
                flush()
                size = 0
            shard[name] = t
            size += nbytes
            total += nbytes
        flush()
        names = (["model.safetensors"] if len(written) == 1 else
                 [f"model-{k + 1:05d}-of-{len(written):05d}.safetensors" for k in range(len(written))])
        weight_map = {}
        for k, fname in enumerate(names):
            (tmp / f"part-{k + 1}.safetensors").rename(tmp / fname)  # named once the count is known
            weight_map.update({n: fname for n in written[k]})
        if len(written) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = []
        for d in {src["hf_dir"], src["tokenizer_dir"]} - {None}:
            for f in COMPANION_FILES:
                if f != "config.json" and (d / f).is_file() and not (tmp / f).exists():
                    shutil.copyfile(d / f, tmp / f)
                    copied.append(f)
        import resource

        result = {**summary, "files": names, "tensors": len(weight_map), "bytes_written": total,
                  "tokenizer_files": sorted(copied), "seconds": round(time.time() - started, 1),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        output.publish(tmp, out, "export-hf", rid, req, result)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


TOOL = Tool(name="export-hf", summary="Write a Megatron-Core checkpoint (import, GPU or CPU run, any layout) as a "
            "Hugging Face folder: safetensors, config.json, tokenizer files.", run=run)
