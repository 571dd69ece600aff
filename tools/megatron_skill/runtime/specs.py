"""The layer spec the skill trains with: Megatron-Core's own, with one swappable part.

With Transformer Engine: Megatron's TE spec, untouched.  Without it: Megatron's local spec
with two parts swapped (configuration as data: ModuleSpec): core attention for
SDPAttention, and the torch norms for SequenceParallelNorm so that TP can use sequence
parallelism.  Everything else (MoE, MLA, MTP, linear layers) stays Megatron's.
"""
from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from ..core.options import RuntimeOptions
from .attention import SDPAttention
from .norm import SequenceParallelNorm


def local_sdpa_spec(opts: RuntimeOptions, num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                    multi_latent_attention=False, normalization="RMSNorm") -> ModuleSpec:
    spec = get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention,
                                    normalization=normalization)
    return _swap_parts(spec, opts)


def _swap_parts(spec: ModuleSpec, opts: RuntimeOptions) -> ModuleSpec:
    """The runtime options reach the layers here, as the parts' parameters."""
    sub = spec.submodules
    sub.self_attention.submodules.core_attention = ModuleSpec(
        module=SDPAttention, params={"native_gqa": opts.native_gqa, "backend": opts.sdpa_backend})
    if opts.fp8_linear:
        _fp8_linears(sub)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, name, None) is WrappedTorchNorm:
            setattr(sub, name, SequenceParallelNorm)
    return spec


def _fp8_linears(sub) -> None:
    """The dense linear layers of attention and MLP, FP8 (runtime/fp8_linear.py); MoE experts
    and anything not Megatron's plain column / row parallel linear stay as they are."""
    import dataclasses
    import functools

    from .fp8_linear import FP8ColumnParallelLinear, FP8RowParallelLinear

    swap = {ColumnParallelLinear: FP8ColumnParallelLinear, RowParallelLinear: FP8RowParallelLinear}

    def swapped(holder, names):
        return {n: swap[getattr(holder, n)] for n in names if getattr(holder, n, None) in swap}

    attn = sub.self_attention.submodules
    for name, cls in swapped(attn, ("linear_qkv", "linear_proj")).items():
        setattr(attn, name, cls)
    mlp = getattr(sub, "mlp", None)
    if isinstance(mlp, functools.partial) and "submodules" in mlp.keywords:
        # Megatron 0.19's MLP spec is a partial over shared submodules: build new ones.
        mods = mlp.keywords["submodules"]
        new = dataclasses.replace(mods, **swapped(mods, ("linear_fc1", "linear_fc2")))
        sub.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": new})
    elif isinstance(mlp, ModuleSpec) and mlp.submodules is not None:
        for name, cls in swapped(mlp.submodules, ("linear_fc1", "linear_fc2")).items():
            setattr(mlp.submodules, name, cls)


def block_spec(transformer_config, opts: RuntimeOptions, vp_stage=None, pp_rank=None):
    """Megatron's decoder block spec (dense and MoE layers as --moe-layer-freq says), local
    layers with the swapped parts, and the same norm for the final layer norm."""
    block = get_gpt_decoder_block_spec(transformer_config, use_transformer_engine=False,
                                       normalization=transformer_config.normalization, vp_stage=vp_stage,
                                       pp_rank=pp_rank)
    block.layer_specs = [_swap_parts(s, opts) for s in block.layer_specs]
    if block.layer_norm is WrappedTorchNorm:
        block.layer_norm = SequenceParallelNorm
    return block


def layer_spec_for(opts: RuntimeOptions):
    """A transformer_layer_spec callable for megatron.training.models.gpt.GPTModelConfig."""
    def spec(config, vp_stage=None):
        return block_spec(config.transformer, opts, vp_stage=vp_stage)
    return spec
