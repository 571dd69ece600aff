"""The core-attention kernel a run uses where it is not the one the planner plans for.

The planner costs the kernels the skill's runs use: Transformer Engine's fused / flash attention,
or torch SDPA's causal kernel on the local layers (calibrated, core/timing.py). A stock script's
arguments can ask for slower ones (adapter/described.py reads which): SDPA handed Megatron's
explicit [s, s] mask, or Megatron's unfused DotProductAttention. Their cost is counted here, so
that plan-like predictions of such a run (logs' "why slow") come from the step-time model itself.
"""
from __future__ import annotations

import dataclasses

# Torch SDPA handed Megatron's explicit [s, s] mask runs the whole square with a slower kernel:
# on one H200 the 1B shape's attention took 995 ms an iteration with the mask and 338 ms with the
# causal kernel (references/benchmarks.md, "Throughput levers").
MASKED_SDPA_FACTOR = 995 / 338
# Megatron's local DotProductAttention (unfused) computes the whole [b, heads, s, s] score matrix
# with two batched GEMMs and passes over it in between. Bytes per score element, counted pass by
# pass in its 0.19 code: the GEMMs' own traffic (scores written, probabilities read forward; the
# probabilities' gradient written, the probabilities and the scores' gradient twice read
# backward) 12; the mask filled in place (read, write, mask) 5 and softmax (read, write) 4
# forward, softmax's gradient (two reads, a write) 6, the mask's (5) and the scale's (4)
# backward: 24. Attention dropout adds its mask and output both ways (10); the softmax in fp32
# its casts and wider passes (12).
UNFUSED_GEMM_BYTES = 12
UNFUSED_PASS_BYTES = 24
UNFUSED_DROPOUT_BYTES = 10
UNFUSED_FP32_SOFTMAX_BYTES = 12
KINDS = ("planned", "sdpa_masked", "unfused")


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """kind: 'planned' (the kernel the planner plans for), 'sdpa_masked' or 'unfused'; the
    unfused kernel's cost also depends on its softmax precision and attention dropout."""
    kind: str = "planned"
    fp32_softmax: bool = False
    dropout: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"attention kernel {self.kind!r}: one of {', '.join(KINDS)}")


PLANNED = AttentionKernel()


def unfused_seconds(kernel: AttentionKernel, scores: float, head_dim: int, gemm_flops: float, hbm: float) -> float:
    """Seconds of one layer's unfused core attention, forward and backward, over `scores`
    elements of the [b, heads, s, s] matrix (one rank's micro-batch): the score GEMMs over the
    whole square at gemm_flops (FLOP/s at this head dimension), no faster than their own bytes
    at hbm (B/s), and the passes over the scores at hbm."""
    gemm = max(3 * 2 * 2 * scores * head_dim / gemm_flops, UNFUSED_GEMM_BYTES * scores / hbm)
    passes = (UNFUSED_PASS_BYTES + UNFUSED_DROPOUT_BYTES * kernel.dropout
              + UNFUSED_FP32_SOFTMAX_BYTES * kernel.fp32_softmax)
    return gemm + passes * scores / hbm
