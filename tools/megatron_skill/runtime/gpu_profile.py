"""Where one training iteration spends its GPU time, by kernel family.

Set MEGATRON_SKILL_PROFILE=<file.json> (bench does, with ``profile``) and the entry script
wraps Megatron's ``train_step`` so that one iteration (MEGATRON_SKILL_PROFILE_ITER, default
the 4th) runs under torch.profiler.  The kernels are summed by family (GEMM, attention,
cross-entropy, norm, optimizer, communication, other element-wise) and the biggest are
listed by name, so a throughput lever is chosen from measurement, not from a guess.
"""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict

# First match wins; names are CUDA kernel names as the profiler reports them.
FAMILIES = [
    ("attention", re.compile(r"flash|fmha|attention|cudnn.*(sdpa|mha)|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|sm90_|sm100_|ampere_|wgmma|matmul|scaled_mm", re.I)),
    ("communication", re.compile(r"nccl|allreduce|all_gather|reduce_scatter", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|_foreach|fused_adam", re.I)),
    ("cross_entropy", re.compile(r"cross_entropy|log_softmax|nll_loss|softmax", re.I)),
    ("norm", re.compile(r"rms_norm|layer_norm|rmsnorm|layernorm", re.I)),
    ("copy_cast", re.compile(r"copy|cat|transpose|to_copy|fill|memset|memcpy", re.I)),
]


def family(kernel_name: str) -> str:
    for name, pattern in FAMILIES:
        if pattern.search(kernel_name):
            return name
    return "elementwise_other"


def summarize(events) -> dict:
    """Kernel time by family and the 30 biggest kernels, from profiler events."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        # Kernels only: record_function ranges (e.g. "Optimizer.step#AdamW.step") also appear on
        # the device timeline as user annotations and would count their kernels twice.
        if str(getattr(e, "device_type", "")).endswith("CUDA") and not getattr(e, "is_user_annotation", False):
            us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) or 0.0
            rec = by_name[e.name]
            rec[0] += us
            rec[1] += 1
    by_family: dict[str, float] = defaultdict(float)
    for name, (us, _) in by_name.items():
        by_family[family(name)] += us
    total = sum(by_family.values()) or 1.0
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:30]
    return {
        "gpu_ms": round(total / 1e3, 2),
        "by_family": {k: {"ms": round(v / 1e3, 2), "share": round(v / total, 3)}
                      for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:120], "family": family(n), "ms": round(us / 1e3, 2), "calls": c}
                        for n, (us, c) in top],
    }


def install() -> bool:
    """Wrap megatron.training.training.train_step when MEGATRON_SKILL_PROFILE is set."""
    path = os.environ.get("MEGATRON_SKILL_PROFILE")
    if not path:
        return False
    if not os.path.isabs(path) and os.environ.get("RUN_DIR"):   # bench names it within the run directory
        path = os.path.join(os.environ["RUN_DIR"], path)
    target = int(os.environ.get("MEGATRON_SKILL_PROFILE_ITER", "4"))
    import megatron.training.training as training
    import torch

    original = training.train_step
    calls = {"n": 0}

    def train_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != target:
            return original(*args, **kwargs)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            out = original(*args, **kwargs)
            torch.cuda.synchronize()
        if torch.distributed.get_rank() == 0:
            summary = summarize(prof.events())
            summary["iteration"] = target
            with open(path, "w") as f:
                json.dump(summary, f, indent=1)
        return out

    training.train_step = train_step
    return True
