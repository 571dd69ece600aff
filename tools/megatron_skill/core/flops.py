"""Model FLOPs the way Megatron counts them.

``training_flops`` reproduces ``megatron.training.training.num_floating_point_operations``
of megatron-core 0.19 for GPT-style models (the tests check equality against the real
function): GEMMs only, 3x for forward + two backward GEMMs, causal core attention halved,
recomputation not counted.  MFU and TFLOP/s/GPU everywhere in this skill use it, so our
figures compare one-to-one with Megatron's ``throughput per GPU (TFLOP/s/GPU)`` log line.
"""
from __future__ import annotations

from .model import ModelConfig

FWD_BWD = 3  # forward, backward-data, backward-weight GEMMs
FMA = 2      # a multiply-add is two floating-point operations


def attention_proj_flops_per_token(m: ModelConfig) -> float:
    """Forward FLOPs of the attention projections (QKV / MLA low-rank and output), one token."""
    h = m.hidden_size
    if m.multi_latent_attention:
        a, qk = m.num_attention_heads, m.qk_head_dim + m.qk_pos_emb_head_dim
        q = m.q_lora_rank * (h + a * qk + 1) if m.q_lora_rank else h * a * qk
        kv = m.kv_lora_rank * (h + a * (m.qk_head_dim + m.v_head_dim) + 1) + h * m.qk_pos_emb_head_dim
        return FMA * (q + kv + a * m.v_head_dim * h)
    q = m.head_dim * m.num_attention_heads
    kv = 2 * m.head_dim * m.query_groups
    return FMA * (h * (q + kv) + q * h)


def core_attention_flops_per_token(m: ModelConfig, seq_length: int) -> float:
    """Forward FLOPs of QK^T and softmax(QK^T)V for one token, causal (half the square)."""
    if m.multi_latent_attention:
        a = m.num_attention_heads
        width = a * (m.qk_head_dim + m.qk_pos_emb_head_dim) / 2 + a * m.v_head_dim / 2
        return FMA * seq_length * width
    return FMA * seq_length * m.head_dim * m.num_attention_heads  # /2 causal, x2 for the two GEMMs


def mlp_flops_per_token(m: ModelConfig, ffn: int) -> float:
    return FMA * m.hidden_size * ffn * (3 if m.gated else 2)


def moe_flops_per_token(m: ModelConfig) -> float:
    """Routed top-k experts plus the shared expert (the router GEMM is not counted, as Megatron)."""
    routed = mlp_flops_per_token(m, m.expert_ffn) * m.moe_router_topk
    shared = mlp_flops_per_token(m, m.moe_shared_expert_intermediate_size or 0)
    return routed + shared


def logits_flops_per_token(m: ModelConfig, padded_vocab: int) -> float:
    return FMA * m.hidden_size * padded_vocab


def mtp_layer_counts(m: ModelConfig) -> tuple[int, int]:
    """(dense, moe) layers that MTP adds; MTP copies the kind of the last layer."""
    n = m.mtp_num_layers or 0
    last_moe = m.moe_pattern()[-1] if m.is_moe else 0
    return (n * (1 - last_moe), n * last_moe)


def training_flops(m: ModelConfig, seq_length: int, batch: int, padded_vocab: int) -> float:
    """FLOPs of one training step over ``batch`` sequences (Megatron's formula)."""
    mtp = m.mtp_num_layers or 0
    mtp_dense, mtp_moe = mtp_layer_counts(m)
    dense, moe = m.num_dense_layers + mtp_dense, m.num_moe_layers + mtp_moe
    layers = m.num_layers + mtp
    per_token = (
        dense * mlp_flops_per_token(m, m.ffn_hidden_size)
        + moe * moe_flops_per_token(m)
        + layers * attention_proj_flops_per_token(m)
        + mtp * FMA * (3 * m.hidden_size + 2 * m.hidden_size * m.hidden_size)
        + (mtp + 1) * logits_flops_per_token(m, padded_vocab)
        + layers * core_attention_flops_per_token(m, seq_length)
    )
    return FWD_BWD * per_token * batch * seq_length


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x TP (--make-vocab-size-divisible-by)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple
