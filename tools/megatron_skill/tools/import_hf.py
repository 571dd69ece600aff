"""The import-hf tool: a local Hugging Face checkpoint -> a Megatron-Core torch_dist checkpoint.

Everything is checked before any work: the architecture and its RoPE, the layout against the
model, every tensor's presence and shape from the safetensors headers. Then one torchrun worker
per TP x PP x EP rank converts its own piece on the CPU and the workers save together
(convert/checkpoint.py). The result is a folder that train loads as a pretrained checkpoint:

  OUTPUT/latest_checkpointed_iteration.txt   "release"
  OUTPUT/release/                            the torch_dist checkpoint (loads at any layout)
  OUTPUT/hf/                                 config.json and the tokenizer files, copied
  OUTPUT/conversion.json                     the request and this answer
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .. import files
from ..contract import Context, Tool
from ..convert import checkpoint, output
from ..convert.hf import COMPANION_FILES
from ..errors import ToolError

SAFETENSORS_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


def inspect(req: dict) -> dict[str, Any]:
    """The model, its family, the layout and the weights' files, or the first ToolError."""
    from ..convert import hf as conv
    from ..core.model import from_hf_config

    folder = files.folder(req["hf_model"], "/hf_model", "Hugging Face model folder")
    if files.kind_of(folder / "config.json") == "missing":
        raise ToolError("not_found", f"no config.json in {folder}", where="/hf_model",
                        fix="give a local Hugging Face model folder (nothing is downloaded)")
    cfg = files.read_json_object(folder / "config.json", "/hf_model", "config.json", code="bad_model")
    family = conv.check_config(cfg)
    model = from_hf_config(folder)
    lay = req["layout"]
    tp, pp, ep = lay["tp"], lay["pp"], lay["ep"]
    why = None
    if model.num_attention_heads % tp or model.query_groups % tp:
        why = (f"TP {tp} does not divide the {model.num_attention_heads} heads and {model.query_groups} "
               "key/value groups", "/layout/tp")
    elif model.num_layers % pp:
        why = f"PP {pp} does not split {model.num_layers} layers evenly", "/layout/pp"
    elif ep > 1 and (not model.num_experts or model.num_experts % ep):
        why = f"EP {ep} does not divide the model's {model.num_experts or 0} experts", "/layout/ep"
    if why:
        raise ToolError("bad_request", f"the checkpoint cannot be split this way: {why[0]}", where=why[1],
                        fix="the torch_dist checkpoint loads at any layout: import at TP 1 PP 1 EP 1 "
                            "(or a layout that divides the model) and train at the planned one")
    weights = conv.check_weights(folder, model)
    dtype = req["dtype"]
    if dtype == "auto":
        stored = {SAFETENSORS_DTYPES.get(d, "fp32") for d in weights["dtypes"]}
        dtype = stored.pop() if len(stored) == 1 else "fp32"
    notes = list(model.approximations)   # what check_config lets through: a sliding window
    return {"folder": folder, "family": family, "model": model, "weights": weights, "dtype": dtype,
            "tp": tp, "pp": pp, "ep": ep, "notes": notes, "inputs": inputs_of(folder, weights["files"])}


def inputs_of(folder: Path, weight_files: list[str]) -> dict[str, list[int]]:
    """The fingerprint (sizes, modification times) of every file an import reads: a recorded result
    is given again only while it matches."""
    names = [*weight_files, "model.safetensors.index.json", *COMPANION_FILES]
    return files.fingerprint([folder / n for n in names])


def run(req: dict, ctx: Context) -> dict[str, Any]:
    info = inspect(req)
    out = output.check(Path(req["output"]).absolute())
    rid = ctx.request_id
    done = output.already(out, "import-hf", rid, req["overwrite"], ctx, info["inputs"])
    if done is not None:
        return done
    workers = info["tp"] * info["pp"] * info["ep"]
    w = info["weights"]
    summary = {"output": str(out), "checkpoint": str(out / checkpoint.RELEASE), "family": info["family"],
               "model": info["model"].name, "dtype": info["dtype"],
               "layout": {"tp": info["tp"], "pp": info["pp"], "ep": info["ep"]},
               "tensors": w["tensors"], "bytes_read": w["bytes"], "workers": workers, "notes": info["notes"],
               "unused_tensors": w["unused"][:20]}
    if ctx.dry_run:
        return {"dry_run": True, **summary, "actions": [
            f"read {len(w['files'])} safetensors file(s) of {info['folder']} ({w['bytes'] / 2**30:.2f} GiB), "
            "one tensor at a time",
            f"convert on the CPU in {workers} torchrun worker(s) over gloo, each its own TP x PP x EP piece",
            f"save a torch_dist release checkpoint (dtype {info['dtype']}) and copy config.json and the tokenizer "
            f"files, in a hidden folder beside {out}, then rename it to {out}"]}
    try:
        import megatron.core  # noqa: F401
        import psutil  # noqa: F401  (megatron.core's torch_dist writer needs it)
        import safetensors  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        raise ToolError("environment", f"the conversion needs torch, megatron-core, safetensors and psutil: {e}",
                        where="/hf_model", fix="run tools/setup.sh") from None
    waited, patience = 0.0, wait_seconds()
    while True:
        started = time.time()
        try:
            with output.claim(out, "import-hf", rid, req["overwrite"], ctx, info["inputs"]) as done:
                return done if done is not None else _convert(req, info, summary, out, rid, ctx, started)
        except output.OutputBusy:
            if waited >= patience:
                raise
            ctx.progress(f"import-hf: another process is converting into {out}; waiting for it "
                         f"({waited:.0f} of {patience:.0f} s, {WAIT_VARIABLE})")
            pause = min(WAIT_STEP, patience - waited)
            time.sleep(pause)
            waited += pause


# How long to wait while another process converts into the same output (a job's other nodes,
# a second submission): an environment variable, not a request field, so that the request and
# its id stay those of the same import run by hand.
WAIT_VARIABLE = "MEGATRON_SKILL_IMPORT_WAIT"
WAIT_STEP = 10.0


def wait_seconds() -> float:
    """The seconds MEGATRON_SKILL_IMPORT_WAIT allows (0 when unset: a busy output is a conflict at once)."""
    text = os.environ.get(WAIT_VARIABLE, "").strip()
    try:
        value = float(text) if text else 0.0
    except ValueError:
        raise ToolError("bad_request", f"{WAIT_VARIABLE}={text!r} is not a number of seconds", where=WAIT_VARIABLE,
                        fix=f"set {WAIT_VARIABLE} to the seconds to wait for another import (e.g. 7200), or unset it") from None
    if not 0 <= value <= 7 * 86400:  # NaN fails this too
        raise ToolError("bad_request", f"{WAIT_VARIABLE}={text!r} is not between 0 and a week", where=WAIT_VARIABLE,
                        fix=f"set {WAIT_VARIABLE} to the seconds to wait for another import (e.g. 7200), or unset it")
    return value


def _convert(req: dict, info: dict, summary: dict, out: Path, rid: str, ctx: Context,
             started: float) -> dict[str, Any]:
    """Build the result in a staging folder beside out and put it in place (the caller holds the
    output's lock)."""
    w, workers = info["weights"], summary["workers"]
    tmp = output.staging(out, rid)
    try:
        release = tmp / checkpoint.RELEASE
        release.mkdir()
        report = tmp / ".report.json"
        cfg_path = tmp / ".worker.json"
        cfg_path.write_text(json.dumps({"hf_model": str(info["folder"].absolute()), "tp": info["tp"],
                                        "pp": info["pp"], "ep": info["ep"], "dtype": info["dtype"],
                                        "out": str(release), "report": str(report)}))
        ctx.progress(f"import-hf: {w['tensors']} tensors, {w['bytes'] / 2**30:.2f} GiB, {workers} worker(s)")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
               str(Path(checkpoint.__file__)), str(cfg_path)]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if proc.returncode != 0:
            raise ToolError("runtime", f"the conversion workers failed (exit {proc.returncode}); their output is "
                            "on stderr above", where="/hf_model", fix="see the first error the workers printed")
        peak = json.loads(report.read_text())["peak_rss_mib_per_worker"]
        report.unlink()
        cfg_path.unlink()
        (tmp / checkpoint.TRACKER).write_text(checkpoint.RELEASE)
        (tmp / "hf").mkdir()
        copied = [f for f in COMPANION_FILES if (info["folder"] / f).is_file()]
        for f in copied:
            shutil.copyfile(info["folder"] / f, tmp / "hf" / f)
        tokenizer = str(out / "hf") if "tokenizer.json" in copied else None
        result = {**summary, "seconds": round(time.time() - started, 1), "peak_rss_mib_per_worker": peak,
                  "hf_files": copied, "tokenizer": tokenizer,
                  "train_with": {"hf_config": str(out / "hf"), "pretrained": str(out),
                                 **({"training": {"tokenizer_model": tokenizer}} if tokenizer else {})},
                  "megatron_args": ["--pretrained-checkpoint", str(out), "--ckpt-format", "torch_dist",
                                    "--no-load-optim", "--no-load-rng"]}
        output.publish(tmp, out, "import-hf", rid, req, result, info["inputs"])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ctx.progress(f"import-hf: wrote {out} in {result['seconds']} s (peak {peak:.0f} MiB per worker)")
    return result


TOOL = Tool(name="import-hf", summary="Convert a local Hugging Face checkpoint (Llama, Mistral, Qwen2/3, Mixtral, "
            "Qwen3-MoE) into a Megatron-Core torch_dist checkpoint that train loads as pretrained weights.", run=run)
