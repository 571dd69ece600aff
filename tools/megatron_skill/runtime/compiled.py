"""torch.compile for the skill's element-wise kernels, with the eager function as fallback.

Without Transformer Engine, the work between the GEMMs (RoPE, the loss's softmax over a 128k
vocabulary, FP8 casts) runs as chains of separate torch kernels, each reading and writing the
whole tensor (references/benchmarks.md has the profile).  Compiling one small function
per job lets Inductor fuse each chain into one or two kernels.  The same function runs eager
where compiling is off or impossible, so the CPU tests compare the two directly.

MEGATRON_SKILL_EAGER=1 turns compiling off (debugging, or a machine without a compiler).
"""
from __future__ import annotations

import functools
import os

import torch


def enabled() -> bool:
    return os.environ.get("MEGATRON_SKILL_EAGER", "0") != "1" and hasattr(torch, "compile")


def kernel(fn):
    """fn compiled on first use (static shapes: one kernel per shape, as Megatron's own
    jit_fuser does for SwiGLU), or fn itself when compiling is off.  ``fn.eager`` is the
    uncompiled function, for tests and for callers under an outer torch.compile."""
    compiled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled
        if not enabled() or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            _allow_recompiles()
            compiled = torch.compile(fn, dynamic=False, fullgraph=True)
        return compiled(*args, **kwargs)

    run.eager = fn
    return run


def _allow_recompiles(limit: int = 64) -> None:
    """One compiled graph per shape: the FP8 casts alone see a dozen shapes per model, more
    than Dynamo's default of 8, past which it would quietly run the function eager."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(torch._dynamo.config, name, limit) < limit:
            setattr(torch._dynamo.config, name, limit)
