"""Megatron's own options beyond the layout that change memory and communication, as NVIDIA's
recipes set them: gradients reduced in bf16, FP8 weights gathered, Megatron-FSDP sharding
weights and gradients too, and the fused cross-entropy. One value.

Its defaults are the request schema's (schemas/common.json, `megatron_options`), which are
Megatron's own (all off). The planner costs them (core/memory.py, core/timing.py), render writes
them as Megatron's flags, validate reads them back from a script (adapter/described.py), and the
rule book (core/layout.py, options_rules) holds their rules.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .defaults import schema_defaults


@dataclasses.dataclass(frozen=True)
class MegatronOptions:
    grad_reduce_in_bf16: bool = False    # --grad-reduce-in-bf16: main gradients reduced (and kept) in bf16
    fp8_param_gather: bool = False       # --fp8-param-gather: TE's FP8 weights, gathered in FP8
    fsdp: bool = False                   # --use-megatron-fsdp, optim_grads_params: weights and gradients sharded
    cross_entropy_fusion: bool = False   # --cross-entropy-loss-fusion: no fp32 copy of the logits

    @classmethod
    def from_request(cls, options: dict[str, Any] | None) -> "MegatronOptions":
        return cls(**{**schema_defaults("megatron_options"), **(options or {})})

    @classmethod
    def from_args(cls, ns: Any) -> "MegatronOptions":
        """The options a parsed Megatron argument namespace sets (validate's read-back)."""
        use_fsdp = bool(getattr(ns, "use_megatron_fsdp", False))
        fsdp = use_fsdp and (getattr(ns, "data_parallel_sharding_strategy", None) or "optim_grads_params") \
            == "optim_grads_params"
        # Megatron-FSDP keeps its main gradients in the dtype it is told (bf16: as --grad-reduce-in-bf16)
        bf16_grads = bool(getattr(ns, "grad_reduce_in_bf16", False)) or (
            use_fsdp and getattr(ns, "megatron_fsdp_main_grads_dtype", None) in ("bf16", "bfloat16"))
        return cls(grad_reduce_in_bf16=bf16_grads,
                   fp8_param_gather=bool(getattr(ns, "fp8_param_gather", False)), fsdp=fsdp,
                   cross_entropy_fusion=bool(getattr(ns, "cross_entropy_loss_fusion", False)))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flags(self) -> list[str]:
        """Megatron's flags for these options (the distributed optimizer comes with the layout;
        Megatron-FSDP turns it on itself)."""
        a = []
        if self.grad_reduce_in_bf16:
            a.append("--grad-reduce-in-bf16")
        if self.fp8_param_gather:
            a.append("--fp8-param-gather")
        if self.fsdp:   # Megatron-FSDP saves only in its own checkpoint format (validate_args)
            a += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                  "--ckpt-format", "fsdp_dtensor"]
        if self.cross_entropy_fusion:
            a.append("--cross-entropy-loss-fusion")
        return a
