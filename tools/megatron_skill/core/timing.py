"""Step time of a layout: compute at calibrated efficiency, communication, pipeline bubble.

One micro-batch on the busiest pipeline rank is costed piece by piece (GEMMs by a
roofline of their shapes, flash attention, memory-bound elementwise work, the loss),
then the 1F1B or interleaved schedule multiplies it out, and what Megatron does not
hide (TP collectives, MoE all-to-all, the exposed part of the data-parallel reduce and
gather, the optimizer step) is added.  Every efficiency comes from catalog/calibration.json.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

from . import flops
from .attention_kernels import MASKED_SDPA_FACTOR, PLANNED, AttentionKernel, unfused_seconds
from .catalog import CATALOG_DIR, GPUSpec, get_gpu
from .layout import Layout
from .megatron_options import MegatronOptions
from .memory import (
    BF16,
    FP8,
    FP32,
    fused_head_chunk,
    fused_head_defers_wgrad,
    layer_activation_bytes,
    moe_layers_among,
    param_split,
    rank_layers,
    ranks_to_check,
)
from .model import ModelConfig
from .moe import MoEOptions

DEFAULT_MOE = MoEOptions()
# The MoE overhead's constants are fitted to runs on this GPU (benchmarks/published_runs.py --fit)
FITTED_ON_HBM_GBPS = get_gpu("h100-sxm").hbm_gbps
# Bytes Megatron's vocab-parallel cross-entropy moves per logit, counted pass by pass in its
# code: the bf16 logits read and written in fp32 (6), the max (4), logits minus max in place (8),
# exp (8), their sum (4), softmax in place (8), backward: the gradient scaled in place (8) and
# written back in bf16 (6). The H100 profile of the Qwen2.5-1.5B shape (mbs 2: Megatron's path)
# spent 377 ms on these kernels where 52 B at the calibrated HBM rate gives 347 ms.
MEGATRON_LOSS_BYTES_PER_LOGIT = 52
# The skill's fused head (runtime/fused_head.py, compiled kernels): fp32 logits written, read twice.
FUSED_LOSS_BYTES_PER_LOGIT = 2 * FP32 + BF16
# Megatron's --cross-entropy-loss-fusion: the bf16 logits read forward, read and their gradient
# written backward, in place (counted, not measured).
FUSED_CE_BYTES_PER_LOGIT = 3 * BF16
DEFAULT_MEGATRON = MegatronOptions()


@functools.lru_cache(maxsize=None)
def calibration(gpu_key: str) -> dict[str, Any]:
    data = json.loads((CATALOG_DIR / "calibration.json").read_text())
    return {**data["default"], **data["gpus"].get(gpu_key, {})}


@dataclasses.dataclass
class StepTime:
    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    grad_accum: float = 0.0
    loss: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    cp_comm: float = 0.0
    ep_comm: float = 0.0
    moe_experts: float = 0.0
    pp_comm: float = 0.0
    bubble: float = 0.0
    dp_comm_exposed: float = 0.0
    optimizer: float = 0.0
    host: float = 0.0
    offload: float = 0.0        # activation offload's copies to and from the host, where compute does not hide them

    @property
    def total(self) -> float:
        return sum(self.__dict__.values())   # every field is a time in seconds

    def to_json(self) -> dict[str, float]:
        out = {f"{k}_ms": round(v * 1e3, 2) for k, v in dataclasses.asdict(self).items()}
        out["step_ms"] = round(self.total * 1e3, 2)
        return out


class _Rates:
    """Seconds for the primitive operations on one GPU of a given kind."""

    def __init__(self, gpu: GPUSpec, precision: str, te: bool, tp_overlap: bool | None = None):
        cal = calibration(gpu.key)
        # Transformer Engine overlaps TP collectives with GEMMs (--tp-comm-overlap, where it runs:
        # tp_overlap); without it the forward ones are exposed and the backward ones half hidden
        # behind wgrad GEMMs.
        self.tp_exposed = cal["tp_exposed_te"] if (te if tp_overlap is None else tp_overlap) else cal["tp_exposed"]
        self.latency = cal["collective_latency_us"] * 1e-6
        self.cal = cal
        fp8 = precision == "fp8" and gpu.fp8_dense_tflops
        peak = (gpu.fp8_dense_tflops if fp8 else gpu.bf16_dense_tflops) * 1e12
        # The kernel rate bench --calibrate measures on one GPU (a square GEMM); the GEMMs of a
        # model reach a fitted share of it: inside a multi-GPU run on TE's layers gemm_te_fraction
        # (fitted to published runs), on the skill's local layers gemm_local_* (kernel profiles).
        share = cal["gemm_te_fraction"] if te else cal["gemm_local_fp8" if fp8 else "gemm_local_bf16"]
        self.gemm_rate = peak * (cal["gemm_fp8"] if fp8 else cal["gemm_bf16"]) * share
        self.attn_rate = gpu.bf16_dense_tflops * 1e12 * (cal["attention_te"] if te else cal["attention"])
        self.attn_measured = {} if te else cal.get("attention_tflops", {})
        self.hbm = gpu.hbm_gbps * 1e9 * cal["hbm"]
        self.nvlink = gpu.nvlink_gbps * 1e9 * cal["nvlink_bus"]
        self.network = gpu.network_gbps * 1e9 * cal["network_bus"]
        self.in_bytes = 1 if fp8 else BF16

    def gemm(self, m: float, n: float, k: float) -> float:
        """Forward + both backward GEMMs of an (m x k) @ (k x n) product: a roofline, where
        thin shapes pay for their bytes, plus a penalty for dimensions too small to fill the GPU."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        d = self.cal["gemm_small_dim"]
        small = (1 + d / n) * (1 + d / k) * (1 + d / m)
        compute = 2 * m * n * k / self.gemm_rate * small
        bytes_ = self.in_bytes * (m * k + k * n) + BF16 * m * n
        return 3 * max(compute, bytes_ / self.hbm)

    def attention_rate(self, seq: int, head_dim: int) -> float:
        """FLOP/s of causal attention forward + backward: the calibrated kernel rate of the
        nearest measured shape (head dim first: it decides the kernel's tiles), else the
        catalog's single efficiency."""
        if not self.attn_measured:
            return self.attn_rate
        shapes = [(int(k.split("_")[0][1:]), int(k.split("_")[1][1:]), v) for k, v in self.attn_measured.items()]
        s, d, tflops = min(shapes, key=lambda x: (abs(math.log(x[1] / head_dim)), abs(math.log(x[0] / seq))))
        return tflops * 1e12

    def memory_bound(self, nbytes: float) -> float:
        return nbytes / self.hbm

    def collective(self, nbytes: float, group: int, per_domain: int, kind: str) -> float:
        """Ring time of an all-gather / reduce-scatter (kind 'ag'), or an all-reduce ('ar'), over a
        group with `per_domain` of its members in each NVLink domain. Within one domain it runs at
        NVLink's rate. Across domains NCCL runs one ring per NIC, each crossing the network once per
        domain: the members of a domain send through their own NICs at once, so the group moves
        data at per_domain x one NIC's rate (at most NVLink's), not at one NIC's."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        per_domain = max(1, min(per_domain, group))
        bw = self.nvlink if per_domain >= group else min(self.nvlink, per_domain * self.network)
        factor = 2 if kind == "ar" else 1
        return factor * (group - 1) / group * nbytes / bw


def _layer_gemms(model: ModelConfig, lay: Layout, rates: _Rates, tokens: float, moe: bool,
                 routed_factor: float = 1.0) -> float:
    h, t = model.hidden_size, lay.tp
    if model.multi_latent_attention:
        a, qk = model.num_attention_heads, model.qk_head_dim + model.qk_pos_emb_head_dim
        ql, kvl = model.q_lora_rank, model.kv_lora_rank
        time = (rates.gemm(tokens, ql, h) + rates.gemm(tokens, a * qk / t, ql) if ql
                else rates.gemm(tokens, a * qk / t, h))
        time += rates.gemm(tokens, kvl + model.qk_pos_emb_head_dim, h)
        time += rates.gemm(tokens, a * (model.qk_head_dim + model.v_head_dim) / t, kvl)
        time += rates.gemm(tokens, h, a * model.v_head_dim / t)
    else:
        q = model.num_attention_heads * model.head_dim
        kv = 2 * model.query_groups * model.head_dim
        time = rates.gemm(tokens, (q + kv) / t, h) + rates.gemm(tokens, h, q / t)
    up = 2 if model.gated else 1
    if moe:
        time += _moe_gemms(model, lay, rates, tokens, routed_factor)
        fs = model.moe_shared_expert_intermediate_size
        if fs:
            time += rates.gemm(tokens, up * fs / t, h) + rates.gemm(tokens, h, fs / t)
    else:
        f = model.ffn_hidden_size
        time += rates.gemm(tokens, up * f / t, h) + rates.gemm(tokens, h, f / t)
    return time


def _moe_gemms(model: ModelConfig, lay: Layout, rates: _Rates, tokens: float, routed_factor: float) -> float:
    """The router's and the routed experts' GEMMs of one MoE layer (forward and backward).

    With balanced routing a rank's experts see as many (token, expert) pairs as it sends: its
    sequence-parallel share of tokens x top-k, gathered over the expert-TP group (all of an
    expert's capacity when padded to it)."""
    h, t, k, fe, ep, etp = model.hidden_size, lay.tp, model.moe_router_topk, model.expert_ffn, lay.ep, lay.etp
    up = 2 if model.gated else 1
    local_experts = model.num_experts // ep
    per_expert = tokens * k * etp / t * routed_factor / local_experts
    time = local_experts * (rates.gemm(per_expert, up * fe / etp, h) + rates.gemm(per_expert, h, fe / etp))
    return time + rates.gemm(tokens, model.num_experts, h)


def _layer_elementwise_bytes(model: ModelConfig, lay: Layout, moe: bool, routed_factor: float = 1.0) -> float:
    """Bytes that norms, RoPE, the activation function and residual adds move per token,
    forward and backward (about three passes over what the forward writes). In an MoE layer
    also the token permutation: each routed copy gathered before the experts and scattered back
    after them, and with EP > 1 sorted by local expert after the all-to-all and back again
    (a read and a write of the hidden vector each)."""
    h, t = model.hidden_size, lay.tp
    sp = 1 / t if (lay.sequence_parallel or t == 1) else 1
    q = model.num_attention_heads * model.head_dim
    kv = 2 * model.query_groups * model.head_dim
    ffn = (model.expert_ffn * model.moe_router_topk * routed_factor + (model.moe_shared_expert_intermediate_size or 0)
           if moe else model.ffn_hidden_size)
    fwd = BF16 * (2 * 2 * h * sp + 2 * 2 * h * sp + 2 * (q + kv) / t + 3 * ffn / t)
    if moe:
        passes = 2 + (2 if lay.ep > 1 else 0)
        fwd += BF16 * 2 * h * passes * model.moe_router_topk * routed_factor * lay.etp / t
    return 3 * fwd


def _layer_fp8_cast_bytes(model: ModelConfig, lay: Layout, moe: bool = False, reads: int = 2) -> float:
    """Bytes per token that per-tensor FP8 casting moves around one layer's linear layers:
    every GEMM input (forward activations, backward output gradients) read `reads` times (current
    scaling: twice, amax then the cast; delayed: once) and written as FP8 in both layouts;
    weights are cast once a step. In an MoE layer the experts' inputs and output gradients are
    cast for each of the top-k copies."""
    h, t = model.hidden_size, lay.tp
    q = model.num_attention_heads * model.head_dim
    kv = 2 * model.query_groups * model.head_dim
    attention = (h + q) + (q + kv + h)
    if moe:
        fe = model.expert_ffn
        mlp = model.moe_router_topk * ((h + fe) + (fe * (2 if model.gated else 1) + h)) * lay.etp
    else:
        f = model.ffn_hidden_size
        mlp = (h + f) + (f * (2 if model.gated else 1) + h)
    return (reads * BF16 + 2) * (attention + mlp) / t


def _unfused_grad_params(model: ModelConfig, lay: Layout, rank: int, n_dense: int, n_moe: int, padded_vocab: int,
                         te: bool, fp8_linear: bool, fused_wgrad: bool) -> float:
    """Parameters of this rank whose weight gradient is written in bf16 and then added into
    the fp32 main_grad by DDP's hook, once per micro-batch.  The rest accumulate inside their
    GEMM (Megatron's gradient-accumulation fusion: TE's, apex's or the skill's stand-in)."""
    ts, rep, exp = param_split(model, n_dense, n_moe)
    vocab = padded_vocab * model.hidden_size / lay.tp
    first, last = rank == 0, rank == lay.pp - 1
    # the last stage's output weight: its own, or its copy of the tied embedding under PP
    head = last and (model.untie_embeddings_and_output_weights or lay.pp > 1)
    if not fused_wgrad:
        return ts / lay.tp + rep + exp / (lay.ep * lay.etp) + vocab * (first + head)
    out = rep + vocab * first                          # norms; the embedding's gradient is no GEMM's
    # (the fused head, like Megatron's output layer, adds its own into main_grad under the fusion:
    # _fused_head_weight_grad)
    if fp8_linear:
        out += param_split(model, n_dense, 0)[0] / lay.tp   # the FP8 layers' own autograd function
    if not te:
        out += exp / (lay.ep * lay.etp)
    return out


def _fused_head_weight_grad(rates: "_Rates", tokens: float, rows: float, h: int, chunk: int,
                            into_main_grad: bool) -> float:
    """Seconds a micro-batch of the fused head (runtime/fused_head.py) spends on its output
    weight's gradient beyond the three GEMMs rates.gemm counts.  Deferred to the backward
    (fused_head_defers_wgrad): each chunk's bf16 logit gradient copied into the micro-batch's
    buffer (written and read), then one GEMM that adds into main_grad as Megatron's own layer does
    (under the fusion) or writes the bf16 gradient (for DDP's hook, whose add _unfused_grad_params
    counts).  Accumulated in the forward: the fp32 buffer zeroed, and at the backward read once
    more and added into main_grad (read and written) under gradient-accumulation fusion, else
    written in bf16 for DDP's hook; and each chunk's accumulating GEMM reading and writing that
    buffer, where those bytes outlast the chunk's own multiply (a roofline per chunk: with
    1,024-token chunks of a 3,072-wide model about even)."""
    weight = rows * h
    if fused_head_defers_wgrad(tokens, h):
        return rates.memory_bound(2 * BF16 * tokens * rows)
    chunks = math.ceil(tokens / chunk)
    one_chunk_wgrad = rates.gemm(min(tokens, chunk), rows, h) / 3
    accumulate = chunks * max(0.0, rates.memory_bound(2 * FP32 * weight) - one_chunk_wgrad)
    hand_over = 3 * FP32 if into_main_grad else FP32 + BF16
    return accumulate + rates.memory_bound((FP32 + hand_over) * weight)


def _dispatch_time(model: ModelConfig, lay: Layout, rates: _Rates, tokens: float, node: int,
                   opts: MoEOptions) -> float:
    """Seconds of one MoE layer's token dispatch and combine, forward and backward (four
    exchanges), for the tokens this rank holds, by dispatcher. Expert ranks follow each other in
    Megatron's rank order (expert-TP innermost), so an EP group fills an NVLink domain before it
    leaves it: the share of a rank's peers inside its domain goes over NVLink, the rest over the
    network, both at once."""
    h, k, ep, etp = model.hidden_size, model.moe_router_topk, lay.ep, lay.etp
    if ep == 1:   # every expert local: TP's own collectives (tp_comm) move the tokens
        return 0.0
    if opts.dispatcher == "allgather":
        # every token of the TP x EP group gathered to every rank, then reduced back
        group = lay.tp * ep
        fast = group <= node
        one = BF16 * tokens * h * (group - 1) / (rates.nvlink if fast else rates.network)
        return 4 * (one + rates.latency)
    in_domain = max(1, min(ep, node // etp))          # EP peers sharing this rank's NVLink domain
    copies = BF16 * tokens * h * k * opts.routed_factor()
    near = copies * (in_domain - 1) / ep
    far = copies * (ep - in_domain) / ep
    if opts.dispatcher == "flex" and far:
        # DeepEP / HybridEP send a token once to each remote domain holding one of its experts,
        # then forward it over NVLink: the network carries distinct domains, not top-k copies.
        domains = ep / in_domain
        distinct = (domains - 1) * (1 - (1 - 1 / domains) ** k)
        far = BF16 * tokens * h * distinct * opts.routed_factor()
    one = max(near / rates.nvlink, far / rates.network if far else 0.0)
    exchange = 4 * (one + rates.latency)
    # --overlap-moe-expert-parallel-comm runs one micro-batch's exchange under another's compute
    return exchange * (rates.cal["ep_overlap_exposed"] if opts.overlap_ep_comm else 1.0)


def _expert_overhead_time(model: ModelConfig, lay: Layout, gpu: GPUSpec, cal: dict[str, Any], tokens: float,
                          opts: MoEOptions) -> float:
    """Seconds one MoE layer spends beyond its modelled GEMMs, exchanges and element-wise work,
    fitted to NVIDIA's published H100 MoE runs (catalog/calibration.json; python
    benchmarks/published_runs.py --fit). Two parts, both per token of the micro-batch and per
    local expert (the experts' GEMMs, casts and permutations run expert by expert inside the
    grouped kernels): one every MoE layer pays (moe_us_per_token_expert: the token-drop runs,
    padded to capacity, pay it too), and one more where the dispatcher reads the routing counts
    back to the host (dropless routing, or a capacity without padding: moe_dropless_*). The fit
    scales with tokens, not with micro-batches, so it is not the sync's launch latency alone.
    Without grouped GEMMs the per-expert part is taken as larger (moe_sequential_factor, assumed).
    On another GPU the share of it that runs at the memory rate (moe_overhead_hbm_share, fitted to
    the Blackwell MoE runs) scales with its HBM bandwidth against the H100 SXM's; the rest stays."""
    local = model.num_experts // lay.ep
    sequential = 1 if opts.grouped_gemm else cal["moe_sequential_factor"]
    per_token = cal["moe_us_per_token_expert"] * sequential * local
    if opts.host_sync:
        per_token += cal["moe_dropless_us_per_token"] + cal["moe_dropless_us_per_token_expert"] * sequential * local
    share = cal["moe_overhead_hbm_share"]
    return tokens * per_token * 1e-6 * (1 - share + share * FITTED_ON_HBM_GBPS / gpu.hbm_gbps)


def _kernel_attention(model: ModelConfig, gpu: GPUSpec, rates: _Rates, lay: Layout, kernel: AttentionKernel,
                      planned: float) -> float:
    """Seconds of one layer's core attention for one micro-batch with the run's kernel, where
    `planned` is the planner's kernel's (core/attention_kernels.py)."""
    if kernel.kind == "sdpa_masked":
        return planned * MASKED_SDPA_FACTOR
    if kernel.kind == "unfused":
        d = model.head_dim
        scores = lay.mbs * model.num_attention_heads / lay.tp * float(lay.seq_length) ** 2
        # the score GEMMs at the calibrated BF16 rate, a head dimension's small K taken as the
        # GEMMs of the layers take it
        flops_rate = gpu.bf16_dense_tflops * 1e12 * rates.cal["gemm_bf16"] / (1 + rates.cal["gemm_small_dim"] / d)
        return max(planned, unfused_seconds(kernel, scores, d, flops_rate, rates.hbm))
    return planned


def clear_caches() -> None:
    """After the calibration changes (bench --store-calibration): costs are computed anew."""
    calibration.cache_clear()
    clear_caches_keep_calibration()


def clear_caches_keep_calibration() -> None:
    """Costs computed anew from a calibration edited in place (the fit of benchmarks/published_runs.py)."""
    _layer_times.cache_clear()
    _one_layer.cache_clear()
    _rank_mix.cache_clear()


LAYER_FIELDS = ("gemm", "attention", "elementwise", "tp_comm", "cp_comm", "ep_comm", "moe_experts")
ZERO_LAYER = (0.0,) * len(LAYER_FIELDS)


@functools.lru_cache(maxsize=65536)
def _layer_times(model: ModelConfig, gpu: GPUSpec, te: bool, fp8_linear: bool, tp: int, cp: int, ep: int, etp: int,
                 mbs: int, s: int, sp: bool, precision: str,
                 moe_opts: MoEOptions = DEFAULT_MOE, tp_overlap: bool | None = None,
                 kernel: AttentionKernel = PLANNED, fp8_reads: int = 2) -> dict[bool | str, tuple[float, ...]]:
    """Seconds of one dense (key False) and one MoE layer (True) for one micro-batch, by
    LAYER_FIELDS, and one forward of the MoE block alone ("moe_forward"): what the layout decides
    of them (not the pipeline split or data parallelism, which the planner varies most)."""
    shape = (model, gpu, te, fp8_linear, tp, cp, mbs, s, sp, precision, moe_opts, tp_overlap, kernel, fp8_reads)
    out: dict[bool | str, tuple[float, ...]] = {False: _one_layer(*shape, 1, 1, False)}
    if model.is_moe:
        out[True], out["moe_forward"] = _one_layer(*shape, ep, etp, True)
    return out


@functools.lru_cache(maxsize=65536)
def _one_layer(model: ModelConfig, gpu: GPUSpec, te: bool, fp8_linear: bool, tp: int, cp: int, mbs: int, s: int,
               sp: bool, precision: str, moe_opts: MoEOptions, tp_overlap: bool | None, kernel: AttentionKernel,
               fp8_reads: int, ep: int, etp: int, moe: bool):
    """_layer_times of one kind of layer, cached across the layouts of a search: a dense layer's by
    the sizes it depends on (not EP or ETP, which the search varies across hundreds of values);
    an MoE layer's with the forward of its MoE block."""
    lay = Layout(tp=tp, cp=cp, ep=ep, etp=etp, mbs=mbs, seq_length=s, sequence_parallel=sp, precision=precision)
    rates = _Rates(gpu, precision if te else "bf16", te, tp_overlap)
    layer_rates = _Rates(gpu, "fp8", te, tp_overlap) if fp8_linear else rates
    h, t = model.hidden_size, tp
    tokens = mbs * s / cp
    node = gpu.nvlink_domain
    routed = moe_opts.routed_factor()
    gemm = _layer_gemms(model, lay, rates if moe else layer_rates, tokens, moe, routed)
    elementwise = 0.0
    if (layer_rates is not rates and not moe) or (te and precision == "fp8"):
        # the casts of the FP8 GEMMs' inputs: the skill's layers, or TE's current scaling
        reads = fp8_reads if layer_rates is not rates else 2   # the skill's layers scale as asked
        elementwise += rates.cal["fp8_cast_factor"] * rates.memory_bound(
            _layer_fp8_cast_bytes(model, lay, moe, reads) * tokens)
    core = flops.core_attention_flops_per_token(model, s) * tokens / t
    # Load-balanced causal CP runs attention as 2 x CP smaller blocks per rank: less efficient.
    head_dim = model.head_dim if not model.multi_latent_attention else model.qk_head_dim
    attn_rate = rates.attention_rate(s // cp, head_dim) / (1 + rates.cal["cp_block_penalty"] * (cp - 1))
    attention = _kernel_attention(model, gpu, rates, lay, kernel, 3 * core / attn_rate)
    # Without TE, Megatron's local layers run RoPE, norms, residual adds and casts as
    # separate torch kernels: calibrated as a multiple of the fused byte count.
    unfused = 1.0 if te else rates.cal["elementwise_local_factor"]
    elementwise += unfused * rates.memory_bound(_layer_elementwise_bytes(model, lay, moe, routed) * tokens)
    # TP: 2 all-gathers + 2 reduce-scatters forward (or 2 all-reduces without SP),
    # as many backward; the backward ones overlap half with the weight-gradient GEMMs.
    act = BF16 * tokens * h
    tp_one = rates.collective(act, t, min(t, node), "ag") + (rates.latency if t > 1 else 0.0)
    tp_comm = tp_one * 8 * rates.tp_exposed
    cp_comm = ep_comm = experts = 0.0
    if cp > 1:
        kv = (2 * model.query_groups * model.head_dim if not model.multi_latent_attention
              else model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim))
        fast = t * cp <= node
        ring = 3 * (cp - 1) * (BF16 * tokens * kv / t / (rates.nvlink if fast else rates.network) + rates.latency)
        # The ring overlaps with attention blocks, but never completely.
        cp_comm = max(rates.cal["cp_ring_min_exposed"] * ring, ring - 3 * core / attn_rate)
    if not moe:
        return (gemm, attention, elementwise, tp_comm, cp_comm, ep_comm, experts)
    ep_comm = _dispatch_time(model, lay, rates, tokens / (t if sp else 1), node, moe_opts)
    # per token a rank routes: with sequence parallelism 1/TP of the micro-batch, as the dispatch
    experts = _expert_overhead_time(model, lay, gpu, rates.cal, tokens / (t if sp else 1), moe_opts)
    # one forward of the MoE block, what recomputing it ('moe' in --recompute-modules) re-runs
    # (GEMMs and the experts' overhead: a third of forward and backward; the exchanges: half)
    moe_forward = (_moe_gemms(model, lay, rates, tokens, routed) / 3 + ep_comm / 2 + experts / 3,)
    return (gemm, attention, elementwise, tp_comm, cp_comm, ep_comm, experts), moe_forward


def _per_layer(model: ModelConfig, lay: Layout, gpu: GPUSpec, te: bool, fp8_linear: bool, moe: MoEOptions,
               megatron: MegatronOptions, attention: AttentionKernel, fp8_delayed: bool) -> dict:
    """_layer_times for this layout: what step_time and step_floor read."""
    # TE's TP overlap runs where render writes --tp-comm-overlap (adapter/arguments.py, te_only_args)
    tp_overlap = te and megatron.tp_overlap_runs(lay.tp, lay.sequence_parallel, gpu.nvlink_domain)
    return _layer_times(model, gpu, te, fp8_linear, lay.tp, lay.cp, lay.ep, lay.etp, lay.mbs, lay.seq_length,
                        lay.sequence_parallel or lay.tp == 1, lay.precision, moe, tp_overlap, attention,
                        1 if fp8_delayed else 2)


def step_floor(model: ModelConfig, lay: Layout, gpu: GPUSpec, te: bool = True, fp8_linear: bool = False,
               moe: MoEOptions = DEFAULT_MOE, megatron: MegatronOptions = DEFAULT_MEGATRON,
               attention: AttentionKernel = PLANNED, fp8_delayed: bool = False) -> float:
    """Seconds that step_time(...).total never goes below for this layout, whatever its recompute:
    the busiest checked rank's layers, forward and backward, over every micro-batch and the
    pipeline's bubble; the output layer, loss, gradient accumulation, recompute, pipeline and
    data-parallel traffic, optimizer and host time left out (each adds to a step, none takes
    away). The planner's search costs a layout in full only while this floor can still reach the
    head of its ranking; a few table look-ups instead of the whole model."""
    per_layer = _per_layer(model, lay, gpu, te, fp8_linear, moe, megatron, attention, fp8_delayed)
    dense, expert = sum(per_layer[False]), sum(per_layer.get(True, ZERO_LAYER))
    busiest = max(n_dense * dense + n_moe * expert for n_dense, n_moe in _checked_rank_mix(model, lay))
    return busiest * (lay.num_microbatches + (lay.pp - 1) / lay.vp)


def _checked_rank_mix(model: ModelConfig, lay: Layout) -> tuple[tuple[int, int], ...]:
    """(dense, MoE) layer counts of each rank step_time checks: the pipeline split's alone."""
    return _rank_mix(model, lay.pp, lay.vp, lay.pipeline_split, lay.first_stage_layers, lay.last_stage_layers,
                     lay.pipeline_layout)


@functools.lru_cache(maxsize=4096)
def _rank_mix(model: ModelConfig, pp: int, vp: int, split: str, first: int, last: int,
              layout: str) -> tuple[tuple[int, int], ...]:
    lay = Layout(pp=pp, vp=vp, pipeline_split=split, first_stage_layers=first, last_stage_layers=last,
                 pipeline_layout=layout)
    mix = []
    for r in ranks_to_check(lay):
        layers = rank_layers(model, lay, r)
        n_moe = moe_layers_among(model, tuple(layers))
        mix.append((len(layers) - n_moe, n_moe))
    return tuple(mix)


def step_time(model: ModelConfig, lay: Layout, gpu: GPUSpec, padded_vocab: int, te: bool = True,
              fused_head: bool = False, fp8_linear: bool = False, fused_wgrad: bool = True,
              moe: MoEOptions = DEFAULT_MOE, megatron: MegatronOptions = DEFAULT_MEGATRON,
              attention: AttentionKernel = PLANNED, fp8_delayed: bool = False) -> StepTime:
    # Without TE, FP8 is the skill's own linear layers (fp8_linear; precision fp8 asks for them
    # too): attention and MLP GEMMs at the FP8 rate, plus their casts; the rest stays BF16.
    rates = _Rates(gpu, lay.precision if te else "bf16", te)
    h, t, s = model.hidden_size, lay.tp, lay.seq_length
    tokens = lay.mbs * s / lay.cp                      # tokens of one micro-batch on this rank
    sp = lay.sequence_parallel or t == 1
    node = gpu.nvlink_domain

    # the fused head takes the micro-batch only where it keeps less memory (the runtime's rule)
    head_chunk = fused_head_chunk(tokens, h, padded_vocab / t) if fused_head and not model.mtp_num_layers else 0
    head_fused = head_chunk > 0
    per_layer = _per_layer(model, lay, gpu, te, fp8_linear, moe, megatron, attention, fp8_delayed)

    # The busiest rank decides the pace of the pipeline: the one with most work per micro-batch.
    def rank_time(rank: int) -> tuple[StepTime, int]:
        layers = rank_layers(model, lay, rank)
        n_moe = moe_layers_among(model, tuple(layers))
        n_dense = len(layers) - n_moe
        dense_layer, moe_layer = per_layer[False], per_layer.get(True, ZERO_LAYER)
        r = StepTime(**{name: n_dense * d + n_moe * m for name, d, m in zip(LAYER_FIELDS, dense_layer, moe_layer)})
        if lay.recompute == "full":
            per_chunk = len(layers) / lay.vp
            frac = min(lay.recompute_layers, per_chunk) / max(per_chunk, 1)
            r.recompute = frac * (r.gemm + r.attention + r.elementwise + r.tp_comm / 2) / 3
        elif lay.recompute == "selective":
            r.recompute = rates.cal["selective_recompute_share"] * r.elementwise
            if "moe" in moe.recompute and n_moe:   # the whole MoE block re-runs its forward
                r.recompute += n_moe * per_layer["moe_forward"][0]
        if rank == lay.pp - 1:  # output layer and the loss over the (padded) vocabulary
            r.gemm += rates.gemm(tokens, padded_vocab / t, h) * (1 + (model.mtp_num_layers or 0))
            per_entry = (FUSED_LOSS_BYTES_PER_LOGIT if head_fused else
                         FUSED_CE_BYTES_PER_LOGIT if megatron.cross_entropy_fusion else MEGATRON_LOSS_BYTES_PER_LOGIT)
            r.loss += rates.memory_bound(tokens * padded_vocab / t * per_entry)
            if head_fused:
                r.loss += _fused_head_weight_grad(rates, tokens, padded_vocab / t, h, head_chunk, fused_wgrad)
        # main_grad += bf16 gradient: fp32 read and write, bf16 read; a mixed-dtype kernel, so
        # slower than the HBM roofline by a calibrated factor.
        unfused = _unfused_grad_params(model, lay, rank, n_dense, n_moe, padded_vocab, te, fp8_linear, fused_wgrad)
        r.grad_accum = rates.cal["grad_accum_factor"] * rates.memory_bound(unfused * (2 * FP32 + BF16))
        return r, len(layers)

    ranks = ranks_to_check(lay)
    per_rank = {r: rank_time(r)[0] for r in ranks}
    busiest = max(per_rank.values(), key=lambda r: r.total)
    m = lay.num_microbatches
    st = StepTime(**{name: value * m for name, value in busiest.__dict__.items()})
    st.bubble = busiest.total * (lay.pp - 1) / lay.vp

    if lay.pp > 1:  # activations to the next stage and gradients back, per micro-batch and chunk
        p2p = BF16 * tokens * h / (t if sp else 1)
        fast = lay.world_size <= node
        per_mb = 2 * lay.vp * (p2p / (rates.nvlink if fast else rates.network) + rates.latency)
        st.pp_comm = m * per_mb * (rates.cal["pp_comm_interleaved_exposed"] if lay.vp > 1 else 1.0)

    # Data parallel: reduce-scatter the gradients (fp32, or bf16 with --grad-reduce-in-bf16),
    # all-gather the weights (bf16, or FP8 with --fp8-param-gather), or one all-reduce.
    # Megatron starts them bucket by bucket during the last micro-batch's backward and the
    # next step's first forward, so only what outlasts one micro-batch shows.
    first = rank_layers(model, lay, 0)
    n_moe = moe_layers_among(model, tuple(first))
    ts, rep, exp = param_split(model, len(first) - n_moe, n_moe)
    ts += padded_vocab * h
    dense_local = ts / t + rep
    expert_local = exp / (lay.ep * lay.etp)
    dp_group = lay.dp * lay.cp
    # Megatron orders ranks TP innermost: a data-parallel (x CP) group's members sit TP ranks
    # apart, an expert-data-parallel group's expert-TP x EP apart; how many share a domain.
    dp_fast = node // lay.tp
    edp_fast = node // (lay.etp * lay.ep)
    grad = BF16 if megatron.bf16_grads else FP32
    weight = FP8 if megatron.fp8_param_gather and te and lay.precision == "fp8" else BF16
    if lay.distributed_optimizer or megatron.fsdp:
        rs = rates.collective(grad * dense_local, dp_group, dp_fast, "ag") + \
            rates.collective(grad * expert_local, lay.expert_dp, edp_fast, "ag")
        ag = rates.collective(weight * dense_local, dp_group, dp_fast, "ag") + \
            rates.collective(weight * expert_local, lay.expert_dp, edp_fast, "ag")
    else:
        rs = rates.collective(grad * dense_local, dp_group, dp_fast, "ar") + \
            rates.collective(grad * expert_local, lay.expert_dp, edp_fast, "ar")
        ag = 0.0
    least = rates.cal["dp_min_exposed"]
    if megatron.fsdp:
        # Megatron-FSDP gathers each layer's weights before its forward and again before its
        # backward, and reduce-scatters its gradients as they are made, in every micro-batch:
        # each micro-batch's traffic hides behind that micro-batch's compute, layer by layer.
        per_mb = 2 * ag + rs
        st.dp_comm_exposed = m * max(least * per_mb, per_mb - busiest.total)
    else:
        # The reduce-scatter hides behind the backward passes of the pipeline's cool-down (the last
        # micro-batch, plus the bubble's (PP-1)/VP slots), the gather behind the next warm-up.
        window = busiest.total * (1 + (lay.pp - 1) / lay.vp)
        st.dp_comm_exposed = max(least * rs, rs - rates.cal["dp_reduce_window"] * window) + \
            max(least * ag, ag - rates.cal["dp_gather_window"] * window)

    # Adam over this rank's shard: fp32 master, two moments, the gradient, the bf16 weight.
    shard = dp_group if lay.distributed_optimizer or megatron.fsdp else 1
    eshard = lay.expert_dp if lay.distributed_optimizer or megatron.fsdp else 1
    opt_params = dense_local / shard + expert_local / eshard
    st.optimizer = rates.memory_bound(opt_params * (3 * 2 * FP32 + FP32 + BF16) + (dense_local + expert_local) * FP32)
    # Megatron's local layers launch a few dozen kernels a layer; the GPU waits on the host for
    # part of them (calibrated per GPU); TE's fused layers launch far fewer. CUDA graphs replay
    # what they captured without the host: their share of each layer, and with the whole
    # iteration captured the per-micro-batch work too.
    per_layer = rates.cal["layer_overhead_ms"] if te else rates.cal["layer_overhead_local_ms"]
    layer_ms = 0.0
    for r in ranks:
        layers = rank_layers(model, lay, r)
        n_moe = moe_layers_among(model, tuple(layers))
        ungraphed = (len(layers) - n_moe) * (1 - megatron.graphed_layer_share(False)) + \
            n_moe * (1 - megatron.graphed_layer_share(True))
        layer_ms = max(layer_ms, ungraphed * per_layer)
    per_mb = 0.0 if megatron.cuda_graph_impl == "full_iteration" else lay.vp * rates.cal["host_overhead_ms_per_microbatch"]
    st.host = m * (per_mb + layer_ms) * 1e-3
    st.offload = m * _offload_exposed(model, lay, gpu, megatron, busiest.total) if te else 0.0
    return st


def _offload_exposed(model: ModelConfig, lay: Layout, gpu: GPUSpec, megatron: MegatronOptions,
                     micro_batch_s: float) -> float:
    """Seconds a micro-batch waits on activation offload: the offloaded layers' saved tensors go to
    the host in the forward and come back in the backward over the GPU's host link, each way
    beside that micro-batch's compute (TE's CPU-offload context overlaps the copies with the
    next layers); what the compute does not cover is exposed."""
    n = min(megatron.activation_offload_layers, model.num_layers)
    if not n:
        return 0.0
    layers = tuple(range(n))
    n_moe = moe_layers_among(model, layers)
    tokens = lay.mbs * lay.seq_length / lay.cp
    one_way = tokens * ((n - n_moe) * layer_activation_bytes(model, lay, False)
                        + (n_moe * layer_activation_bytes(model, lay, True) if n_moe else 0.0))
    return max(0.0, 2 * one_way / (gpu.host_link_gbps * 1e9) - micro_batch_s)
