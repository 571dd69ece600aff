"""Rotary embeddings that stay on the CPU.

Megatron-Core's RotaryEmbedding moves its inverse frequencies to the current CUDA device
on the first forward; on a machine without a GPU that call fails.  This subclass computes
the same embedding on whatever device its frequencies live on.
"""
from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


class CPURotaryEmbedding(RotaryEmbedding):
    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]


def keep_rope_on_cpu(model: torch.nn.Module) -> None:
    """Swap the class of every RotaryEmbedding in the model (same state, CPU-safe get_emb)."""
    for module in model.modules():
        if type(module) is RotaryEmbedding:
            module.__class__ = CPURotaryEmbedding
