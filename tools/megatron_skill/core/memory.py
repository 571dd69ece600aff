"""Memory per GPU for a layout: weights, gradients, optimizer state, activations, logits.

Reported for the first and the last pipeline rank, which carry the embedding and the
output layer, and on which the most micro-batches (first) or the logits (last) are alive.

Conventions (those of Megatron-Core with bf16 mixed precision):
- weights in bf16 (2 B), main gradients in fp32 (4 B: Megatron accumulates and reduces
  bf16 gradients in fp32), fp32 master weights and two Adam moments (12 B);
  the distributed optimizer shards the 12 B over the data-parallel x context-parallel group
  (expert weights over the expert data-parallel group);
- activations after Korthikanti et al. (arXiv 2205.05198), with flash attention (no s^2
  terms; unfused attention's are counted when asked: unfused_score_bytes), no dropout,
  sequence parallelism sharding what TP alone leaves replicated;
- the loss keeps an fp32 copy of the logits (Megatron's vocab-parallel cross entropy),
  one micro-batch at a time;
- on Transformer Engine's layers, core attention keeps Q, K, its own copy of V and O (not the
  whole QKV output the local layers keep alive through V's view), and --tp-comm-overlap adds
  TE's userbuffers outside torch's allocator (attention_saved_bytes, userbuffer_bytes).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from .catalog import CATALOG_DIR
from .layout import Layout
from .model import ModelConfig

GIB = 2**30
FP8, BF16, FP32 = 1, 2, 4
# Outside torch's allocator, so never in max_memory_allocated: the CUDA context, cuBLAS
# workspaces and NCCL's buffers; and the caching allocator's fragmentation on top of the live
# tensors. Figures and their sources: catalog/calibration.json, "memory".
_OUTSIDE = json.loads((CATALOG_DIR / "calibration.json").read_text())["memory"]
CONTEXT_GIB = _OUTSIDE["context_gib"]
NCCL_GIB_PER_GROUP = _OUTSIDE["nccl_gib_per_group"]
FRAGMENTATION = _OUTSIDE["fragmentation"]
# what a plan should leave free beyond its predicted peak (what ran out of memory and what ran)
PLAN_MARGIN_GIB = _OUTSIDE["plan_margin_gib"]


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """What a run does beyond its layout that changes its memory: the skill's runtime paths and
    Megatron's memory flags, as data (read from a request's runtime by the planner, from a
    script's flags by validate)."""
    fused_head: bool = False            # the skill's fused output layer + cross-entropy
    fp8_linear: bool = False            # the skill's FP8 linear layers (no TE)
    te_fp8: bool = False                # TE's FP8 GEMMs: their inputs saved in FP8, FP8 weight copies
    fp8_proj_copy: bool = True          # the projection's input saved again as its FP8 copy (fp8_linear_saved_bytes)
    fp8_params: bool = False            # --fp8-param-gather: weights held in FP8 only
    score_bytes: float = 0.0            # unfused attention's S x S scores kept (unfused_score_bytes)
    grad_bytes: int = FP32              # main gradients: fp32, or bf16 (--grad-reduce-in-bf16)
    fused_cross_entropy: bool = False   # Megatron's --cross-entropy-loss-fusion: no fp32 copy of the logits
    fsdp_params: bool = False           # Megatron FSDP optim_grads_params: weights and gradients sharded too
    recompute_modules: frozenset[str] | None = None   # --recompute-modules under selective; None: the skill's set
    moe_routed_factor: float = 1.0      # token copies per expert over the balanced share (MoEOptions.routed_factor)
    router_score_bytes: int = FP32      # the router's saved scores per expert (MoEOptions.router_score_bytes)
    adam_temp_bytes: float = 0          # per optimizer-shard parameter, allocated during the step: torch's
    #                                     multi-tensor AdamW keeps sqrt(exp_avg_sq) of the whole shard (4 B);
    #                                     TE's, apex's and torch's fused kernels update in place (0), but TE's
    #                                     copies moments kept in 16 or 8 bits to fp32 (adam_step_bytes)
    local_clip: bool = False            # Megatron's fallback gradient clipping (no TE or apex) scales each
    #                                     gradient through a temporary copy: the largest one at the step
    te_attention: bool = False          # TE's core attention: keeps its own contiguous V, the QKV output is freed
    optimizer_bytes: float = 12.0       # per optimizer-shard parameter: fp32 master and two fp32 moments, or
    #                                     the precision-aware optimizer's (MegatronOptions.optimizer_state_bytes)
    tp_comm_overlap: bool = False       # TE's userbuffers for --tp-comm-overlap, counted where TP > 1 under SP
    offloaded_layers: int = 0           # --cpu-offloading-num-layers: layers whose saved activations wait on the host
    #                                     (also where a TP group spans NVLink domains and render leaves it off)


def chunk_layers(model: ModelConfig, lay: Layout) -> tuple[tuple[int, ...], ...]:
    """Layer indices of each model chunk, chunk c living on pipeline rank c % PP."""
    return _chunk_layers(model.num_layers, lay.pp, lay.vp, lay.pipeline_split, lay.first_stage_layers,
                         lay.last_stage_layers, lay.pipeline_layout)


@functools.lru_cache(maxsize=4096)
def _chunk_layers(L: int, pp: int, vp: int, split: str, first: int, last: int,
                  layout: str = "") -> tuple[tuple[int, ...], ...]:
    shape = Layout(pp=pp, vp=vp, pipeline_split=split, first_stage_layers=first, last_stage_layers=last,
                   pipeline_layout=layout)
    sizes = shape.chunk_sizes(L) or [L // (pp * vp)] * (pp * vp)
    out, start = [], 0
    for n in sizes:
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def moe_layers_among(model: ModelConfig, layers: tuple[int, ...]) -> int:
    """How many of these layers are mixture-of-experts layers."""
    pattern = model.moe_pattern()
    return sum(pattern[i] for i in layers)


def rank_layers(model: ModelConfig, lay: Layout, rank: int) -> list[int]:
    return list(_rank_layers(model.num_layers, lay.pp, lay.vp, lay.pipeline_split, lay.first_stage_layers,
                             lay.last_stage_layers, rank, lay.pipeline_layout))


@functools.lru_cache(maxsize=4096)
def _rank_layers(num_layers: int, pp: int, vp: int, split: str, first: int, last: int, rank: int,
                 layout: str = "") -> tuple[int, ...]:
    chunks = _chunk_layers(num_layers, pp, vp, split, first, last, layout)
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
def attention_saved_bytes(model: ModelConfig, te: bool = False) -> float:
    """Bytes per token that core attention keeps for its backward (TP 1, grouped-query heads
    read natively), and the fp32 log-sum-exp per head.

    Megatron-Core's local layers (the skill's SDPA): Q and K after RoPE (new tensors), V (a view
    of the QKV projection's output, which therefore stays alive whole) and the output O.
    tests/test_memory_model.py counts them on a real Megatron-Core layer.

    Transformer Engine's DotProductAttention (te): its layout check (get_qkv_layout, TE 2.8 to
    2.13) takes Q and K as RoPE made them (contiguous) but not a V strided inside the QKV output
    (its strides are not K's), so it makes all three contiguous: V becomes a copy, and the
    fused-attention function saves Q, K, that V and O. The QKV output has no reference left
    after the layer's forward (the split is torch.split's views, TE's fused RoPE saves only its
    frequencies, the QKV linear saves its input): it is freed. Read in TE's source, not measured
    here (no TE on the GPUs we have)."""
    q = model.num_attention_heads * model.head_dim
    kv = 2 * model.query_groups * model.head_dim
    if te:
        # QK-norm with TE's RMSNorm: each norm keeps its input made contiguous (the query's
        # reshaped copy, a copy of the key's view); their outputs go into RoPE, which keeps none
        qk_norm = q + kv / 2 if model.qk_layernorm else 0
        return BF16 * (q + kv + q + qk_norm) + FP32 * model.num_attention_heads
    # QK-norm (Qwen3): the query norm's output is kept too (K's is not: measured on an H100,
    # references/benchmarks.md "Fine-grained MoE memory")
    qk_norm = q if model.qk_layernorm else 0
    return BF16 * (q + kv / 2 + (q + kv) + q + qk_norm) + FP32 * model.num_attention_heads


# Megatron's unfused core attention (the local DotProductAttention) keeps, per head and per
# element of the S x S score matrix, the softmax output in bf16; with the softmax in fp32 its
# fp32 output too; with attention dropout, the dropout's mask and output. Counted on the real
# layer with autograd's saved-tensor hooks (tests/test_memory_model.py), by
# (softmax in fp32, dropout > 0):
UNFUSED_SCORE_BYTES = {(False, False): 2, (False, True): 6, (True, False): 6, (True, True): 8}


def unfused_score_bytes(softmax_in_fp32: bool, dropout: bool) -> float:
    """Bytes per head and score element that unfused attention keeps (0 for flash / SDPA)."""
    return UNFUSED_SCORE_BYTES[(bool(softmax_in_fp32), bool(dropout))]


# What the skill's selective recompute re-runs by default (MoEOptions.selective_modules of the defaults).
SELECTIVE_MODULES = frozenset({"core_attn", "layernorm", "moe_act"})


def recomputed_modules(lay: Layout, opts: "MemoryOptions") -> frozenset[str]:
    """Megatron's --recompute-modules in force: none without selective recompute."""
    if lay.recompute != "selective":
        return frozenset()
    return opts.recompute_modules if opts.recompute_modules is not None else SELECTIVE_MODULES


def layer_activation_bytes(model: ModelConfig, lay: Layout, moe: bool, opts: "MemoryOptions | None" = None) -> float:
    """Bytes per token one layer keeps for its backward."""
    opts = opts or MemoryOptions()
    return _layer_activation_bytes(model, lay.tp, lay.sequence_parallel, lay.recompute, lay.seq_length, lay.cp,
                                   lay.etp, moe, opts)


@functools.lru_cache(maxsize=65536)
def _layer_activation_bytes(model: ModelConfig, tp: int, sequence_parallel: bool, recompute: str, seq_length: int,
                            cp: int, etp: int, moe: bool, opts: "MemoryOptions") -> float:
    # what the layout decides of a layer's activations, and nothing else: cached across layouts
    lay = Layout(tp=tp, sequence_parallel=sequence_parallel, recompute=recompute, seq_length=seq_length, cp=cp,
                 etp=etp)
    h, t = model.hidden_size, lay.tp
    sp = lay.sequence_parallel or t == 1
    rep = 1 / t if sp else 1.0     # what TP alone leaves replicated, SP shards
    re_run = recomputed_modules(lay, opts)
    # Two norms: their inputs (the residual stream) and outputs (inputs of QKV and FC1).
    norms = 2 * BF16 * h * rep + (0 if "layernorm" in re_run else 2 * BF16 * h * rep)
    if model.multi_latent_attention:
        a = model.num_attention_heads
        qk = model.qk_head_dim + model.qk_pos_emb_head_dim
        latent = BF16 * (2 * (model.q_lora_rank or 0) + 2 * model.kv_lora_rank + model.qk_pos_emb_head_dim)
        # Q, K and V from the up-projections (re-made in the backward under mla_up_proj), and O
        qkv = 0 if "mla_up_proj" in re_run else BF16 * a * (2 * qk + model.v_head_dim) / t
        attn = latent * rep + qkv + BF16 * a * model.v_head_dim / t
    else:
        attn = attention_saved_bytes(model, opts.te_attention) / t
    if "core_attn" not in re_run:
        # unfused attention: per token, a row of S scores (S / CP under context parallel) per head
        attn += opts.score_bytes * model.num_attention_heads / t * lay.seq_length / lay.cp
    if ("moe" if moe else "mlp") in re_run:   # the MLP re-runs from its input (kept with the norms)
        return norms + attn
    if moe:
        k, fe, etp = model.moe_router_topk, model.expert_ffn, lay.etp
        act_out = 0 if "moe_act" in re_run else BF16 * fe  # moe_act recompute drops the activation output
        up = BF16 * fe * (2 if model.gated else 1)
        # Each token visits k experts: the experts' permuted input (tokens gathered over ETP),
        # FC1 output and activation output (the FFN width split over ETP); the combine keeps no
        # copy of the experts' output. The router keeps its fp32 logits and two int64 index maps
        # of the k choices. (Counted on an H100 with autograd's saved-tensor hooks,
        # references/benchmarks.md "Fine-grained MoE memory".) Padded to a capacity, every
        # expert holds its full capacity.
        routed = opts.moe_routed_factor * k * (BF16 * h * etp + up + act_out) / t
        router = (opts.router_score_bytes * model.num_experts + 2 * 8 * k) * rep
        shared = 0.0
        if model.moe_shared_expert_intermediate_size and "shared_experts" not in re_run:
            fs = model.moe_shared_expert_intermediate_size
            shared = BF16 * fs * ((2 if model.gated else 1) + 1) / t
        mlp = routed + router + shared
    else:
        f = model.ffn_hidden_size
        mlp = BF16 * f * ((2 if model.gated else 1) + 1) / t
    return norms + attn + mlp


def layer_input_bytes(model: ModelConfig, lay: Layout) -> float:
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
    allowance: float              # outside the allocator: context, NCCL, TE's userbuffers; plus fragmentation
    step_transient: float = 0.0   # temporaries of the optimizer step (activations are freed by then)
    userbuffers: float = 0.0      # TE's TP-overlap buffers (part of the allowance: cudaMalloc'd by TE)

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated should report: the state, plus the larger of
        what the forward and backward keep and what the optimizer step allocates."""
        return (self.weights + self.gradients + self.optimizer
                + max(self.activations + self.logits + self.transient, self.step_transient))

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
                "optimizer_step_gib": g(self.step_transient),
                "allocated_gib": g(self.allocated), "allowance_gib": g(self.allowance),
                "userbuffers_gib": g(self.userbuffers),
                "total_gib": g(self.total)}


@functools.lru_cache(maxsize=65536)
def param_split(model: ModelConfig, n_dense: int, n_moe: int) -> tuple[float, float, float]:
    """(TP-sharded, replicated, expert) parameters of n_dense dense and n_moe MoE layers."""
    norms, attn = 2 * model.norm_params, model.attention_params()
    tp_sharded = (n_dense * (attn + model.mlp_params(model.ffn_hidden_size))
                  + n_moe * (attn + model.shared_expert_params()))
    replicated = n_dense * norms + n_moe * (norms + model.router_params())
    expert = n_moe * model.routed_expert_params()
    return tp_sharded, replicated, expert


# runtime/fused_head.py: tokens per chunk of the fused output layer + cross-entropy, at most;
# a micro-batch whose fp32 weight gradient would make this chunk keep more than Megatron's
# logits takes a half or a quarter of it (see fused_head_chunk).
FUSED_HEAD_CHUNK = 4096


def fused_head_defers_wgrad(tokens: float, hidden: int) -> bool:
    """Whether the fused head keeps the micro-batch's bf16 logit gradient for one weight-gradient
    GEMM in the backward, instead of accumulating that gradient chunk by chunk into an fp32 buffer
    in the forward: where the logit gradient (tokens x vocab x 2 bytes) is the smaller of the two
    (vocab x hidden x 4), i.e. under 2 x hidden tokens (the 3B shape at mbs 1).  Independent of
    the vocabulary and of TP, which scale both alike."""
    return tokens * BF16 < hidden * FP32


def fused_head_bytes(tokens: float, hidden: int, vocab: float, chunk: int) -> float:
    """What the fused output layer + loss keeps for a micro-batch of `tokens` on a rank holding
    `vocab` rows of the output weight, at its peak.  Through both passes: the hidden-state
    gradient formed in the forward (and, deferring the weight gradient, the hidden states saved
    for it).  Then the largest of its phases: the forward, one chunk's fp32 logits and bf16
    gradient at a time beside what it keeps for the weight gradient (the fp32 buffer it
    accumulates, or where that is larger, fused_head_defers_wgrad, the bf16 logit gradients); the
    backward's forming of that gradient (beside the scaled hidden-state gradient and, deferred,
    the scaled hidden states), into main_grad, or without gradient-accumulation fusion as a
    weight-sized bf16 tensor beside what was kept (counted either way: the fusion is the
    runtime's default, a run may turn it off); and, once that is dropped, the weight-sized
    placeholder it hands autograd under the fusion (runtime/fused_head.py PendingWeightGrad)."""
    act = tokens * hidden * BF16                       # one [tokens, hidden] bf16 tensor
    chunk_bytes = min(tokens, chunk) * vocab * (FP32 + BF16)
    weight_sized = vocab * hidden * BF16
    if fused_head_defers_wgrad(tokens, hidden):
        logit_grad = tokens * vocab * BF16
        return 2 * act + max(logit_grad + chunk_bytes, logit_grad + 2 * act + weight_sized)
    grad_w = vocab * hidden * FP32
    return act + max(grad_w + chunk_bytes, grad_w + act + weight_sized)


def fused_head_chunk(tokens: float, hidden: int, vocab: float, chunk: int = FUSED_HEAD_CHUNK) -> int:
    """Tokens per chunk the skill's fused output layer + loss takes a micro-batch in, or 0 where it
    leaves it to Megatron's output layer and loss.  Accumulating the weight gradient in the
    forward, the largest of `chunk`, its half and its quarter with which it keeps less than
    Megatron's bf16 logits and their fp32 copy: each chunk's accumulating GEMM reads and writes the
    fp32 buffer, which outlasts the chunk's own multiply below about 1,024 tokens of a 3,072-wide
    model (timing._fused_head_weight_grad).  Deferring it (fused_head_defers_wgrad), the quarter:
    chunks cost nothing but their GEMMs' shape there, and the smallest keeps least.  One rule for
    the runtime (runtime/fused_head.py), the memory model and the step time."""
    megatron = tokens * vocab * (FP32 + BF16)
    sizes = (chunk // 4,) if fused_head_defers_wgrad(tokens, hidden) else (chunk, chunk // 2, chunk // 4)
    for c in sizes:
        if c >= 1 and fused_head_bytes(tokens, hidden, vocab, c) < megatron:
            return c
    return 0


def fused_head_runs(tokens: float, hidden: int, vocab: float, chunk: int = FUSED_HEAD_CHUNK) -> bool:
    """Whether the fused output layer + loss takes the micro-batch (fused_head_chunk)."""
    return fused_head_chunk(tokens, hidden, vocab, chunk) > 0


def fp8_linear_saved_bytes(model: ModelConfig, lay: Layout, proj_copy: bool = True) -> float:
    """Per token and dense layer, what FP8 linear layers change in the saved activations, against
    BF16: QKV's and FC1's inputs (the norms' outputs, which nothing else keeps) and FC2's
    (SwiGLU's output) saved in FP8, half the bytes; with proj_copy the projection's input adds an
    FP8 copy (attention keeps its bf16 output anyway).  Negative: saved.
    The skill's layers (runtime/fp8_linear.py) keep that copy: measured on the H200, 0.69 GiB less
    at the 1B shape's micro-batch 4, weight copies included (references/benchmarks.md). TE's
    layers save their inputs as the FP8 copies they multiply (its Linear and LayerNormLinear,
    without sequence parallelism's gather), and under any recipe but delayed Megatron has the
    projection save its bf16 input instead, which core attention's output already is
    (set_save_original_input in megatron/core/transformer/attention.py, TE 2.6 and later)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    # the projection's input: the heads' outputs (their value width under MLA), not always h wide
    proj = model.num_attention_heads * (model.v_head_dim if model.multi_latent_attention else model.head_dim)
    return -(2 * h + f - (proj if proj_copy else 0)) / lay.tp   # -h (QKV) - h (FC1) - f (FC2) [+ proj]


@functools.lru_cache(maxsize=65536)
def _state_bytes(model: ModelConfig, layers: tuple[int, ...], n_moe: int, first: bool, last: bool, pipelined: bool,
                 tp: int, ep: int, etp: int, dp_cp: int, expert_dp: int, distributed_optimizer: bool, precision: str,
                 padded_vocab: int, fp8_params: bool, fp8_linear: bool, grad_bytes: int,
                 fsdp_params: bool, optimizer_bytes: float) -> tuple[float, float, float, float, float]:
    """(parameters, weight, gradient and optimizer bytes, optimizer-shard parameters) of a rank:
    what the micro-batch and the recompute do not change, cached across the layouts of a search
    that share it."""
    pattern = model.moe_pattern()
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
        if model.untie_embeddings_and_output_weights or pipelined:
            tp_sharded += padded_vocab * h
        if model.mtp_num_layers:  # MTP modules live on the last rank; each copies the last layer's kind
            n, last_moe = model.mtp_num_layers, pattern[-1]
            mtp_t, mtp_r, mtp_e = param_split(model, 1 - last_moe, last_moe)
            tp_sharded += n * (mtp_t + 2 * h * h)
            replicated += n * (mtp_r + 3 * model.norm_params)
            expert += n * mtp_e
    dense_local = tp_sharded / tp + replicated
    expert_local = expert / (ep * etp)
    params = dense_local + expert_local

    shard = dp_cp if distributed_optimizer or fsdp_params else 1
    eshard = expert_dp if distributed_optimizer or fsdp_params else 1
    gemm_weights = tp_sharded / tp + expert_local
    if fp8_params:   # TE's FP8 weights replace the bf16 ones (the fp32 master is the optimizer's)
        weights = FP8 * gemm_weights + BF16 * (params - gemm_weights)
    else:
        weights = BF16 * params
        if fp8_linear:
            # each dense layer's weights in FP8 and transposed, cast once and kept for the step
            weights += 2 * FP8 * param_split(model, len(layers) - n_moe, 0)[0] / tp
        elif precision == "fp8":
            weights += FP8 * gemm_weights  # TE's cached FP8 copies of the GEMM weights
    gradients = grad_bytes * params
    if fsdp_params:
        # Sharded over data parallel; a layer's weights are gathered while it runs (two layers'
        # worth with Megatron FSDP's double buffer), its gradients reduced as they are made.
        layer_w = max(param_split(model, 1, 0)[0] / tp, param_split(model, 0, 1)[2] / (ep * etp)
                      if model.is_moe else 0.0)
        weights = weights * (dense_local / shard + expert_local / eshard) / max(params, 1) + 2 * BF16 * layer_w
        gradients = grad_bytes * (dense_local / shard + expert_local / eshard) + 2 * BF16 * layer_w
    # fp32 master weights and two Adam moments, or the precision-aware optimizer's states (the fp32
    # copy of a bf16 gradient shard lives only through the step: StageMemory.step_transient)
    shard_params = dense_local / shard + expert_local / eshard
    return params, weights, gradients, optimizer_bytes * shard_params, shard_params


@functools.lru_cache(maxsize=65536)
def _layer_acts(model: ModelConfig, tp: int, sequence_parallel: bool, recompute: str, seq_length: int, cp: int,
                etp: int, precision: str, opts: MemoryOptions) -> dict[int, float]:
    """Bytes per token a dense (0) and an MoE (1) layer keep for the backward, FP8 inputs counted."""
    lay = Layout(tp=tp, sequence_parallel=sequence_parallel, recompute=recompute, seq_length=seq_length, cp=cp,
                 etp=etp, precision=precision)
    fp8_inputs = (opts.fp8_linear or opts.te_fp8 and precision == "fp8") and "mlp" not in recomputed_modules(lay, opts)
    act = {0: layer_activation_bytes(model, lay, False, opts) + (fp8_linear_saved_bytes(model, lay, opts.fp8_proj_copy)
                                                                  if fp8_inputs else 0)}
    if model.is_moe:
        act[1] = layer_activation_bytes(model, lay, True, opts)
        re_run = recomputed_modules(lay, opts)
        if opts.te_fp8 and precision == "fp8" and "moe" not in re_run:
            # TE's grouped GEMMs save their inputs as the FP8 copies they multiply (as its Linear
            # does): the experts' permuted input, and the activation output where it is kept, at
            # one byte an element instead of two; neither bf16 tensor is kept beside them (the
            # permutation's backward needs only its index map, the activation's its input)
            k, fe = model.moe_router_topk, model.expert_ffn
            kept = model.hidden_size * etp + (0 if "moe_act" in re_run else fe)
            act[1] -= opts.moe_routed_factor * k * kept / tp * (BF16 - FP8)
    return act


def stage_memory(model: ModelConfig, lay: Layout, rank: int, padded_vocab: int,
                 opts: MemoryOptions = MemoryOptions()) -> StageMemory:
    layers = _rank_layers(model.num_layers, lay.pp, lay.vp, lay.pipeline_split, lay.first_stage_layers,
                          lay.last_stage_layers, rank, lay.pipeline_layout)
    first, last = rank == 0, rank == lay.pp - 1
    n_moe = moe_layers_among(model, layers)
    h = model.hidden_size
    params, weights, gradients, optimizer, shard_params = _state_bytes(
        model, layers, n_moe, first, last, lay.pp > 1, lay.tp, lay.ep, lay.etp, lay.dp * lay.cp, lay.expert_dp,
        lay.distributed_optimizer, lay.precision, padded_vocab, opts.fp8_params, opts.fp8_linear, opts.grad_bytes,
        opts.fsdp_params, opts.optimizer_bytes)

    tokens = lay.mbs * lay.seq_length / lay.cp  # per micro-batch on this rank
    act = _layer_acts(model, lay.tp, lay.sequence_parallel, lay.recompute, lay.seq_length, lay.cp, lay.etp,
                      lay.precision, opts)
    n_dense = len(layers) - n_moe
    largest = max([act[0]] * bool(n_dense) + [act.get(1, 0.0)] * bool(n_moe), default=0.0)
    chunks = max(lay.vp, 1)
    n_inflight = inflight_chunks(lay, rank)
    # Activations of one micro-batch through one (average) chunk of this rank.
    offload_extra = 0.0
    if lay.recompute == "full":
        full_chunk = 0.0
        for c in chunk_layers(model, lay)[rank::lay.pp]:
            # the largest layers of the chunk are the ones recomputed (keeping their input only)
            c_moe = moe_layers_among(model, c)
            kinds = sorted([(act[0], len(c) - c_moe), (act.get(1, 0.0), c_moe)], reverse=True)
            n_re = min(lay.recompute_layers, len(c))
            kept = 0.0
            for size, count in kinds:
                skip = min(n_re, count)
                n_re -= skip
                kept += size * (count - skip)
            full_chunk += min(lay.recompute_layers, len(c)) * layer_input_bytes(model, lay) + kept
        per_chunk = full_chunk / chunks
        # --recompute-method block checkpoints each of those layers on its own: the backward
        # re-runs one layer at a time, so one layer's activations are the transient.
        transient = tokens * largest if lay.recompute_layers else 0.0
    else:
        per_chunk = (n_dense * act[0] + n_moe * act.get(1, 0.0)) / chunks
        transient = 0.0
        if opts.offloaded_layers:
            # TE's CPU-offload context sends the first N layers' saved tensors to the host after
            # their forward and brings each back before its backward (PP 1, one chunk: Megatron's
            # rule); which layers go is the model's first N
            gone = min(opts.offloaded_layers, len(layers))
            first_n = layers[:gone]
            moe_gone = moe_layers_among(model, tuple(first_n))
            per_chunk -= (gone - moe_gone) * act[0] + moe_gone * act.get(1, 0.0)
            offload_extra = tokens * largest   # TE 2.9's one more layer, weighed against the logits below
    if opts.score_bytes:
        # The score matrix in flight while a layer's attention runs (forward, and its gradient
        # in the backward): one layer's bf16 scores and their fp32 softmax input.
        transient = max(transient, tokens * (BF16 + FP32) * model.num_attention_heads / lay.tp
                        * lay.seq_length / lay.cp)
    activations = tokens * per_chunk * n_inflight
    if first:
        activations += 8 * tokens * n_inflight  # int64 token ids and position ids in flight
    logits = 0.0
    if last:
        sp = lay.sequence_parallel or lay.tp == 1
        activations += tokens * 2 * BF16 * h / (lay.tp if sp else 1)  # final norm in and out
        v = padded_vocab / lay.tp
        chunk = fused_head_chunk(tokens, h, v) if opts.fused_head and not model.mtp_num_layers else 0
        if chunk:
            logits = fused_head_bytes(tokens, h, v, chunk)
        elif opts.fused_cross_entropy:
            # Megatron's fused cross-entropy reads the bf16 logits in place: they and their bf16
            # gradient, no fp32 copy
            logits = tokens * v * (BF16 + BF16) * (1 + (model.mtp_num_layers or 0))
        else:
            # fp32 copy of the logits kept for the backward, plus the bf16 logits alive while it is made.
            logits = tokens * v * (FP32 + BF16) * (1 + (model.mtp_num_layers or 0))
    if offload_extra:
        # TE 2.10 and later free an offloaded layer's copy as a later layer starts, so the layers
        # kept include the one running; TE 2.9 kept one more, through the last layer only, before
        # the logits exist (transformer_engine/pytorch/cpu_offload.py of each)
        transient = max(transient, offload_extra - logits)
    step_transient = opts.adam_temp_bytes * shard_params
    if opts.local_clip:
        # the largest gradient of the rank (the embedding's or the output layer's where it lives
        # here, else a layer's largest matrix), its optimizer shard, scaled into a temporary; the
        # clipping is done, its temporaries freed, before Adam's step allocates its own
        largest = max(padded_vocab * h / lay.tp if first or last else 0.0, _largest_layer_matrix(model, lay.tp, lay.etp))
        step_transient = max(step_transient, FP32 * min(largest, shard_params))
    if opts.grad_bytes < FP32:
        # Megatron's distributed optimizer gives its fp32 master shard a gradient copied from the
        # bf16 main gradients at the step (_copy_model_grads_to_main_grads: .float()), alive through
        # the clipping and Adam's step, freed by the next iteration's zero_grad (set_to_none)
        # before any forward pass
        step_transient += FP32 * shard_params
    groups = sum(x > 1 for x in (lay.tp, lay.pp, lay.cp, lay.dp, lay.ep))
    dynamic = max(activations + logits + transient, step_transient)
    ub = userbuffer_bytes(model, lay) if opts.tp_comm_overlap else 0.0
    allowance = (CONTEXT_GIB + NCCL_GIB_PER_GROUP * groups) * GIB + FRAGMENTATION * dynamic + ub
    return StageMemory(rank=rank, layers=len(layers), params=params, weights=weights,
                       gradients=gradients, optimizer=optimizer, activations=activations,
                       logits=logits, transient=transient, allowance=allowance, step_transient=step_transient,
                       userbuffers=ub)


def userbuffer_bytes(model: ModelConfig, lay: Layout) -> float:
    """What Transformer Engine's userbuffers take for --tp-comm-overlap, outside torch's allocator
    (TE allocates them with cudaMalloc or cuMemCreate: userbuffers-host.cpp), on every rank.

    Megatron sizes each buffer as one micro-batch's whole sequence over CP by the hidden size
    (initialize_ub's shape, _initialize_tp_communicators) and TE makes twelve with its default
    methods (module/base.py, initialize_ub, TE 2.8 to 2.13): the eight of its all-gather list
    (QKV, FC1 forward, projection and FC2 data gradients by ring exchange; QKV and FC1 data
    gradients in bulk; projection and FC2 weight gradients, external) in FP8 under an FP8 recipe,
    else bf16; the four reduce-scatters (projection and FC2 forward, pipelined; QKV and FC1
    weight gradients, in bulk) in bf16. A config file that turns the forward reduce-scatters into
    ring exchanges (NVIDIA's Llama 3.1 405B presets) takes (2 TP - 1) / TP of theirs instead:
    not counted. None without TP > 1 under sequence parallelism (Megatron asserts it)."""
    if lay.tp <= 1 or not lay.sequence_parallel:
        return 0.0
    elements = lay.mbs * lay.seq_length / lay.cp * model.hidden_size
    gather = FP8 if lay.precision == "fp8" else BF16
    return elements * (8 * gather + 4 * BF16)


@functools.lru_cache(maxsize=4096)
def _largest_layer_matrix(model: ModelConfig, tp: int, etp: int) -> float:
    """Elements of the largest weight matrix of one layer on a rank: the gated MLP's first one,
    QKV, or an expert's."""
    h = model.hidden_size
    up = 2 if model.gated else 1
    qkv = (model.num_attention_heads + 2 * model.query_groups) * model.head_dim * h / tp
    mlp = up * model.ffn_hidden_size * h / tp
    expert = up * model.expert_ffn * h / etp if model.is_moe else 0.0
    return max(qkv, mlp, expert)


def peak(report: dict[str, StageMemory], kind: str = "total") -> float:
    """The largest of a report's stages, in bytes: their total (with what lies outside the
    allocator) or what torch's allocator holds (allocated)."""
    return max(getattr(m, kind) for m in report.values())


def ranks_to_check(lay: Layout) -> list[int]:
    """The first and last pipeline ranks (embedding, loss) and, when there is one, the second,
    which holds as many layers as any middle rank with the most micro-batches among them."""
    return sorted({0, lay.pp - 1} | ({1} if lay.pp > 2 else set()))


def memory_report(model: ModelConfig, lay: Layout, padded_vocab: int,
                  opts: MemoryOptions = MemoryOptions()) -> dict[str, StageMemory]:
    """Memory of the first, last (and a middle) pipeline rank; one entry when PP = 1."""
    names = {0: "first_stage", 1: "middle_stage", lay.pp - 1: "last_stage"}   # at PP 2 rank 1 is the last
    return {names[r]: stage_memory(model, lay, r, padded_vocab, opts) for r in ranks_to_check(lay)}
