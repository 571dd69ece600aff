"""Delayed scaling for the FP8 linear layers: each GEMM input read once to cast it.

Current scaling (fp8_linear.quantize) reads a tensor twice, once for its absolute maximum and
once to cast it: on the 1B shape on an H100 the maximum's reductions were 56 ms of a 1,726 ms
step, beside 115 ms of casts (references/results/h100-2026-12-06/calibration-2/levers/
1b-fp8-planned-profile.profile.json).  Delayed scaling, Transformer Engine's "delayed" recipe
as Megatron runs it by default (--fp8-recipe delayed, --fp8-amax-history-len 1, most recent),
scales an input by the maximum the same input of the same layer had in its previous pass, and
measures this pass's maximum while casting it: one read.  A value beyond the previous maximum
saturates at the format's largest (E4M3 448, E5M2 57344) as TE's casts do; a previous maximum
of zero or not finite scales by one, as TE does.  The first pass of an input has no history and
takes its own maximum (current scaling).

On a CUDA GPU the cast, its transpose and the maximum are one Triton kernel; elsewhere (the CPU
tests) the same numbers come from torch's own operations.
"""
from __future__ import annotations

import functools

import torch

from . import fp8_linear
from .fp8_linear import MAX, quantize_with_transpose


def use(scaling: str) -> None:
    """The FP8 linear layers' scaling from now on: "delayed" (each layer keeps its maxima in a
    LayerScaling) or "current"."""
    fp8_linear.LAYER_SCALING = LayerScaling if scaling == "delayed" else None


def scale_from(amax: torch.Tensor, dtype) -> torch.Tensor:
    """The scale a previous maximum gives: amax times 1 / the format's largest (a product, so
    that the Triton kernel computes the same bits), or one where that maximum is zero or not
    finite."""
    return torch.where((amax > 0) & torch.isfinite(amax), amax * (1.0 / MAX[dtype]), torch.ones_like(amax))


def cast_transpose_amax(t: torch.Tensor, prev_amax: torch.Tensor, dtype) -> tuple[torch.Tensor, ...]:
    """For a 2-D t and the maximum of the previous pass: (t times 1 / scale, saturated to dtype's
    range, its transpose contiguous, the scale, t's own absolute maximum in fp32); no host
    synchronisation.  Both paths multiply by an IEEE reciprocal, as Transformer Engine's casts do,
    so that torch's and the Triton kernel's results agree bit for bit (a division by a scalar is a
    product with its reciprocal in some of torch's kernels and an approximation in Triton's: the
    first kernel, which divided, differed on two of three shapes; this one matched on all three,
    both formats, on an H100 on 2026-12-06: references/results/h100-2026-12-06/session6/
    kernel-check.txt, by benchmarks/fp8_delayed_lease.sh; test_delayed_scaling_kernel_matches_torch_on_cuda)."""
    if t.is_cuda and t.is_contiguous() and _triton_kernel() is not None:
        return _cast_transpose_amax_triton(t, prev_amax, dtype)
    scale = scale_from(prev_amax, dtype)
    q = (t.float() * torch.reciprocal(scale)).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q, q.t().contiguous(), scale, t.detach().abs().amax().float()


class DelayedScaling:
    """The maximum of one GEMM input of one layer (its activations, or its output gradient), kept
    from one pass to the next on the GPU."""

    def __init__(self) -> None:
        self.amax: torch.Tensor | None = None

    def quantize(self, t: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, q transposed, scale): t / scale in FP8 with the scale from the previous pass."""
        if self.amax is None:
            q, q_t, scale = quantize_with_transpose(t, dtype)
            self.amax = scale * MAX[dtype]
            return q, q_t, scale
        q, q_t, scale, self.amax = cast_transpose_amax(t, self.amax, dtype)
        return q, q_t, scale


class LayerScaling:
    """What one FP8 linear layer keeps: its input's and its output gradient's maxima."""

    def __init__(self) -> None:
        self.x, self.g = DelayedScaling(), DelayedScaling()


@functools.cache
def _triton_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(x_ptr, q_ptr, qt_ptr, prev_ptr, scale_ptr, amax_ptr, M, N, FMAX: tl.constexpr, INV_FMAX: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr):
        prev = tl.load(prev_ptr)
        usable = (prev > 0) & (prev < float("inf"))
        scale = tl.where(usable, prev * INV_FMAX, 1.0)
        # the reciprocal by IEEE division (div_rn), as torch.reciprocal: Triton's "/" on fp32 is
        # an approximation, and an ulp moves values across FP8 rounding boundaries
        inv = tl.math.div_rn(tl.full((), 1.0, tl.float32), scale)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_ptr, scale)
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        y = tl.clamp(x * inv, -FMAX, FMAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], y, mask=mask)
        # the transposed tile written along the transpose's rows: coalesced stores
        tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(y), mask=(rn[:, None] < N) & (rm[None, :] < M))

    return kernel


def _cast_transpose_amax_triton(t: torch.Tensor, prev_amax: torch.Tensor, dtype):
    import triton

    m, n = t.shape
    q = torch.empty((m, n), dtype=dtype, device=t.device)
    q_t = torch.empty((n, m), dtype=dtype, device=t.device)
    scale = torch.empty((), dtype=torch.float32, device=t.device)
    amax = torch.zeros((), dtype=torch.float32, device=t.device)
    bm = bn = 64
    _triton_kernel()[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        t, q, q_t, prev_amax, scale, amax, m, n, FMAX=MAX[dtype], INV_FMAX=1.0 / MAX[dtype], BM=bm, BN=bn, num_warps=4)
    return q, q_t, scale, amax
