"""Rotary embeddings in one kernel each way: Megatron's own unfused RoPE, compiled.

Without Transformer Engine, Megatron-Core applies RoPE (``--no-rope-fusion``) as a chain of
torch kernels over the query and key tensors: slice, multiply by cos, rotate-half (a
concatenation), multiply by sin, add, concatenate the pass-through part; the backward
mirrors it.  Compiling Megatron's own function, unchanged, keeps its exact formula (so
interleaved, MLA-style and partial rotary all behave as Megatron's) and fuses the chain.
"""
from __future__ import annotations

from . import compiled


def install() -> bool:
    """Route Megatron's unfused bshd RoPE through the compiled copy; True if it now does."""
    from megatron.core.models.common.embeddings import rope_utils

    current = rope_utils._apply_rotary_pos_emb_bshd
    if getattr(current, "eager", None) is not None:
        return True
    rope_utils._apply_rotary_pos_emb_bshd = compiled.kernel(current)
    return True


def uninstall() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    current = rope_utils._apply_rotary_pos_emb_bshd
    if getattr(current, "eager", None) is not None:
        rope_utils._apply_rotary_pos_emb_bshd = current.eager
