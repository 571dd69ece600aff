"""Megatron command-line arguments for a model, a layout and the training settings.

The one place that turns this skill's data into ``pretrain_gpt.py`` flags; plan shows
them, render writes them into launch scripts, and the tests parse every vector with
Megatron's own parser (megatron.training.arguments).
"""
from __future__ import annotations

import re
from typing import Any

from ..core.catalog import GPUSpec
from ..core.layout import Layout
from ..core.megatron_options import MegatronOptions
from ..core.model import ModelConfig
from ..core.moe import MoEOptions
from ..core.options import RuntimeOptions

# Needed when neither Transformer Engine nor apex is installed: each of these fused paths
# otherwise imports one of them and fails at start-up (seen with megatron-core 0.19.2).
NO_TE_FLAGS = ["--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
               "--no-persist-layer-norm", "--no-rope-fusion"]


def no_te_flags_needed(skill_entry: bool) -> list[str]:
    """The NO_TE_FLAGS a local-path launch cannot do without: all of them for Megatron-LM's
    entry; the skill's entry stands in for apex's gradient-accumulation kernel."""
    return [f for f in NO_TE_FLAGS if not (skill_entry and f == "--no-gradient-accumulation-fusion")]


TE_FP8_FLAGS = ("--fp8-format", "--fp8-recipe")


def te_only_args(lay: Layout, gpu: GPUSpec, fake_rank: bool, model: ModelConfig | None = None,
                 moe: MoEOptions | None = None, megatron: MegatronOptions | None = None) -> list[str]:
    """Flags for Transformer Engine's layers only: tensor-parallel communication overlapped with
    the GEMMs (TE's userbuffers: Megatron asserts sequence parallelism; the buffers are shared
    through NVLink, so every TP rank must sit in one NVLink domain; references/parallelism-guide.md,
    "TP communication overlap", says where it comes from; unless megatron_options turn it off),
    TE's fused token permutation of an MoE model (Megatron refuses --moe-permute-fusion without
    TE's kernels) and the CUDA graphs the options ask for."""
    megatron = megatron or MegatronOptions()
    a = []
    if megatron.tp_overlap_runs(lay.tp, lay.sequence_parallel, gpu.nvlink_domain) and not fake_rank:
        a.append("--tp-comm-overlap")
    if model is not None and model.is_moe and (moe or MoEOptions()).permute_fusion:
        a.append("--moe-permute-fusion")
    return a + megatron.te_flags()


def split_te_fp8(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without Transformer Engine's FP8 flags, those flags with their values): a script
    passes them only when TE imports; without it FP8 is the skill entry's own linear layers."""
    rest, fp8 = [], []
    i = 0
    while i < len(argv):
        if argv[i] in TE_FP8_FLAGS:
            fp8 += argv[i:i + 2]
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    return rest, fp8


def local_impl_flags(opts: RuntimeOptions | None = None, skill_entry: bool = True) -> list[str]:
    """What the local (no-TE) path adds to the argument vector: Megatron's TE/apex fusions off,
    and (for the skill's entry script; a Megatron-LM checkout's does not know them) its own on.

    The skill's SDPA attention runs the causal kernel (is_causal: masked blocks skipped) only
    when no explicit mask arrives; Megatron's dataloader otherwise builds a [s, s] causal mask
    per sample and SDPA then computes the full square under it (references/benchmarks.md)."""
    if not skill_entry:
        return list(NO_TE_FLAGS)
    opts = opts or RuntimeOptions.from_request(None, te=False)
    # The entry script stands in for apex's gradient-accumulation kernel (runtime/wgrad_accum.py),
    # so Megatron's fusion can stay on.
    flags = no_te_flags_needed(True) if opts.fused_wgrad_accumulation else NO_TE_FLAGS
    return flags + ["--no-create-attention-mask-in-dataloader"] + opts.entry_flags()


def model_args(m: ModelConfig, seq_length: int | None = None, moe: MoEOptions | None = None) -> list[str]:
    """The model's flags; for an MoE model also how its MoE layers run (moe: the skill's defaults
    when None) but for TE's fused permutation, which te_only_args adds."""
    # Megatron requires --max-position-embeddings >= --seq-length even with RoPE, which has no
    # position table: raise it for a longer sequence (learned positions are a hard limit instead).
    positions = m.max_position_embeddings
    if m.position_embedding_type == "rope" and seq_length:
        positions = max(positions, seq_length)
    a = ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size,
         "--ffn-hidden-size", m.ffn_hidden_size, "--num-attention-heads", m.num_attention_heads,
         "--max-position-embeddings", positions,
         "--normalization", m.normalization, "--position-embedding-type", m.position_embedding_type]
    if m.norm_epsilon != 1e-5:  # Megatron's default
        a += ["--norm-epsilon", m.norm_epsilon]
    if m.kv_channels and not m.multi_latent_attention:
        a += ["--kv-channels", m.kv_channels]
    if m.num_query_groups and m.num_query_groups != m.num_attention_heads and not m.multi_latent_attention:
        a += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.position_embedding_type == "rope":
        a += ["--rotary-base", m.rotary_base]
        if m.rope_scaling_factor:
            a += ["--use-rope-scaling", "--rope-scaling-factor", m.rope_scaling_factor]
    if m.activation == "swiglu":
        a += ["--swiglu"]
    elif m.activation == "squared_relu":
        a += ["--squared-relu"]
    if not m.add_bias_linear:
        a += ["--disable-bias-linear"]
    if m.add_qkv_bias and not m.add_bias_linear:
        a += ["--add-qkv-bias"]
    if m.qk_layernorm:
        a += ["--qk-layernorm"]
    if m.untie_embeddings_and_output_weights:
        a += ["--untie-embeddings-and-output-weights"]
    if m.multi_latent_attention:
        a += ["--multi-latent-attention", "--kv-lora-rank", m.kv_lora_rank,
              "--qk-head-dim", m.qk_head_dim, "--qk-pos-emb-head-dim", m.qk_pos_emb_head_dim,
              "--v-head-dim", m.v_head_dim]
        if m.q_lora_rank:
            a += ["--q-lora-rank", m.q_lora_rank]
    if m.is_moe:
        a += ["--num-experts", m.num_experts, "--moe-router-topk", m.moe_router_topk,
              "--moe-ffn-hidden-size", m.expert_ffn, *(moe or MoEOptions()).flags()]
        if m.moe_router_enable_expert_bias:
            # the bias balances the load; DeepSeek-V3 keeps a sequence-wise loss at 1e-4 beside it
            # (its report, section 2.1.2)
            a += ["--moe-router-enable-expert-bias", "--moe-router-load-balancing-type", "seq_aux_loss",
                  "--moe-aux-loss-coeff", "1e-4"]
        else:
            a += ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3"]
        if m.moe_router_score_function != "softmax":
            a += ["--moe-router-score-function", m.moe_router_score_function]
        if m.moe_router_num_groups:
            a += ["--moe-router-num-groups", m.moe_router_num_groups, "--moe-router-group-topk", m.moe_router_group_topk]
        if m.moe_router_topk_scaling_factor:
            a += ["--moe-router-topk-scaling-factor", m.moe_router_topk_scaling_factor]
        if m.moe_router_pre_softmax:
            a += ["--moe-router-pre-softmax"]
        if m.moe_shared_expert_intermediate_size:
            a += ["--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size]
        if m.moe_layer_freq != 1:
            freq = m.moe_layer_freq
            if isinstance(freq, (list, tuple)):   # a model keeps its pattern as a tuple (hashable)
                freq = "[" + ",".join(str(int(x)) for x in freq) + "]"
            a += ["--moe-layer-freq", str(freq)]
    if m.mtp_num_layers:
        a += ["--mtp-num-layers", m.mtp_num_layers]
    return [str(x) for x in a]


def fp8_recipe(gpu: GPUSpec | None) -> str:
    """Megatron's --fp8-recipe for a GPU: Blackwell's tensor cores scale FP8 per block of 32
    values in hardware (MXFP8), so that recipe costs nothing extra there; on Hopper and Ada
    per-tensor current scaling ("tensorwise") needs no amax history, unlike "delayed"
    (references/runtime.md, "FP8")."""
    return "mxfp8" if gpu is not None and gpu.arch == "blackwell" else "tensorwise"


def layout_args(lay: Layout, model: ModelConfig, gpu: GPUSpec | None = None, moe: MoEOptions | None = None) -> list[str]:
    a: list[Any] = ["--tensor-model-parallel-size", lay.tp, "--pipeline-model-parallel-size", lay.pp,
                    "--context-parallel-size", lay.cp,
                    "--micro-batch-size", lay.mbs, "--global-batch-size", lay.gbs,
                    "--seq-length", lay.seq_length]
    if lay.pipeline_split == "layout":   # the layout string sets the virtual stages itself
        a += ["--pipeline-model-parallel-layout", lay.pipeline_layout]
    elif lay.vp > 1:
        a += ["--num-virtual-stages-per-pipeline-rank", lay.vp]
    if lay.pipeline_split == "embedding_loss":
        a += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    elif lay.pipeline_split == "uneven":
        a += ["--decoder-first-pipeline-num-layers", lay.first_stage_layers,
              "--decoder-last-pipeline-num-layers", lay.last_stage_layers]
    if model.is_moe:
        a += ["--expert-model-parallel-size", lay.ep, "--expert-tensor-parallel-size", lay.etp]
    if lay.sequence_parallel:
        a += ["--sequence-parallel"]
    if lay.distributed_optimizer:
        a += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    elif lay.dp * lay.cp > 1:
        a += ["--overlap-grad-reduce"]
    if lay.recompute == "selective":
        mods = ["core_attn", "layernorm"] + (list((moe or MoEOptions()).recompute) if model.is_moe else [])
        a += ["--recompute-granularity", "selective", "--recompute-modules", *mods]
    elif lay.recompute == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "block",
              "--recompute-num-layers", lay.recompute_layers]
    a += ["--bf16"]
    if lay.precision == "fp8":
        a += ["--fp8-format", "hybrid", "--fp8-recipe", fp8_recipe(gpu)]
    return [str(x) for x in a]


def job_variable(name: str) -> str:
    """An argument a launch script takes from the job's environment: a mark that render writes
    as "$NAME" (shlex.quote leaves it bare, so it survives quoting)."""
    return f"@{name}@"


JOB_VARIABLE = re.compile(r"@([A-Z_]+)@")


def training_args(settings: dict[str, Any]) -> list[str]:
    """Optimizer, schedule, data, logging and checkpointing flags from render/train settings."""
    s = settings
    warmup = s.get("lr_warmup_iters")
    if warmup is None:
        warmup = min(100, s["train_iters"] // 10)
    a: list[Any] = [
        "--train-iters", s["train_iters"], "--lr", s["lr"], "--min-lr", s["min_lr"],
        "--lr-decay-style", "cosine", "--lr-warmup-iters", warmup,
        "--weight-decay", s["weight_decay"], "--clip-grad", 1.0,
        "--adam-beta1", 0.9, "--adam-beta2", 0.95, "--init-method-std", s["init_method_std"],
        "--attention-dropout", 0.0, "--hidden-dropout", 0.0,
        "--log-interval", s["log_interval"], "--log-throughput", "--log-timers-to-tensorboard",
        "--eval-iters", s["eval_iters"], "--eval-interval", s["eval_interval"],
        "--seed", s["seed"],
    ]
    if s.get("data_path"):
        a += ["--data-path", *s["data_path"], "--split", s.get("split", "99,1,0")]
        if s.get("tokenizer_model"):
            a += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", s["tokenizer_model"]]
        else:
            a += ["--tokenizer-type", "NullTokenizer", "--vocab-size", s["vocab_size"]]
    elif s.get("mock_data"):
        a += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", s["vocab_size"]]
    else:  # the job's environment says where the data is (a launch script's DATA_PATH, TOKENIZER_MODEL)
        a += ["--data-path", job_variable("DATA_PATH"), "--split", s.get("split", "99,1,0"),
              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", job_variable("TOKENIZER_MODEL")]
    if s.get("save") and s.get("checkpoint", True):
        a += ["--save", s["save"], "--load", s["save"], "--save-interval", s["save_interval"]]
        if s.get("ckpt_format", "torch_dist"):   # None: the memory options say it (Megatron-FSDP's own)
            a += ["--ckpt-format", s.get("ckpt_format", "torch_dist")]
        if s.get("override_scheduler"):
            a += ["--override-opt-param-scheduler"]
    if s.get("pretrained"):
        a += ["--pretrained-checkpoint", s["pretrained"]]
        if s.get("vocab_divisor"):  # the checkpoint's embedding rows at this TP
            a += ["--make-vocab-size-divisible-by", s["vocab_divisor"]]
    if s.get("log_memory_interval"):
        a += ["--log-memory-interval", s["log_memory_interval"]]
    if s.get("tensorboard_dir"):
        a += ["--tensorboard-dir", s["tensorboard_dir"]]
    return [str(x) for x in a]
