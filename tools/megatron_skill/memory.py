"""Memory per GPU for a layout: weights, gradients, optimizer state, activations, logits.

Reported for the first and the last pipeline rank, which carry the embedding and the
output layer, and on which the most micro-batches (first) or the logits (last) are alive.

Conventions (those of Megatron-Core with bf16 mixed precision):
- weights in bf16 (2 B), main gradients in fp32 (4 B: Megatron accumulates and reduces
  bf16 gradients in fp32), fp32 master weights and two Adam moments (12 B);
  the distributed optimizer shards the 12 B over the data-parallel x context-parallel group
  (expert weights over the expert data-parallel group);
- activations after Korthikanti et al. (arXiv 2205.05198), with flash attention (no s^2
  terms), no dropout, sequence parallelism sharding what TP alone leaves replicated;
- the loss keeps an fp32 copy of the logits (Megatron's vocab-parallel cross entropy),
  one micro-batch at a time.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from .layout import Layout
from .model import ModelSpec

GIB = 2**30
BF16, FP32 = 2, 4
# Outside torch's allocator, so never in max_memory_allocated: the CUDA context, cuBLAS
# workspaces, and NCCL's buffers (~0.5 GiB for each kind of process group a rank talks on).
CONTEXT_GIB = 1.0
NCCL_GIB_PER_GROUP = 0.5
# The caching allocator's fragmentation on top of the live tensors.
FRAGMENTATION = 0.05


def chunk_layers(model: ModelSpec, lay: Layout) -> list[list[int]]:
    """Layer indices of each model chunk, chunk c living on pipeline rank c % PP."""
    return _chunk_layers(model.num_layers, lay.pp, lay.vp, lay.pipeline_split, lay.first_stage_layers,
                         lay.last_stage_layers)


def _chunk_layers(L: int, pp: int, vp: int, split: str, first: int, last: int) -> list[list[int]]:
    shape = Layout(pp=pp, vp=vp, pipeline_split=split, first_stage_layers=first, last_stage_layers=last)
    sizes = shape.chunk_sizes(L) or [L // (pp * vp)] * (pp * vp)
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_layers(model: ModelSpec, lay: Layout, rank: int) -> list[int]:
    return list(_rank_layers(model.num_layers, lay.pp, lay.vp, lay.pipeline_split, lay.first_stage_layers,
                             lay.last_stage_layers, rank))


@functools.lru_cache(maxsize=4096)
def _rank_layers(num_layers: int, pp: int, vp: int, split: str, first: int, last: int, rank: int) -> tuple[int, ...]:
    chunks = _chunk_layers(num_layers, pp, vp, split, first, last)
    return tuple(i for c, layers in enumerate(chunks) if c % pp == rank for i in layers)


def inflight_chunks(lay: Layout, rank: int) -> int:
    """Micro-batch x chunk forward passes whose activations are alive at once on a rank.

    1F1B: PP - rank micro-batches.  Interleaved: Megatron's warm-up count
    2 (PP - rank - 1) + (VP - 1) PP, plus the one in steady state (schedules.py)."""
    m = lay.num_microbatches
    if lay.vp == 1:
        return min(lay.pp - rank, m)
    warmup = 2 * (lay.pp - rank - 1) + (lay.vp - 1) * lay.pp
    return min(warmup + 1, m * lay.vp)


# ---- activations of one layer, bytes per token of the (CP-local) sequence -------------------
def attention_saved_bytes(model: ModelSpec) -> float:
    """Bytes per token that core attention keeps for its backward (TP 1, grouped-query heads
    read natively): Q and K after RoPE (new tensors), V (a view of the QKV projection's
    output, which therefore stays alive whole), the output O, and the fp32 log-sum-exp per
    head.  tests/test_memory_model.py counts them on a real Megatron-Core layer."""
    q = model.num_attention_heads * model.head_dim
    kv = 2 * model.query_groups * model.head_dim
    return BF16 * (q + kv / 2 + (q + kv) + q) + FP32 * model.num_attention_heads


def layer_activation_bytes(model: ModelSpec, lay: Layout, moe: bool) -> float:
    h, t = model.hidden_size, lay.tp
    sp = lay.sequence_parallel or t == 1
    rep = 1 / t if sp else 1.0     # what TP alone leaves replicated, SP shards
    sel = lay.recompute == "selective"
    # Two norms: their inputs (the residual stream) and outputs (inputs of QKV and FC1).
    norms = 2 * BF16 * h * rep + (0 if sel else 2 * BF16 * h * rep)
    if model.multi_latent_attention:
        a = model.num_attention_heads
        qk = model.qk_head_dim + model.qk_pos_emb_head_dim
        latent = BF16 * (2 * (model.q_lora_rank or 0) + 2 * model.kv_lora_rank + model.qk_pos_emb_head_dim)
        attn = latent * rep + BF16 * a * (2 * qk + 2 * model.v_head_dim) / t
    else:
        attn = attention_saved_bytes(model) / t
    if moe:
        k, fe, etp = model.moe_router_topk, model.expert_ffn, lay.etp
        act_out = 0 if sel else BF16 * fe  # moe_act recompute drops the activation output
        up = BF16 * fe * (2 if model.gated else 1)
        # Each token visits k experts: permuted input and output (tokens gathered over ETP),
        # FC1 output and activation output (the FFN width split over ETP).
        routed = k * (2 * BF16 * h * etp + up + act_out) / t
        router = FP32 * 2 * model.num_experts * rep
        shared = 0.0
        if model.moe_shared_expert_intermediate_size:
            fs = model.moe_shared_expert_intermediate_size
            shared = BF16 * fs * ((2 if model.gated else 1) + 1) / t
        mlp = routed + router + shared
    else:
        f = model.ffn_hidden_size
        mlp = BF16 * f * ((2 if model.gated else 1) + 1) / t
    return norms + attn + mlp


def layer_input_bytes(model: ModelSpec, lay: Layout) -> float:
    """What a fully recomputed layer keeps: its input."""
    sp = lay.sequence_parallel or lay.tp == 1
    return BF16 * model.hidden_size / (lay.tp if sp else 1)


@dataclasses.dataclass
class StageMemory:
    rank: int
    layers: int
    params: float                 # parameters held by this rank
    weights: float                # bytes
    gradients: float
    optimizer: float
    activations: float
    logits: float
    transient: float              # recompute buffers, largest temporary
    allowance: float              # outside the allocator: context, NCCL; plus fragmentation

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated should report."""
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.logits + self.transient)

    @property
    def total(self) -> float:
        return self.allocated + self.allowance

    def to_json(self) -> dict[str, Any]:
        g = lambda b: round(b / GIB, 2)  # noqa: E731
        return {"pipeline_rank": self.rank, "layers": self.layers,
                "params_b": round(self.params / 1e9, 3),
                "weights_gib": g(self.weights), "gradients_gib": g(self.gradients),
                "optimizer_gib": g(self.optimizer), "activations_gib": g(self.activations),
                "logits_gib": g(self.logits), "transient_gib": g(self.transient),
                "allocated_gib": g(self.allocated), "allowance_gib": g(self.allowance),
                "total_gib": g(self.total)}


def param_split(model: ModelSpec, n_dense: int, n_moe: int) -> tuple[float, float, float]:
    """(TP-sharded, replicated, expert) parameters of n_dense dense and n_moe MoE layers."""
    norms, attn = 2 * model.norm_params, model.attention_params()
    tp_sharded = (n_dense * (attn + model.mlp_params(model.ffn_hidden_size))
                  + n_moe * (attn + model.shared_expert_params()))
    replicated = n_dense * norms + n_moe * (norms + model.router_params())
    expert = n_moe * model.routed_expert_params()
    return tp_sharded, replicated, expert


# runtime/fused_head.py: tokens per chunk of the fused output layer + cross-entropy (which
# runs only for micro-batches of more than two chunks; smaller ones take Megatron's path).
FUSED_HEAD_CHUNK = 4096


def fp8_linear_saved_bytes(model: ModelSpec, lay: Layout) -> float:
    """Per token and dense layer, what the skill's FP8 linear layers (runtime/fp8_linear.py)
    change in the saved activations, against BF16: QKV's and FC1's inputs (the norms' outputs,
    which nothing else keeps) and FC2's (SwiGLU's output) saved in FP8, half the bytes; the
    projection's input adds an FP8 copy (SDPA keeps its bf16 output anyway).  Negative: saved.
    Measured on the H200: 0.69 GiB less at the 1B shape's micro-batch 4, weight copies
    included (references/benchmarks.md)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    return -(h + f) / lay.tp          # -h (QKV) - h (FC1) - f (FC2) + h (projection's copy)


def stage_memory(model: ModelSpec, lay: Layout, rank: int, padded_vocab: int, fused_head: bool = False,
                 fp8_linear: bool = False) -> StageMemory:
    """fp8_linear: the skill's own FP8 linear layers (no TE), instead of TE's FP8."""
    layers = rank_layers(model, lay, rank)
    first, last = rank == 0, rank == lay.pp - 1
    pattern = model.moe_pattern()
    n_moe = sum(pattern[i] for i in layers)
    tp_sharded, replicated, expert = param_split(model, len(layers) - n_moe, n_moe)
    h = model.hidden_size
    if first:
        tp_sharded += padded_vocab * h
        if model.position_embedding_type == "learned_absolute":
            replicated += model.max_position_embeddings * h
    if last:
        replicated += model.norm_params
        # The output layer: its own weight when untied, a copy of the embedding when tied
        # and the embedding lives on another rank.
        if model.untie_embeddings_and_output_weights or lay.pp > 1:
            tp_sharded += padded_vocab * h
        if model.mtp_num_layers:  # MTP modules live on the last rank; each copies the last layer's kind
            n, last_moe = model.mtp_num_layers, pattern[-1]
            mtp_t, mtp_r, mtp_e = param_split(model, 1 - last_moe, last_moe)
            tp_sharded += n * (mtp_t + 2 * h * h)
            replicated += n * (mtp_r + 3 * model.norm_params)
            expert += n * mtp_e
    dense_local = tp_sharded / lay.tp + replicated
    expert_local = expert / (lay.ep * lay.etp)
    params = dense_local + expert_local

    weights = BF16 * params
    if fp8_linear:
        # each dense layer's weights in FP8 and transposed, cast once and kept for the step
        weights += 2 * param_split(model, len(layers) - n_moe, 0)[0] / lay.tp
    elif lay.precision == "fp8":
        weights += 1 * (tp_sharded / lay.tp + expert_local)  # cached FP8 copies of GEMM weights
    gradients = FP32 * params
    shard = (lay.dp * lay.cp) if lay.distributed_optimizer else 1
    eshard = lay.expert_dp if lay.distributed_optimizer else 1
    optimizer = 12 * (dense_local / shard + expert_local / eshard)

    tokens = lay.mbs * lay.seq_length / lay.cp  # per micro-batch on this rank
    act = {0: layer_activation_bytes(model, lay, False) + (fp8_linear_saved_bytes(model, lay) if fp8_linear else 0)}
    if model.is_moe:
        act[1] = layer_activation_bytes(model, lay, True)
    per_layer = [act[pattern[i]] for i in layers]
    chunks = max(lay.vp, 1)
    n_inflight = inflight_chunks(lay, rank)
    # Activations of one micro-batch through one (average) chunk of this rank.
    if lay.recompute == "full":
        chunk_list = chunk_layers(model, lay)[rank::lay.pp]
        full_chunk = 0.0
        for c in chunk_list:
            acts = sorted((act[pattern[i]] for i in c), reverse=True)
            n_re = min(lay.recompute_layers, len(acts))
            full_chunk += n_re * layer_input_bytes(model, lay) + sum(acts[n_re:])
        per_chunk = full_chunk / chunks
        # --recompute-method block checkpoints each of those layers on its own: the backward
        # re-runs one layer at a time, so one layer's activations are the transient.
        transient = tokens * max(per_layer, default=0.0) if lay.recompute_layers else 0.0
    else:
        per_chunk = sum(per_layer) / chunks
        transient = 0.0
    activations = tokens * per_chunk * n_inflight
    if first:
        activations += 8 * tokens * n_inflight  # int64 token ids and position ids in flight
    logits = 0.0
    if last:
        sp = lay.sequence_parallel or lay.tp == 1
        activations += tokens * 2 * BF16 * h / (lay.tp if sp else 1)  # final norm in and out
        v = padded_vocab / lay.tp
        if fused_head and not model.mtp_num_layers and tokens > 2 * FUSED_HEAD_CHUNK:
            # One chunk's fp32 logits and bf16 gradient at a time; the fp32 weight gradient the
            # forward accumulates (in place: addmm writes the GEMM's fp32 accumulator into it);
            # the hidden-state gradient kept for the backward.
            logits = min(tokens, FUSED_HEAD_CHUNK) * v * (FP32 + BF16) + v * h * FP32 + tokens * h * BF16
        else:
            # fp32 copy of the logits kept for the backward, plus the bf16 logits alive while it is made.
            logits = tokens * v * (FP32 + BF16) * (1 + (model.mtp_num_layers or 0))
    groups = sum(x > 1 for x in (lay.tp, lay.pp, lay.cp, lay.dp, lay.ep))
    dynamic = activations + logits + transient
    allowance = (CONTEXT_GIB + NCCL_GIB_PER_GROUP * groups) * GIB + FRAGMENTATION * dynamic
    return StageMemory(rank=rank, layers=len(layers), params=params, weights=weights,
                       gradients=gradients, optimizer=optimizer, activations=activations,
                       logits=logits, transient=transient, allowance=allowance)


def ranks_to_check(lay: Layout) -> list[int]:
    """The first and last pipeline ranks (embedding, loss) and, when there is one, the second,
    which holds as many layers as any middle rank with the most micro-batches among them."""
    return sorted({0, lay.pp - 1} | ({1} if lay.pp > 2 else set()))


def memory_report(model: ModelSpec, lay: Layout, padded_vocab: int, fused_head: bool = False,
                  fp8_linear: bool = False) -> dict[str, StageMemory]:
    """Memory of the first, last (and a middle) pipeline rank; one entry when PP = 1."""
    names = {0: "first_stage", lay.pp - 1: "last_stage", 1: "middle_stage"}
    return {names[r]: stage_memory(model, lay, r, padded_vocab, fused_head, fp8_linear) for r in ranks_to_check(lay)}
