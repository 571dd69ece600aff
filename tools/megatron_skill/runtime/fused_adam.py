"""torch's fused AdamW kernel where Megatron falls back to torch's optimizer.

Without Transformer Engine or apex, Megatron-Core steps ``torch.optim.AdamW`` with torch's
default multi-tensor ('foreach') code. Each step it allocates the square root of the whole
shard's second moment as a temporary (4 bytes a parameter, on top of the 16 of weights,
gradients and state: the peak of the step) and passes over the state about ten times. A 3B
model trained in FP8 on one 80 GB GPU ran out of memory there (references/benchmarks.md).
torch's fused kernel (``fused=True``) updates in place in one pass.

Megatron builds the optimizer without a ``fused`` argument, so the switch is made on the
optimizer itself before each step (a step pre-hook): its parameter groups are marked fused,
and step counters left on the CPU (a checkpoint load puts them there) move to the
parameters' device, where the fused kernel wants them.
"""
from __future__ import annotations

import torch

_HANDLE = None


def _to_fused(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return
    for group in optimizer.param_groups:
        params = group["params"]
        # the fused kernel wants every tensor of a group on one device (install() asks for CUDA)
        if group.get("capturable") or group.get("differentiable") or len({p.device for p in params}) != 1:
            continue
        if not group.get("fused"):
            group["fused"], group["foreach"] = True, False
        for p in params:
            state = optimizer.state.get(p)
            step = state.get("step") if state else None
            if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
                state["step"] = step.to(device=p.device, dtype=torch.float32)


def install() -> bool:
    """Step every torch Adam / AdamW of this process with the fused kernel; False where
    Megatron uses TE's or apex's fused Adam (nothing to do) or no GPU is present."""
    global _HANDLE
    from megatron.core import optimizer as mcore_optimizer

    if not getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False) or not torch.cuda.is_available():
        return False
    if _HANDLE is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _HANDLE = register_optimizer_step_pre_hook(_to_fused)
    return True
