"""What the skill's runtime does beyond the layout, as one value: the entry script's fused paths
for Megatron-Core's local layers, and whether Transformer Engine's layers run instead.

Its defaults are the request schema's (schemas/common.json, `runtime`): one source. The planner,
render, bench and the runtime read the same value; every decision about which path runs is a
method here.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .attention_kernels import PLANNED, AttentionKernel
from .defaults import schema_defaults
from .layout import Layout
from .megatron_options import MegatronOptions
from .memory import BF16, FP32, MemoryOptions
from .moe import MoEOptions


def fp8_local_note(lay: Layout) -> str:
    """Which layers stay BF16 when FP8 goes through the skill's own linear layers (no Transformer
    Engine): RuntimeOptions.fp8_local says where they take it."""
    if lay.tp > 1:
        return (f"at TP {lay.tp} every linear layer stays BF16: the skill's FP8 layers are TP 1 only; the "
                "output layer and embeddings stay BF16")
    return "attention and MLP linear layers in FP8; the output layer and embeddings stay BF16"


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    linear_cross_entropy: bool      # the fused output layer + cross-entropy (runtime/fused_head.py)
    compiled_rope: bool             # Megatron's unfused RoPE compiled
    native_gqa: bool                # SDPA reads the shared key/value heads itself
    sdpa_backend: str               # auto | cudnn | flash | efficient | math
    fused_wgrad_accumulation: bool  # weight gradients added into main_grad by their GEMM
    fp8_linear: bool                # the skill's FP8 linear layers (no TE)
    fused_adam: bool = True         # torch's fused AdamW where Megatron falls back to torch's optimizer
    fp8_scaling: str = "current"    # current | delayed: how the skill's FP8 layers scale (runtime/fp8_delayed.py)
    te: bool = True                 # Transformer Engine's layers run (then none of the above does)
    moe: MoEOptions = MoEOptions()  # how the MoE layers run (Megatron's MoE flags; core/moe.py)
    megatron: MegatronOptions = MegatronOptions()   # Megatron's memory and communication options
    # the core-attention kernel where a stock script's arguments ask for a slower one than planned
    attention_kernel: AttentionKernel = PLANNED
    # TE's FP8 under Megatron's delayed recipe (a script's --fp8-recipe, Megatron's default): render
    # writes tensorwise or mxfp8 (adapter/arguments.py fp8_recipe), validate reads what a script says
    te_fp8_delayed: bool = False

    @classmethod
    def from_request(cls, runtime: dict[str, Any] | None, te: bool = True, moe: dict[str, Any] | None = None,
                     megatron: dict[str, Any] | None = None) -> "RuntimeOptions":
        return cls(**{**schema_defaults("runtime"), **(runtime or {})}, te=te, moe=MoEOptions.from_request(moe),
                   megatron=MegatronOptions.from_request(megatron))

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("te", "moe", "megatron", "attention_kernel", "te_fp8_delayed")}

    @property
    def fused_head(self) -> bool:
        """The output layer and loss go through the skill's fused head: local layers only."""
        return not self.te and self.linear_cross_entropy

    def fp8_local(self, lay: Layout) -> bool:
        """The linear layers go through the skill's own FP8 path: the local layers with fp8_linear
        on, or asked to train in FP8 without TE; at TP 1, where its layers take it (with
        tensor-parallel communication inside they are Megatron's BF16 ones)."""
        return not self.te and (self.fp8_linear or lay.precision == "fp8") and lay.tp == 1

    @property
    def fused_wgrad(self) -> bool:
        """Weight gradients accumulate into main_grad inside their GEMM: TE's layers do; the
        local layers do with fused_wgrad_accumulation."""
        return self.te or self.fused_wgrad_accumulation

    def memory(self, lay: Layout) -> MemoryOptions:
        return MemoryOptions(fused_head=self.fused_head, fp8_linear=self.fp8_local(lay), te_fp8=self.te,
                             fp8_proj_copy=not self.te or self.te_fp8_delayed,
                             recompute_modules=self.moe.selective_modules(),
                             moe_routed_factor=self.moe.routed_factor(),
                             router_score_bytes=self.moe.router_score_bytes(),
                             adam_temp_bytes=(0 if self.te or self.fused_adam else FP32)
                             + self.megatron.adam_step_bytes(self.te), local_clip=not self.te,
                             grad_bytes=BF16 if self.megatron.bf16_grads else FP32,
                             fp8_params=self.megatron.fp8_param_gather and self.te and lay.precision == "fp8",
                             fsdp_params=self.megatron.fsdp,
                             optimizer_bytes=self.megatron.optimizer_state_bytes(lay.precision, self.te),
                             fused_cross_entropy=self.megatron.cross_entropy_fusion and not self.fused_head,
                             te_attention=self.te, tp_comm_overlap=self.te and self.megatron.tp_comm_overlap,
                             offloaded_layers=self.megatron.activation_offload_layers if self.te else 0)

    def entry_flags(self) -> list[str]:
        """The skill entry script's own flags for these paths (adapter/skill_flags.py)."""
        a = []
        if self.linear_cross_entropy:
            a.append("--skill-linear-cross-entropy")
        if self.fp8_linear:
            a.append("--skill-fp8-linear")
        if self.fp8_scaling != "current":
            a += ["--skill-fp8-scaling", self.fp8_scaling]
        if self.fused_adam:
            a.append("--skill-fused-adam")
        if self.compiled_rope:
            a.append("--skill-compiled-rope")
        if self.native_gqa:
            a.append("--skill-native-gqa")
        if self.sdpa_backend != "auto":
            a += ["--skill-sdpa-backend", self.sdpa_backend]
        return a
