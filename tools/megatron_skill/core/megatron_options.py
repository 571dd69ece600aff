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

from ..errors import ToolError
from .defaults import schema_defaults


@dataclasses.dataclass(frozen=True)
class MegatronOptions:
    grad_reduce_in_bf16: bool = False    # --grad-reduce-in-bf16: main gradients reduced (and kept) in bf16
    fp8_param_gather: bool = False       # --fp8-param-gather: TE's FP8 weights, gathered in FP8
    fsdp: bool = False                   # --use-megatron-fsdp, optim_grads_params: weights and gradients sharded
    cross_entropy_fusion: bool = False   # --cross-entropy-loss-fusion: no fp32 copy of the logits
    fsdp_grads_fp32: bool = False        # --megatron-fsdp-main-grads-dtype fp32 (read from scripts only)

    @classmethod
    def from_request(cls, options: dict[str, Any] | None) -> "MegatronOptions":
        return cls(**{**schema_defaults("megatron_options"), **(options or {})})

    @classmethod
    def from_args(cls, ns: Any) -> "MegatronOptions":
        """The options a parsed Megatron argument namespace sets (validate's read-back)."""
        use_fsdp = bool(getattr(ns, "use_megatron_fsdp", False))
        fsdp = use_fsdp and (getattr(ns, "data_parallel_sharding_strategy", None) or "optim_grads_params") \
            == "optim_grads_params"
        # Megatron-FSDP keeps its main gradients in the dtype it is told, by default ('auto') the
        # parameters' (bf16); validate_args turns the name into a torch dtype
        fsdp_grads = str(getattr(ns, "megatron_fsdp_main_grads_dtype", None) or "auto").removeprefix("torch.")
        return cls(grad_reduce_in_bf16=bool(getattr(ns, "grad_reduce_in_bf16", False)),
                   fsdp_grads_fp32=fsdp and fsdp_grads in ("fp32", "float32"),
                   fp8_param_gather=bool(getattr(ns, "fp8_param_gather", False)), fsdp=fsdp,
                   cross_entropy_fusion=bool(getattr(ns, "cross_entropy_loss_fusion", False)))

    @property
    def bf16_grads(self) -> bool:
        """Main gradients kept and reduced in bf16: asked for, or Megatron-FSDP's default (the
        parameters' dtype; grad_reduce_in_bf16 does not change it)."""
        return self.grad_reduce_in_bf16 or (self.fsdp and not self.fsdp_grads_fp32)

    def check_request(self, precision: str, te: bool) -> None:
        """A bad_request where the request itself asks what no layout can run (every layout would
        break the same rule: the request's error, not the layouts'); precision: the request's
        (bf16, fp8 or any)."""
        if self.fp8_param_gather and (precision not in ("fp8", "any") or not te):
            raise ToolError("bad_request", "gathering FP8 weights needs precision fp8 on Transformer Engine's layers",
                            where="/megatron_options/fp8_param_gather",
                            fix="set precision to fp8 with Transformer Engine, or drop fp8_param_gather")
        if self.fsdp and not te:
            raise ToolError("bad_request", "Megatron-FSDP runs with Transformer Engine's layers (its adapter asserts "
                            "Transformer Engine 2.10 or newer)", where="/megatron_options/fsdp",
                            fix="plan for Transformer Engine, or drop fsdp")

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "fsdp_grads_fp32"}

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
                  "--ckpt-format", "fsdp_dtensor"] + (["--megatron-fsdp-main-grads-dtype", "fp32"]
                                                      if self.fsdp_grads_fp32 else [])
        if self.cross_entropy_fusion:
            a.append("--cross-entropy-loss-fusion")
        return a
