"""The layer spec the skill trains with: Megatron-Core's own, with one swappable part.

With Transformer Engine: Megatron's TE spec, untouched.  Without it: Megatron's local spec
with core attention swapped for SDPAttention (configuration as data: ModuleSpec), so
everything else (MoE, MLA, MTP, norms, linear layers) stays Megatron's.
"""
from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import SDPAttention


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
        return True
    except Exception:
        return False


def local_sdpa_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                    multi_latent_attention=False, normalization="RMSNorm") -> ModuleSpec:
    spec = get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention,
                                    normalization=normalization)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def layer_spec_for(config, vp_stage=None) -> ModuleSpec:
    """A transformer_layer_spec callable for megatron.training.models.gpt.GPTModelConfig."""
    t = config.transformer
    return local_sdpa_spec(t.num_moe_experts, t.moe_grouped_gemm, t.qk_layernorm, t.multi_latent_attention,
                           normalization=t.normalization)
