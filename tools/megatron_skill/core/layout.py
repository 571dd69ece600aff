"""A parallel layout (how one training job is cut over GPUs) and Megatron's rules for it.

``check_layout`` names the first rule a layout breaks, in the words of Megatron's own
argument checks, so the planner can group what it rejects and validate can say why.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Iterator

from .catalog import GPUSpec
from .megatron_options import MegatronOptions
from .model import ModelConfig
from .moe import MoEOptions

RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp8")


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1                  # tensor parallel
    pp: int = 1                  # pipeline parallel
    vp: int = 1                  # virtual pipeline stages per pipeline rank (1: plain 1F1B)
    cp: int = 1                  # context parallel
    ep: int = 1                  # expert parallel
    etp: int = 1                 # expert tensor parallel
    dp: int = 1                  # data parallel
    mbs: int = 1                 # micro-batch size
    gbs: int = 1                 # global batch size (sequences)
    seq_length: int = 4096
    recompute: str = "none"      # none | selective | full
    recompute_layers: int = 0    # with full: layers of each (virtual) stage recomputed
    distributed_optimizer: bool = True
    sequence_parallel: bool = False
    precision: str = "bf16"
    pipeline_split: str = "even"  # even | embedding_loss (they count as layers) | uneven (first / last below)
                                  # | layout (pipeline_layout below)
    first_stage_layers: int = 0   # uneven: transformer layers of the first pipeline rank
    last_stage_layers: int = 0    # uneven: of the last; the middle ranks share the rest evenly
    pipeline_layout: str = ""     # layout: Megatron's --pipeline-model-parallel-layout, e.g. "Et|(tt|)*30mL"

    def but(self, **changes: Any) -> "Layout":
        """This layout with some fields changed: dataclasses.replace without re-running the
        constructor (a Layout has no checks of its own there), for the planner's inner loops."""
        new = object.__new__(Layout)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def num_microbatches(self) -> int:
        return self.gbs // (self.mbs * self.dp)

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert weights (Megatron's MoE parallel folding)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def rank_layer_counts(self, num_layers: int) -> list[int] | None:
        """Transformer layers of each pipeline rank under Megatron's split (the uneven one of
        --decoder-first/last-pipeline-num-layers: the middle ranks share what is left evenly);
        None when the split is not whole."""
        L, p = num_layers, self.pp
        if self.pipeline_split == "uneven":
            first, last, middle = self.first_stage_layers, self.last_stage_layers, p - 2
            rest = L - first - last
            if p < 2 or rest < 0 or (middle == 0 and rest) or (middle > 0 and rest % middle):
                return None
            return [first] + [rest // middle] * middle + [last] if middle > 0 else [first, last]
        sizes = self.chunk_sizes(L)
        if sizes is None:
            return None
        return [sum(sizes[c] for c in range(r, len(sizes), p)) for r in range(p)]

    def chunk_sizes(self, num_layers: int) -> list[int] | None:
        """Transformer layers of each model chunk, chunk c on pipeline rank c % PP; None when the
        split is not whole."""
        L, n = num_layers, self.pp * self.vp
        if self.pipeline_split == "layout":
            chunks = pipeline_layout_chunks(self.pipeline_layout)
            if chunks is None or len(chunks) != n or sum(c.count("t") for c in chunks) != L:
                return None
            return [c.count("t") for c in chunks]
        if self.pipeline_split == "uneven":
            counts = self.rank_layer_counts(L)
            if counts is None or any(c % self.vp for c in counts):
                return None
            return [counts[c % self.pp] // self.vp for c in range(n)]
        if self.pipeline_split == "embedding_loss" and n > 1:
            if (L + 2) % n:
                return None
            sizes = [(L + 2) // n] * n
            sizes[0] -= 1
            sizes[-1] -= 1
            return sizes
        return [L // n] * n if L % n == 0 else None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.pipeline_split != "layout":
            del d["pipeline_layout"]
        d["world_size"] = self.world_size
        d["num_microbatches"] = self.num_microbatches
        if self.ep > 1 or self.etp > 1:
            d["expert_dp"] = self.expert_dp
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Layout":
        """The layout a to_json dict describes (its derived fields are recomputed)."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def label(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.pipeline_split == "uneven":
            parts[-1] += f"({self.first_stage_layers}+..+{self.last_stage_layers})"
        elif self.pipeline_split == "layout":
            parts[-1] += f"[{self.pipeline_layout}]"
        if self.vp > 1:
            parts.append(f"VP{self.vp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.etp > 1:
            parts.append(f"ETP{self.etp}")
        parts += [f"DP{self.dp}", f"mbs{self.mbs}"]
        if self.recompute == "full":
            parts.append(f"recompute-full{self.recompute_layers}")
        elif self.recompute == "selective":
            parts.append("recompute-sel")
        if self.precision == "fp8":
            parts.append("FP8")
        if not self.distributed_optimizer:
            parts.append("no-distopt")
        if self.tp > 1 and not self.sequence_parallel:
            parts.append("no-SP")
        return " ".join(parts)


# Megatron's --pipeline-model-parallel-layout: model chunks separated by '|', chunk c on pipeline
# rank c % PP; E the embedding, t a transformer layer, m a multi-token-prediction layer, L the
# loss; "(...)*n" and "x*n" repeat, commas are cosmetic. Bounded: a hostile "t*10**9" is refused.
LAYOUT_MAX_UNITS = 100_000


@functools.lru_cache(maxsize=256)
def pipeline_layout_chunks(text: str) -> tuple[str, ...] | None:
    """The layout string as one string of unit letters per model chunk; None when malformed."""
    expanded = text.replace(",", "")
    for pattern in (r"\(([^()]+)\)\*(\d+)", r"([^()|])\*(\d+)"):
        def repeat(m: re.Match) -> str:
            n = int(m.group(2))
            if n * len(m.group(1)) > LAYOUT_MAX_UNITS:
                raise ValueError("too long")
            return m.group(1) * n
        try:
            expanded = re.sub(pattern, repeat, expanded)
        except ValueError:
            return None
        if len(expanded) > LAYOUT_MAX_UNITS:
            return None
    chunks = tuple(expanded.split("|"))
    return chunks if all(set(c) <= set("EtmL") for c in chunks) else None


def pipeline_layout_problem(lay: Layout, model: ModelConfig) -> str | None:
    """What Megatron's PipelineParallelLayerLayout would refuse in the layout string, in words."""
    chunks = pipeline_layout_chunks(lay.pipeline_layout)
    if not chunks:
        return "it does not parse (letters E, t, m, L; '|' between chunks; (...)*n and x*n repeats)"
    if len(chunks) != lay.pp * lay.vp:
        return f"it has {len(chunks)} chunks, not PP x VP = {lay.pp * lay.vp}"
    units = "".join(chunks)
    if units.count("E") != 1 or units.count("L") != 1 or not units.startswith("E") or not units.endswith("L"):
        return "it must begin with the one E (embedding) and end with the one L (loss)"
    if units.count("t") != model.num_layers:
        return f"it places {units.count('t')} transformer layers, the model has {model.num_layers}"
    mtp = model.mtp_num_layers or 0
    if units.count("m") != mtp or ("m" in units and "t" in units[units.index("m"):]):
        return f"it must place the model's {mtp} MTP layer(s), after every transformer layer"
    if any("m" in c for i, c in enumerate(chunks) if i < len(chunks) - lay.pp):
        return "MTP layers must sit in a rank's last virtual stage"
    return None


# The rule book: one record a rule, what it says and how to satisfy it in Megatron's flags (the
# words validate and render answer with). Names are stable: tests and callers use them; the
# checks are broken_rules' (and, with cpu_loop=True, the CPU loop's).
@dataclasses.dataclass(frozen=True)
class Rule:
    message: str
    fix: str                        # for a script, in Megatron's flags (the CPU loop's: for a request)
    request_fix: str | None = None  # for a request's layout fields, where its words differ from the flags'

    def for_request(self) -> str:
        return self.request_fix or self.fix


RULES = {
    "world_size": Rule(
        "TP x PP x CP x DP must equal the number of GPUs",
        "make TP x PP x CP divide the number of GPUs the script starts (DP is what is left)",
        "leave dp out (it is what the GPUs leave), or give dp = num_gpus / (tp x pp x cp)"),
    "tp_heads": Rule(
        "num_attention_heads must be divisible by TP",
        "choose a TP that divides --num-attention-heads"),
    "tp_query_groups": Rule(
        "num_query_groups must be divisible by TP",
        "choose a TP that divides --num-query-groups"),
    "tp_within_nvlink": Rule(
        "TP must fit inside one NVLink domain (a node): TP traffic is on every layer",
        "keep TP within one node (8 GPUs on HGX); use PP or CP across nodes"),
    "ep_experts": Rule(
        "num_experts must be divisible by EP",
        "choose an --expert-model-parallel-size that divides --num-experts"),
    "ep_without_moe": Rule(
        "EP and expert-TP need a mixture-of-experts model",
        "drop --expert-model-parallel-size for a dense model"),
    "expert_folding": Rule(
        "TP x CP x DP must be divisible by EP x expert-TP (Megatron's MoE parallel folding)",
        "make EP x expert-TP divide TP x CP x DP"),
    "moe_needs_sp": Rule(
        "an MoE model with TP > 1 needs --sequence-parallel",
        "add --sequence-parallel (MoE with TP > 1 requires it)"),
    "pp_layers": Rule(
        "num_layers must be divisible by PP (or by PP after counting the embedding and loss as layers)",
        "choose a PP that divides --num-layers, or add --account-for-embedding-in-pipeline-split "
        "--account-for-loss-in-pipeline-split, or set --decoder-first-pipeline-num-layers / "
        "--decoder-last-pipeline-num-layers"),
    "pp_uneven": Rule(
        "with --decoder-first/last-pipeline-num-layers every pipeline rank needs a layer and the middle ranks "
        "must share the rest evenly (and each rank's layers divide by the virtual stages)",
        "give first and last stage layer counts that leave the middle ranks an even share"),
    "vp_layers": Rule(
        "layers per pipeline rank must be divisible by the virtual stages",
        "choose virtual stages that divide the layers per pipeline rank"),
    "pp_layout": Rule(
        "Megatron's --pipeline-model-parallel-layout must name PP x VP chunks, begin with the embedding (E), "
        "end with the loss (L), and place every transformer layer (t) and MTP layer (m) once",
        "write --pipeline-model-parallel-layout with PP x VP chunks: E first, L last, every layer t and MTP "
        "layer m once (references/parallelism-guide.md)"),
    "vp_needs_pp": Rule(
        "the interleaved schedule (VP > 1) needs PP > 1",
        "drop the virtual pipeline flags, or use PP > 1"),
    "vp_microbatches": Rule(
        "with VP > 1 the number of micro-batches must be a multiple of PP",
        "make global batch / (micro-batch x DP) a multiple of PP",
        "make global_batch_size / (mbs x dp) a multiple of pp, or vp 1"),
    "cp_sequence": Rule(
        "seq_length must be divisible by 2 x CP (load-balanced causal context parallel)",
        "make --seq-length divisible by 2 x CP",
        "make seq_length divisible by 2 x cp"),
    "gbs_divisible": Rule(
        "global batch must be divisible by micro-batch x DP",
        "make --global-batch-size a multiple of --micro-batch-size x DP",
        "make global_batch_size a multiple of mbs x dp"),
    "fp8_arch": Rule(
        "FP8 needs FP8 tensor cores: Ada (sm_89), Hopper (sm_90) or newer",
        "drop --fp8-format (FP8 needs Ada, Hopper or newer)",
        "precision bf16 (FP8 needs Ada, Hopper or newer)"),
    "sp_needs_tp": Rule(
        "sequence parallel needs TP > 1",
        "drop --sequence-parallel, or use TP > 1",
        "sequence_parallel false, or tp > 1"),
    "recompute_layers": Rule(
        "full recompute of N layers needs 1 <= N <= layers per (virtual) stage",
        "set --recompute-num-layers between 1 and the layers per stage"),
    "seq_positions": Rule(
        "seq_length exceeds the learned position embeddings",
        "raise --max-position-embeddings or lower --seq-length"),
    "out_of_memory": Rule(
        "predicted peak memory exceeds the GPU",
        "more recompute, a smaller micro-batch, or more TP / PP / CP; 'launch.py plan' finds one that fits"),
    "cp_needs_te": Rule(
        "context parallelism needs Transformer Engine's attention (the local SDPA path has none)",
        "install Transformer Engine (or run in an NGC PyTorch container), or set --context-parallel-size 1"),
    "qk_norm_sp_needs_te": Rule(
        "without Transformer Engine, Megatron's torch norm refuses sequence parallelism, and a QK-layernorm "
        "model's attention uses it: TE's norm, or TP without sequence parallel",
        "use Transformer Engine's layers (--transformer-impl transformer_engine), or drop --sequence-parallel"),
    "moe_pad_needs_capacity": Rule(
        "padding experts to capacity (pad_to_capacity) needs a capacity_factor",
        "add --moe-expert-capacity-factor, or drop --moe-pad-expert-input-to-capacity"),
    "moe_overlap_needs_ep": Rule(
        "overlapping the expert all-to-all (overlap_ep_comm) needs EP > 1",
        "drop --overlap-moe-expert-parallel-comm, or set --expert-model-parallel-size > 1"),
    "moe_overlap_dispatcher": Rule(
        "overlapping the expert all-to-all (overlap_ep_comm) needs the alltoall or flex dispatcher",
        "set --moe-token-dispatcher-type alltoall (or flex) with --overlap-moe-expert-parallel-comm"),
    "moe_overlap_needs_vp": Rule(
        "overlapping the expert all-to-all (overlap_ep_comm) with PP > 1 needs virtual pipeline stages (VP > "
        "1)",
        "add --num-virtual-stages-per-pipeline-rank, or drop --overlap-moe-expert-parallel-comm"),
    "moe_overlap_recompute": Rule(
        "overlapping the expert all-to-all (overlap_ep_comm) excludes full recompute and the recompute of "
        "whole MoE layers ('moe' in the MoE recompute)",
        "use selective recompute, or drop --overlap-moe-expert-parallel-comm"),
    "moe_flex_needs_te": Rule(
        "the flex dispatcher (DeepEP / HybridEP) runs with Transformer Engine's MoE layers",
        "use Transformer Engine's layers, or --moe-token-dispatcher-type alltoall"),
    "fp8_param_gather_needs_te_fp8": Rule(
        "gathering FP8 weights (fp8_param_gather) needs precision fp8 on Transformer Engine's layers, with "
        "the distributed optimizer or Megatron-FSDP",
        "drop --fp8-param-gather, or train in FP8 (--fp8-format) on Transformer Engine's layers with "
        "--use-distributed-optimizer or Megatron-FSDP"),
    "precision_aware_needs_distopt": Rule(
        "the precision-aware optimizer (precision_aware_optimizer) runs with the distributed optimizer "
        "(Megatron's optimizer config asserts it)",
        "add --use-distributed-optimizer, or drop --use-precision-aware-optimizer"),
    "activation_offload": Rule(
        "activation offload (--cpu-offloading-num-layers) runs on Transformer Engine's layers with PP 1, no "
        "recompute and no per-layer CUDA graphs, for fewer layers than the model has (Megatron's "
        "TransformerConfig refuses the rest)",
        "drop --cpu-offloading-num-layers, or run it with PP 1, no --recompute-granularity and no per-layer "
        "--cuda-graph-impl, offloading fewer layers than --num-layers",
        "set megatron_options.activation_offload_layers to 0, or plan it with pp 1, no recompute and "
        "cuda_graph_impl none, for fewer layers than the model has"),
    "fsdp_needs_te": Rule(
        "Megatron-FSDP runs with Transformer Engine's layers (its adapter asserts Transformer Engine 2.10 or "
        "newer)",
        "use Transformer Engine 2.10 or newer (--transformer-impl transformer_engine), or drop "
        "--use-megatron-fsdp"),
    "cpu_loop_vp": Rule(
        "the CPU loop runs plain pipeline stages, not virtual ones",
        "set vp 1, or train on GPUs"),
    "cpu_loop_ep": Rule(
        "the CPU loop keeps every expert whole on each rank (no expert parallelism)",
        "set ep and etp 1, or train on GPUs"),
    "cpu_loop_pipeline_split": Rule(
        "the CPU loop splits the layers evenly over the pipeline stages",
        "pipeline_split even, or train on GPUs"),
    "cpu_loop_pp_tied": Rule(
        "the CPU loop's pipeline needs untied embedding and output weights",
        "PP 1 for a model that ties them, or train on GPUs"),
    "cpu_loop_sequence_parallel": Rule(
        "the CPU loop runs without sequence parallelism (Megatron's reduce-scatter allocates on a CUDA "
        "device)",
        "set sequence_parallel false, or train on GPUs"),
    "cpu_loop_moe_tp": Rule(
        "an MoE model with TP > 1 needs sequence parallelism, which the CPU loop cannot run",
        "TP 1 for an MoE model on CPU, or train on GPUs"),
    "cpu_loop_recompute": Rule(
        "the CPU loop recomputes no activations",
        "set recompute none, or train on GPUs"),
    "cpu_loop_distributed_optimizer": Rule(
        "the CPU loop keeps the whole optimizer state on every data-parallel rank",
        "set distributed_optimizer false, or train on GPUs"),
}


# The rule book, by what each rule looks at, so that the planner can prune its search with
# the same rules before a layout is whole (a TP, then a CP, then the experts).
def tp_rules(lay: Layout, model: ModelConfig, gpu: GPUSpec) -> Iterator[str]:
    if model.num_attention_heads % lay.tp:
        yield "tp_heads"
    if not model.multi_latent_attention and model.query_groups % lay.tp:
        yield "tp_query_groups"
    if lay.tp > gpu.nvlink_domain:
        yield "tp_within_nvlink"


def expert_rules(lay: Layout, model: ModelConfig) -> Iterator[str]:
    if (lay.ep > 1 or lay.etp > 1) and not model.is_moe:
        yield "ep_without_moe"
    if model.is_moe and model.num_experts % lay.ep:
        yield "ep_experts"
    if (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.etp):
        yield "expert_folding"


def sequence_parallel_rules(lay: Layout, model: ModelConfig, te: bool) -> Iterator[str]:
    if lay.sequence_parallel and lay.tp == 1:
        yield "sp_needs_tp"
    if model.is_moe and lay.tp > 1 and not lay.sequence_parallel:
        yield "moe_needs_sp"
    if model.qk_layernorm and lay.sequence_parallel and not te:
        yield "qk_norm_sp_needs_te"


def moe_rules(lay: Layout, model: ModelConfig, moe: MoEOptions, te: bool) -> Iterator[str]:
    """Megatron's checks of its MoE options (TransformerConfig.__post_init__) against the layout."""
    if not model.is_moe:
        return
    if moe.pad_to_capacity and moe.capacity_factor is None:
        yield "moe_pad_needs_capacity"
    if moe.dispatcher == "flex" and not te:
        yield "moe_flex_needs_te"
    if moe.overlap_ep_comm:
        if lay.ep == 1:
            yield "moe_overlap_needs_ep"
        if moe.dispatcher not in ("alltoall", "flex"):
            yield "moe_overlap_dispatcher"
        if lay.pp > 1 and lay.vp == 1:
            yield "moe_overlap_needs_vp"
        if lay.recompute == "full" or (lay.recompute == "selective" and "moe" in moe.recompute):
            yield "moe_overlap_recompute"


def options_rules(lay: Layout, megatron: MegatronOptions, te: bool, num_layers: int | None = None) -> Iterator[str]:
    """Megatron's checks of its memory and communication options against the layout."""
    offload = megatron.activation_offload_layers
    if offload and (not te or lay.pp > 1 or lay.recompute != "none"
                    or megatron.cuda_graph_impl not in ("none", "full_iteration")
                    or (num_layers is not None and offload >= num_layers)):
        yield "activation_offload"
    if megatron.fp8_param_gather and not (te and lay.precision == "fp8"
                                          and (lay.distributed_optimizer or megatron.fsdp)):
        yield "fp8_param_gather_needs_te_fp8"
    if megatron.fsdp and not te:
        yield "fsdp_needs_te"
    if megatron.precision_aware_optimizer and not (lay.distributed_optimizer or megatron.fsdp):
        yield "precision_aware_needs_distopt"


def pipeline_rules(lay: Layout, model: ModelConfig) -> Iterator[str]:
    pp_broken = None
    if lay.pipeline_split == "layout":
        if pipeline_layout_problem(lay, model):
            pp_broken = "pp_layout"
    elif lay.pipeline_split == "uneven":
        counts = lay.rank_layer_counts(model.num_layers)
        if counts is None or min(counts) < 1:
            pp_broken = "pp_uneven"
    elif (model.num_layers + (2 if lay.pipeline_split == "embedding_loss" else 0)) % lay.pp:
        pp_broken = "pp_layers"
    if pp_broken:
        yield pp_broken
    if lay.vp > 1:   # the virtual stages split what the pipeline split gives each rank
        if lay.pp == 1:
            yield "vp_needs_pp"
        elif not pp_broken and lay.chunk_sizes(model.num_layers) is None:
            yield "vp_layers"
        if lay.pp > 1 and lay.num_microbatches % lay.pp:
            yield "vp_microbatches"


def context_parallel_rules(lay: Layout, te: bool) -> Iterator[str]:
    if lay.seq_length % (2 * lay.cp) and lay.cp > 1:
        yield "cp_sequence"
    if lay.cp > 1 and not te:
        yield "cp_needs_te"


def cpu_loop_rules(lay: Layout, model: ModelConfig) -> Iterator[str]:
    """What of the layout the skill's CPU loop cannot run (runtime/cpu_loop.py: TP, an even split
    into plain pipeline stages of a model with untied output weights, DP; full precision)."""
    if lay.vp > 1:
        yield "cpu_loop_vp"
    if lay.ep > 1 or lay.etp > 1:
        yield "cpu_loop_ep"
    if lay.pipeline_split != "even":
        yield "cpu_loop_pipeline_split"
    if lay.pp > 1 and not model.untie_embeddings_and_output_weights:
        yield "cpu_loop_pp_tied"
    if lay.sequence_parallel:
        yield "cpu_loop_sequence_parallel"
    elif model.is_moe and lay.tp > 1:
        yield "cpu_loop_moe_tp"
    if lay.recompute != "none":
        yield "cpu_loop_recompute"
    if lay.distributed_optimizer and lay.dp > 1:
        yield "cpu_loop_distributed_optimizer"


def precision_rules(lay: Layout, gpu: GPUSpec) -> Iterator[str]:
    if lay.precision == "fp8" and not gpu.supports_fp8:
        yield "fp8_arch"


def broken_rules(lay: Layout, model: ModelConfig, gpu: GPUSpec, n_gpus: int, te: bool = True,
                 moe: MoEOptions | None = None, megatron: MegatronOptions | None = None,
                 cpu_loop: bool = False) -> Iterator[str]:
    """The names of the rules the layout breaks, in the order they are checked; te: whether the
    job's layers are Transformer Engine's, moe: how its MoE layers run, cpu_loop: whether the job
    is the skill's CPU loop, whose own limits come first (plan, render, validate and train ask the
    same question here)."""
    if lay.world_size != n_gpus:
        yield "world_size"
    if cpu_loop:
        yield from cpu_loop_rules(lay, model)
    yield from tp_rules(lay, model, gpu)
    yield from expert_rules(lay, model)
    sp = list(sequence_parallel_rules(lay, model, te))
    yield from (r for r in sp if r != "qk_norm_sp_needs_te")
    yield from pipeline_rules(lay, model)
    yield from context_parallel_rules(lay, te)
    yield from (r for r in sp if r == "qk_norm_sp_needs_te")
    if lay.gbs % (lay.mbs * lay.dp):
        yield "gbs_divisible"
    yield from precision_rules(lay, gpu)
    if lay.recompute == "full":
        per_chunk = min(lay.chunk_sizes(model.num_layers) or [1])
        if not 1 <= lay.recompute_layers <= max(per_chunk, 1):
            yield "recompute_layers"
    if model.position_embedding_type == "learned_absolute" and lay.seq_length > model.max_position_embeddings:
        yield "seq_positions"
    yield from moe_rules(lay, model, moe or MoEOptions(), te)
    yield from options_rules(lay, megatron or MegatronOptions(), te, model.num_layers)


def check_layout(lay: Layout, model: ModelConfig, gpu: GPUSpec, n_gpus: int, te: bool = True,
                 moe: MoEOptions | None = None, megatron: MegatronOptions | None = None,
                 cpu_loop: bool = False) -> str | None:
    """The name of the first rule the layout breaks, or None."""
    return next(broken_rules(lay, model, gpu, n_gpus, te, moe, megatron, cpu_loop), None)
