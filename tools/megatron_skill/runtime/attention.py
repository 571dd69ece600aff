"""Core attention through torch.nn.functional.scaled_dot_product_attention.

Megatron-Core's local DotProductAttention materialises the [b, heads, s, s] score matrix
(and its fused softmax needs apex or TE); SDPA picks a flash / cuDNN / memory-efficient
kernel instead, so the no-TE path runs at flash-attention memory and speed.  It is a
drop-in for the ``core_attention`` submodule of Megatron's self-attention specs.
"""
from __future__ import annotations

import math
from typing import Optional

import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def _backends(name: str) -> list | None:
    """The SDPA kernel family to pin (--skill-sdpa-backend); None for auto: torch's own choice
    among the kernels that take the shape."""
    if name == "auto":
        return None
    from torch.nn.attention import SDPBackend
    return [{"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]]


class SDPAttention(MegatronModule):
    """Causal (or masked) attention over [s, b, heads, dim] tensors, GQA and MLA included.

    native_gqa and backend come from the layer spec (ModuleSpec params, specs.py): the kernel
    reads shared key/value heads itself (enable_gqa), and the SDPA kernel family to pin."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, native_gqa: bool = False, backend: str = "auto"):
        super().__init__(config=config)
        self.native_gqa = native_gqa
        self.backends = _backends(backend)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not do context parallelism: use Transformer Engine for CP > 1")
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        if getattr(config, "multi_latent_attention", False):
            head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention: packed sequences and attention bias need Transformer Engine")
        sq, b, heads, _ = query.shape
        q = query.permute(1, 2, 0, 3)   # [b, heads, sq, d]
        k = key.permute(1, 2, 0, 3)     # [b, groups, sk, d]
        v = value.permute(1, 2, 0, 3)
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # Megatron's masks are True where attention is NOT allowed
        gqa = {}
        if k.shape[1] != heads:
            if self.native_gqa:
                gqa["enable_gqa"] = True
            else:
                # GQA: expand keys and values to the query heads (enable_gqa is not taken by every kernel).
                k = k.repeat_interleave(heads // k.shape[1], dim=1)
                v = v.repeat_interleave(heads // v.shape[1], dim=1)
        dropout = self.dropout if self.training else 0.0
        if self.backends is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                 scale=self.softmax_scale, **gqa)
        else:
            from torch.nn.attention import sdpa_kernel
            with sdpa_kernel(self.backends):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                     scale=self.softmax_scale, **gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * v.shape[-1])
