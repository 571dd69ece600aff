"""Weight gradients added straight into Megatron's fp32 main_grad, without apex or TE.

With gradient_accumulation_fusion, Megatron's linear layers hand their weight gradient to
apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output,
main_grad)``: one GEMM whose fp32 accumulator is added into the buffer (cuBLAS beta = 1).
Without the extension Megatron turns the fusion off, so every weight gradient is first
written in bf16 and DDP's hook then adds it to main_grad: an fp32 read-add-write of every
weight in every micro-batch, in a mixed-dtype kernel that runs at half the HBM rate
(references/benchmarks.md has what it costs).

``torch.addmm(..., out_dtype=torch.float32)`` is that GEMM on CUDA (torch >= 2.8); this
module stands in for the extension under its name, so Megatron's own code paths (the
layers' backward, and the deferred embedding wgrad in megatron.core.utils) call it.
"""
from __future__ import annotations

import sys
import types

import torch

EXTENSION = "fused_weight_gradient_mlp_cuda"


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for an fp32 acc, straight from the GEMM's accumulator where torch offers
    it (CUDA); elsewhere through an fp32 product (CPU has no mixed-dtype addmm)."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_((a.float() @ b.float()))


def addmm_into_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b whatever acc's dtype: fp32 from the GEMM's accumulator (addmm_fp32_), a bf16
    or fp16 acc in its own dtype, as Megatron's layers add into a bf16 main_grad (fp32 factors,
    as an fp32 model on CPU has, are cast to it)."""
    if acc.dtype == torch.float32:
        addmm_fp32_(acc, a, b)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output[tokens, out]^T @ total_input[tokens, in] (2-D, as
    Megatron's prepare_input_tensors_for_wgrad_compute leaves them)."""
    addmm_fp32_(main_grad, grad_output.t(), total_input)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same for a bf16 / fp16 main_grad (--grad-reduce-in-bf16)."""
    main_grad.addmm_(grad_output.t(), total_input)


def extension_present() -> bool:
    """apex's real extension, which Megatron would already be using."""
    mod = sys.modules.get(EXTENSION)
    if mod is not None:
        return not getattr(mod, "is_skill_stand_in", False)
    try:
        __import__(EXTENSION)
        return True
    except ImportError:
        return False


def install() -> bool:
    """Make Megatron's gradient-accumulation fusion use this module; False where apex's
    extension is present (nothing to do).  Call before the model is built: the layers check
    availability when they are constructed."""
    if extension_present():
        return False
    mod = types.ModuleType(EXTENSION)
    mod.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    mod.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    mod.is_skill_stand_in = True
    sys.modules[EXTENSION] = mod             # for megatron.core.utils, which imports it late
    import megatron.core.tensor_parallel.layers as layers

    layers.fused_weight_gradient_mlp_cuda = mod
    layers._grad_accum_fusion_available = True
    return True
