"""Norms for Megatron-Core's local layers that also work with sequence parallelism.

Without Transformer Engine or apex, Megatron's local spec builds torch norms through
WrappedTorchNorm, which refuses --sequence-parallel: with SP each TP rank normalises only
its slice of the sequence, so the norm weights' gradients must be summed over the TP
group.  Megatron does that sum for every parameter marked ``sequence_parallel`` (its
fused and TE norms mark theirs); this norm is torch's, marked the same way.
"""
from __future__ import annotations

import torch


class SequenceParallelNorm:
    """Builds torch.nn.RMSNorm or LayerNorm, as WrappedTorchNorm does, with SP allowed."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero-centered gamma needs Transformer Engine or apex")
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True  # Megatron all-reduces these grads over the TP group
        return norm
