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

from .. import files, pickles
from ..contract import Context, Tool
from ..convert import checkpoint, output
from ..convert.hf import COMPANION_FILES
from ..errors import ToolError

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _source(req: dict) -> dict[str, Any]:
    """The checkpoint root and iteration folder, the model, the original HF folder (or None) and
    the dtype to write."""
    from ..core.model import from_hf_config
    from ..core.resolve import resolve_model

    root = files.folder(req["checkpoint"], "/checkpoint", "checkpoint folder")
    checkpoint.check_tracker(root, "/checkpoint")
    folder = checkpoint.iteration_dir(root)
    if folder.is_dir():  # read without running it before anything loads it (its pickles could run code)
        pickles.scan_checkpoint(folder, "/checkpoint")
    what = checkpoint.kind(folder) if folder.is_dir() else None
    if what is None:
        raise ToolError("not_found", f"{folder} holds no Megatron checkpoint", where="/checkpoint",
                        fix="give a folder with latest_checkpointed_iteration.txt, or one iteration's folder")
    record = output.record_of(root) or {}
    home = root
    if not record and root.name == checkpoint.RELEASE:  # an import's release/ folder, given itself
        record, home = output.record_of(root.parent) or {}, root.parent
    hf_dir = None
    stored = None
    if record.get("tool") == "import-hf":
        hf_dir, stored = home / "hf", record["result"].get("dtype")
    run_request, unread = _run_request(root)
    if req.get("model") is not None or req.get("hf_config") is not None:
        model = resolve_model(req)
        if req.get("hf_config") is not None:
            hf_dir = _config_folder(req["hf_config"])
    elif hf_dir is not None:
        model = from_hf_config(hf_dir)
    elif run_request is not None:
        model = resolve_model(run_request)
        if run_request.get("hf_config"):
            hf_dir = _config_folder(run_request["hf_config"])
    else:
        raise ToolError("bad_request", f"nothing beside {root} says which model it holds"
                        + (f" ({unread} is not a train request)" if unread else ""), where="/model",
                        fix="give model or hf_config (the model the checkpoint was trained as)")
    tokenizer_dir = hf_dir
    if run_request is not None:
        tok = (run_request.get("training") or {}).get("tokenizer_model")
        if tok and Path(tok).is_dir():
            tokenizer_dir = Path(tok)
    dtype = req["dtype"]
    if dtype == "auto":  # the checkpoint's own: its record's, else what its torch_dist metadata holds
        dtype = stored or (checkpoint.stored_dtype(folder) if what == "torch_dist" else "fp32") or "bf16"
    layout = (run_request or {}).get("layout") or {}
    return {"root": root, "folder": folder, "kind": what, "model": model, "hf_dir": hf_dir,
            "tokenizer_dir": tokenizer_dir, "dtype": dtype, "layout": layout}


def _run_request(root: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """The train request recorded by the run a checkpoint folder belongs to (RUN_DIR/request.json,
    beside or above it), checked as train checks a request; else None, and the file that was there
    but is not such a record (not JSON, not an object, a model of the wrong type)."""
    from ..contract import validate_request

    for cand in (root.parent / "request.json", root.parent.parent / "request.json"):
        if files.kind_of(cand) == "missing":
            continue
        record = files.read_record(cand)
        try:
            return (validate_request("train", record), None) if record is not None else (None, cand)
        except ToolError:
            return None, cand
    return None, None


def _config_folder(path: str) -> Path:
    """The folder of an hf_config (a folder, or its config.json)."""
    p = Path(path)
    return p if files.kind_of(p) == "folder" else p.parent


def run(req: dict, ctx: Context) -> dict[str, Any]:
    from ..convert import hf as conv

    src = _source(req)
    model = src["model"]
    if src["hf_dir"] is not None and files.kind_of(src["hf_dir"] / "config.json") != "missing":
        config = files.read_json_object(src["hf_dir"] / "config.json", "/hf_config", "config.json", code="bad_model")
        conv.check_config(config, where="/hf_config")
    else:
        config = conv.hf_config_for(model)
    config["torch_dtype"] = config["dtype"] = TORCH_DTYPES[src["dtype"]]
    out = output.check(Path(req["output"]).absolute())
    rid = ctx.request_id
    inputs = _inputs(src)
    done = output.already(out, "export-hf", rid, req["overwrite"], ctx, inputs)
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
    with output.claim(out, "export-hf", rid, req["overwrite"], ctx, inputs) as done:
        return done if done is not None else _export(req, src, model, config, summary, out, rid, ctx, inputs)


def _inputs(src: dict[str, Any]) -> dict[str, list[int]]:
    """The fingerprint of what an export reads: the checkpoint's files, config.json, the tokenizer's."""
    ckpt = [p for p in Path(src["folder"]).rglob("*")] if src["folder"].is_dir() else []
    extra = [d / f for d in {src["hf_dir"], src["tokenizer_dir"]} - {None} for f in COMPANION_FILES]
    return files.fingerprint(ckpt + extra)


def _export(req: dict, src: dict, model, config: dict, summary: dict, out: Path, rid: str,
            ctx: Context, inputs: dict[str, list[int]]) -> dict[str, Any]:
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
        dtype = getattr(torch, TORCH_DTYPES[src["dtype"]])
        tensors = ((name, tensor.to(dtype).contiguous()) for name, tensor in conv.to_hf(whole.__getitem__, model))
        names, weight_map, total = _write_shards(tensors, tmp, int(req["max_shard_gib"] * 2**30), save_file, ctx)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = _copy_companions(src, tmp)
        import resource

        result = {**summary, "files": names, "tensors": len(weight_map), "bytes_written": total,
                  "tokenizer_files": sorted(copied), "seconds": round(time.time() - started, 1),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        output.publish(tmp, out, "export-hf", rid, req, result, inputs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _write_shards(tensors, tmp: Path, limit: int, save_file, ctx: Context) -> tuple[list[str], dict[str, str], int]:
    """The Hugging Face tensors (name, tensor) written into tmp as safetensors shards of at most
    limit bytes (a larger tensor alone), named as transformers names them, with the index where
    there are several: (the shards' names, each tensor's shard, the bytes written)."""
    shard: dict[str, Any] = {}
    written: list[list[str]] = []  # each shard's tensor names, in the order written
    size = total = 0

    def flush() -> None:  # one shard at a time: the model and one shard are all that is held
        written.append(list(shard))
        save_file(shard, str(tmp / f"part-{len(written)}.safetensors"), metadata={"format": "pt"})
        ctx.progress(f"export-hf: wrote shard {len(written)} ({total / 2**30:.2f} GiB so far)")
        shard.clear()

    for name, t in tensors:
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
    return names, weight_map, total


def _copy_companions(src: dict, tmp: Path) -> list[str]:
    """The tokenizer's and generation's files from the source's Hugging Face folders (config.json
    is written anew); the names copied."""
    copied = []
    for d in {src["hf_dir"], src["tokenizer_dir"]} - {None}:
        for f in COMPANION_FILES:
            if f != "config.json" and (d / f).is_file() and not (tmp / f).exists():
                shutil.copyfile(d / f, tmp / f)
                copied.append(f)
    return copied


TOOL = Tool(name="export-hf", summary="Write a Megatron-Core checkpoint (import, GPU or CPU run, any layout) as a "
            "Hugging Face folder: safetensors, config.json, tokenizer files.", run=run)
