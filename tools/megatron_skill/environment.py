"""What this machine has, probed once for every tool that asks (doctor, train, bench, the
runtime): GPUs, Transformer Engine, NVIDIA apex. Probing imports nothing at module load."""
from __future__ import annotations

import importlib
import importlib.metadata as md
import shutil
import subprocess
from typing import Any

APEX_HOWTO = ("NVIDIA apex is not on PyPI: the PyPI package named 'apex' is an unrelated Pyramid toolkit. "
              "Build it from source: git clone https://github.com/NVIDIA/apex && cd apex && "
              "pip install -v --no-build-isolation --config-settings --build-option=--cpp_ext "
              "--config-settings --build-option=--cuda_ext ./  (or use an NGC PyTorch container)")


def version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def module(name: str):
    """The module, or None where it does not import (absent, or broken underneath)."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def have_transformer_engine() -> bool:
    return module("transformer_engine.pytorch") is not None


def gpu_count_and_name() -> tuple[int, str | None]:
    """(count, device name) of the CUDA GPUs torch sees here; (0, None) without torch or GPUs."""
    torch = module("torch")
    if torch is None or not torch.cuda.is_available():
        return 0, None
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def gpus() -> dict[str, Any]:
    """Every visible GPU with its memory and compute capability, the CUDA and NCCL versions
    torch was built with, and the driver's."""
    from .core.catalog import gpu_by_device_name

    torch = module("torch")
    out: dict[str, Any] = {"count": 0, "devices": []}
    if torch is not None and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cat = gpu_by_device_name(p.name)
            out["devices"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                   "compute_capability": f"{p.major}.{p.minor}",
                                   "catalog": cat.key if cat else None})
        out["count"] = len(out["devices"])
        out["cuda"] = torch.version.cuda
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            out["nccl"] = None
    if shutil.which("nvidia-smi"):
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            out["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
        except (subprocess.TimeoutExpired, OSError):
            out["driver"] = None
    return out


def apex() -> dict[str, Any]:
    """NVIDIA apex, told apart from the unrelated PyPI package of the same name."""
    mod = module("apex")
    if mod is None:
        return {"installed": False, "howto": APEX_HOWTO}
    nvidia = any(module(m) is not None for m in ("fused_layer_norm_cuda", "amp_C", "apex.normalization"))
    dists = md.packages_distributions().get("apex", [])
    if not nvidia:
        return {"installed": False, "impostor": True, "distribution": dists,
                "note": "the 'apex' that imports is not NVIDIA apex (no apex.normalization, no CUDA extensions)",
                "howto": "pip uninstall apex; then " + APEX_HOWTO}
    return {"installed": True, "cuda_extensions": module("amp_C") is not None}
