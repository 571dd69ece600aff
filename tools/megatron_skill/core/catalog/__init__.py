"""The model and GPU catalogs: data files in catalog/, looked up by name or alias."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from typing import Any

from ...errors import ToolError
from ...package_data import catalog_dir
from ..model import ModelConfig, build_spec, hash_once, state_without_hash

CATALOG_DIR = catalog_dir()


@functools.lru_cache(maxsize=None)
def _load(name: str) -> dict:
    return json.loads((CATALOG_DIR / name).read_text())


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _lookup(kind: str, table: dict, aliases: dict, name: str, where: str) -> tuple[str, Any]:
    key = _norm(name)
    key = aliases.get(key, key)
    if key in table:
        return key, table[key]
    close = difflib.get_close_matches(key, list(table) + list(aliases), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ToolError("not_found", f"unknown {kind} {name!r}", where=where,
                    fix=f"{hint}known {kind}s: {', '.join(sorted(table))}")


def model_names() -> list[str]:
    return sorted(_load("models.json")["models"])


def gpu_names() -> list[str]:
    return sorted(_load("gpus.json")["gpus"])


def get_model(name: str, where: str = "model") -> ModelConfig:
    data = _load("models.json")
    key, fields = _lookup("model", data["models"], data["aliases"], name, where)
    return build_spec(key, dict(fields), where=where)


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    __hash__ = hash_once
    __getstate__ = state_without_hash

    key: str
    name: str
    arch: str
    compute_capability: str
    memory_gib: float
    hbm_gbps: float
    bf16_dense_tflops: float
    fp8_dense_tflops: float | None
    nvlink_gbps: float
    nvlink_domain: int
    gpus_per_node: int
    network_gbps: float
    source: str
    # the GPU's link to its host's memory, one direction: PCIe Gen5 x16 (64 GB/s) on Hopper and
    # B200 boards, Gen4 x16 (32 GB/s) on A100, NVLink-C2C to the Grace CPU (450 GB/s) on GB200;
    # what activation offload's copies move over
    host_link_gbps: float = 64.0

    @property
    def supports_fp8(self) -> bool:
        return self.fp8_dense_tflops is not None and float(self.compute_capability) >= 8.9

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30


def get_gpu(name: str, where: str = "gpu") -> GPUSpec:
    data = _load("gpus.json")
    key, fields = _lookup("GPU", data["gpus"], data["aliases"], name, where)
    return GPUSpec(key=key, **fields)


def gpu_by_device_name(device_name: str) -> GPUSpec | None:
    """Map torch.cuda.get_device_name() (e.g. 'NVIDIA H200') to a catalog entry."""
    n = device_name.lower()
    rules = [("gb200", "gb200"), ("b200", "b200"), ("h200", "h200"), ("h100 nvl", "h100-nvl"),
             ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100", None)]
    for needle, key in rules:
        if needle in n:
            if key is None:  # A100: the memory size decides
                key = "a100-40gb" if "40gb" in n.replace(" ", "").replace("-", "") else "a100-80gb"
            return get_gpu(key)
    return None
