"""FP8 linear layers for Megatron-Core's local spec, without Transformer Engine.

Current per-tensor scaling, as TE's "tensorwise" recipe: each GEMM input is scaled by its
own absolute maximum into the FP8 range just before the product (E4M3 for activations and
weights, E5M2 for gradients, the "hybrid" format), and the product runs through
``torch._scaled_mm`` on GPUs that have FP8 tensor cores (compute capability 8.9 or newer).
Elsewhere (CPU, older GPUs) the same quantised values are multiplied in fp32, which is what
the CPU tests compare against the plain layers.  The activations saved for the backward are
kept in FP8, half the bytes of BF16.

Scope: the layers take the FP8 path only where the product needs no tensor-parallel
communication inside it (TP 1, or a layer without sequence parallelism and without the
asynchronous gradient all-reduce); elsewhere they are Megatron's own BF16 layers.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from . import compiled

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
# What each layer keeps to scale its inputs: None for current scaling (each tensor by its own
# maximum); under the request's runtime.fp8_scaling "delayed", fp8_delayed.use() sets it to
# fp8_delayed.LayerScaling before the model runs (the entry, or the CPU loop).
LAYER_SCALING = None


def quantize(t: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t / scale in FP8, scale) with scale = amax / FP8 max: no host synchronisation."""
    scale = (t.detach().abs().amax().float() / MAX[dtype]).clamp(min=1e-12)
    return (t.float() / scale).to(dtype), scale


@compiled.kernel
def quantize_with_transpose(t: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize(t) and its transpose, contiguous: the layouts the FP8 GEMMs want for the
    forward and for the backward (cuBLAS's FP8 kernels take only "TN" operands).  Compiled,
    this is one reduction and one kernel writing both layouts, where eager torch makes an
    fp32 copy, a scaled copy, the cast and then the transposed copy."""
    q, scale = quantize(t, dtype)
    return q, q.t().contiguous(), scale


def _has_fp8_tensor_cores(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 9)


def scaled_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out_dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """(a * sa) @ (b * sb) for FP8 a [m, k] and b [k, n].  ``fast_accum``: Hopper's FP8
    accumulation without periodic promotion to fp32, as Transformer Engine uses for the
    forward GEMM (and not for the gradients' GEMMs, whose sums are longer)."""
    if _has_fp8_tensor_cores(a):
        # cuBLAS wants a row-major and b column-major.
        a = a.contiguous()
        b = b.t().contiguous().t()
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)


class _WeightCache:
    """FP8 copies of the weights, made once per optimizer step: weights are the same in every
    micro-batch of one step. Emptied by a hook on every torch optimizer's step (Megatron's
    optimizers step a torch one inside), so that whatever loop runs the step, no FP8 copy
    outlives the weights it was made from (a parameter's version counter is no guide: the
    distributed optimizer and its all-gather write weights without touching it)."""

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple] = {}
        self.hook = None

    @property
    def enabled(self) -> bool:
        return self.hook is not None

    def enable(self) -> None:
        if self.hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            self.hook = register_optimizer_step_post_hook(lambda *_: self.entries.clear())

    def disable(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        self.entries.clear()


WEIGHT_CACHE = _WeightCache()


def _quantized_weight(w: torch.Tensor):
    if not WEIGHT_CACHE.enabled:
        return quantize_with_transpose(w, E4M3)
    key = (id(w), w.data_ptr(), tuple(w.shape))
    hit = WEIGHT_CACHE.entries.get(key)
    if hit is None:
        hit = WEIGHT_CACHE.entries[key] = quantize_with_transpose(w, E4M3)
    return hit


class FP8Matmul(torch.autograd.Function):
    """y = x @ w.T with x [m, k], w [n, k]; FP8 forward and backward products."""

    @staticmethod
    def forward(ctx, x, w, scaling=None):
        """scaling: the layer's fp8_delayed.LayerScaling, or None for current scaling."""
        xq, xq_t, sx = scaling.x.quantize(x, E4M3) if scaling else quantize_with_transpose(x, E4M3)
        wq, wq_t, sw = _quantized_weight(w)
        ctx.save_for_backward(xq_t, sx, wq_t, sw)
        ctx.dtypes, ctx.scaling = (x.dtype, w.dtype), scaling
        return scaled_mm(xq, sx, wq.t(), sw, x.dtype, fast_accum=True)   # wq.t(): column-major as is

    @staticmethod
    def backward(ctx, gy):
        xq_t, sx, wq_t, sw = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        gq, gq_t, sg = ctx.scaling.g.quantize(gy, E5M2) if ctx.scaling else quantize_with_transpose(gy, E5M2)
        gx = scaled_mm(gq, sg, wq_t.t(), sw, x_dtype)            # [m, n] @ [n, k]
        gw = scaled_mm(gq_t, sg, xq_t.t(), sx, w_dtype)          # [n, m] @ [m, k]
        return gx, gw, None


def _fp8_ok(x: torch.Tensor, w: torch.Tensor, kwargs: dict) -> bool:
    """FP8 here only when Megatron's linear function would not communicate, and the GEMM
    dimensions suit FP8 kernels (multiples of 16)."""
    if kwargs.get("sequence_parallel") or kwargs.get("allreduce_dgrad"):
        return False
    if not w.requires_grad and torch.is_grad_enabled():
        return False
    return x.shape[-1] % 16 == 0 and w.shape[0] % 16 == 0 and x.numel() // x.shape[-1] % 16 == 0


def _layer_scaling(layer):
    if LAYER_SCALING is None:
        return None
    if getattr(layer, "_fp8_scaling", None) is None:
        layer._fp8_scaling = LAYER_SCALING()
    return layer._fp8_scaling


def _fp8_forward_impl(layer, plain, input, weight, *args, **kwargs):
    """Megatron's _forward_impl contract (it passes everything by keyword): FP8 when it can,
    else ``plain``, Megatron's own implementation."""
    bias = kwargs.get("bias", args[0] if args else None)
    if not _fp8_ok(input, weight, kwargs):
        return plain(input, weight, *args, **kwargs)
    x2d = input.reshape(-1, input.shape[-1])
    out = FP8Matmul.apply(x2d, weight, _layer_scaling(layer)).view(*input.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


class FP8ColumnParallelLinear(ColumnParallelLinear):
    def _forward_impl(self, input, weight, *args, **kwargs):
        return _fp8_forward_impl(self, super()._forward_impl, input, weight, *args, **kwargs)


class FP8RowParallelLinear(RowParallelLinear):
    def _forward_impl(self, input, weight, *args, **kwargs):
        return _fp8_forward_impl(self, super()._forward_impl, input, weight, *args, **kwargs)
