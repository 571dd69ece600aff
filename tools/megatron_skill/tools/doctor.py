"""The doctor tool: what is installed, what will be used, and what is missing.

Works with no GPU and no megatron (it says so).  It tells NVIDIA's apex from the
unrelated PyPI package named 'apex', and lists the Megatron flags this environment needs.
"""
from __future__ import annotations

import platform
import sys
from typing import Any

from .. import environment
from ..adapter import arguments as megatron_args
from ..contract import Context, Tool
from ..environment import module, version

TE_HOWTO = ("pip install --no-build-isolation 'transformer_engine[pytorch]' (needs the CUDA toolkit and cuDNN), "
            "or use an NGC PyTorch container, which ships it")


def diagnose() -> dict[str, Any]:
    torch = module("torch")
    te = module("transformer_engine.pytorch") if version("transformer_engine") or module("transformer_engine") else None
    megatron_ok = module("megatron.core") is not None
    gpus = environment.gpus()
    cc = max((float(d["compute_capability"]) for d in gpus["devices"]), default=0.0)
    fp8_hw = cc >= 8.9
    scaled_mm = bool(torch is not None and hasattr(torch, "_scaled_mm"))
    apex = environment.apex()
    flags = [] if te else list(megatron_args.NO_TE_FLAGS)
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpus": gpus,
        "packages": {
            "torch": torch.__version__ if torch else None,
            "megatron-core": version("megatron-core") if megatron_ok else None,
            "transformer_engine": version("transformer_engine") or (getattr(te, "__version__", None) if te else None),
            "apex": apex,
            "flash_attn": version("flash-attn") or version("flash_attn"),
            "jinja2": version("jinja2"), "jsonschema": version("jsonschema"),
            "shfmt-py": version("shfmt-py"),
        },
        "fp8": {"hardware": fp8_hw, "transformer_engine": bool(te and fp8_hw),
                "torch_scaled_mm": bool(scaled_mm and fp8_hw)},
        "will_use": {
            "transformer_impl": "transformer_engine" if te else "local",
            "core_attention": "Transformer Engine (cuDNN / flash)" if te else "torch SDPA (flash / cuDNN / efficient)",
            "extra_megatron_flags": flags,
            "train_backend": "gpu (megatron.training.pretrain)" if gpus["count"] else "cpu (tiny models only)",
        },
        "megatron_wheel": {},
    }
    if megatron_ok:
        from ..runtime import compat
        info["megatron_wheel"]["prebuilt_dataset_helpers"] = compat.prebuilt_helpers_available()
    problems = []
    if sys.version_info[:2] != (3, 12) and version("megatron-core") is None:
        problems.append({"what": "megatron-core 0.19 needs Python 3.12", "fix": "tools/setup.sh makes a 3.12 venv"})
    if torch is None:
        problems.append({"what": "torch is not installed", "fix": "tools/setup.sh"})
    if not megatron_ok:
        problems.append({"what": "megatron-core is not installed (plan, render and validate still work)",
                         "fix": "tools/setup.sh, or pip install 'megatron-core>=0.19.2,<0.20' on Python 3.12"})
    if not te:
        problems.append({"what": "Transformer Engine is not installed: local layers, no FP8 through TE, no CP",
                         "fix": TE_HOWTO})
    if (shfmt := _shfmt_problem()) is not None:
        problems.append(shfmt)
    if apex.get("impostor"):
        problems.append({"what": apex["note"], "fix": apex["howto"]})
    if not gpus["count"]:
        problems.append({"what": "no CUDA GPU visible", "fix": "train and bench need one; the CPU loop trains tiny models"})
    info["problems"] = problems
    return info


def _shfmt_problem() -> dict[str, str] | None:
    """validate reads launch scripts through shfmt's parser (adapter/shell.py): its binary must be there."""
    from ..adapter import shell
    from ..errors import ToolError

    try:
        shell.shfmt_binary()
    except ToolError as e:
        return {"what": f"{e.message}: validate cannot read launch scripts (--args still works)", "fix": e.fix or ""}
    return None


def summary_text(info: dict[str, Any]) -> str:
    g = info["gpus"]
    gpu = (f"{g['count']} x {g['devices'][0]['name']} ({g['devices'][0]['memory_gib']} GiB, sm_"
           f"{g['devices'][0]['compute_capability'].replace('.', '')})" if g["count"] else "no GPU")
    p = info["packages"]
    lines = [f"GPUs: {gpu}; driver {g.get('driver')}, CUDA {g.get('cuda')}, NCCL {g.get('nccl')}",
             f"torch {p['torch']}, megatron-core {p['megatron-core']}, TE {p['transformer_engine']}, "
             f"apex {'yes' if p['apex'].get('installed') else 'no'}, flash-attn {p['flash_attn']}",
             f"will use: {info['will_use']['transformer_impl']} layers, {info['will_use']['core_attention']}; "
             f"FP8 {'possible' if info['fp8']['transformer_engine'] or info['fp8']['torch_scaled_mm'] else 'not possible'}"]
    lines += [f"problem: {x['what']} -> {x['fix']}" for x in info["problems"]]
    return "\n".join(lines)


def run(req: dict, ctx: Context) -> dict[str, Any]:
    info = diagnose()
    ctx.progress(summary_text(info))
    return info


TOOL = Tool(name="doctor", summary="Report GPUs, driver, CUDA, NCCL, torch, megatron-core, TE, apex, "
                     "flash-attn and FP8 support, and the flags this environment needs.", run=run)
