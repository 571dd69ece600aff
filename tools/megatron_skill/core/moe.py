"""How a mixture-of-experts layer runs in Megatron-Core, beyond the layout: the token dispatcher,
grouped GEMMs, dropless or capacity-bound routing, the router's precision and the overlap of the
expert-parallel all-to-all, as one value.

Its defaults are the request schema's (schemas/common.json, `moe`): one source. The planner costs
them (core/memory.py, core/timing.py), render writes them as Megatron's flags, validate reads them
back from a script (adapter/described.py), and the rule book (core/layout.py) holds their rules.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .defaults import schema_defaults


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    dispatcher: str = "alltoall"          # --moe-token-dispatcher-type
    flex_backend: str = "deepep"          # --moe-flex-dispatcher-backend, with the flex dispatcher
    grouped_gemm: bool = True             # --moe-grouped-gemm: the local experts' GEMMs as one group
    capacity_factor: float | None = None  # --moe-expert-capacity-factor; None: dropless
    pad_to_capacity: bool = False         # --moe-pad-expert-input-to-capacity
    router_dtype: str = "fp32"            # --moe-router-dtype: fp32 | fp64 | model (the model's bf16)
    permute_fusion: bool = True           # --moe-permute-fusion (Transformer Engine's kernels)
    overlap_ep_comm: bool = False         # --overlap-moe-expert-parallel-comm
    recompute: tuple[str, ...] = ("moe_act",)   # MoE parts in --recompute-modules under selective recompute

    @classmethod
    def from_request(cls, moe: dict[str, Any] | None) -> "MoEOptions":
        fields = {**schema_defaults("moe"), **(moe or {})}
        return cls(**{**fields, "recompute": tuple(fields["recompute"])})

    def selective_modules(self) -> frozenset[str]:
        """Megatron's --recompute-modules under selective recompute: attention's core and the
        norms, as for a dense model, and the MoE parts asked for."""
        return frozenset({"core_attn", "layernorm", *self.recompute})

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    @property
    def host_sync(self) -> bool:
        """A device-to-host copy of the routing counts every MoE layer's forward: dropless routing,
        or a capacity without padding, sizes the all-to-all from how many tokens each expert got
        (Megatron's token_dispatcher.py, the `cuda_sync_point`s). Padded to capacity, the sizes are
        static and the CPU keeps running ahead of the GPU."""
        return not (self.capacity_factor is not None and self.pad_to_capacity)

    def routed_factor(self) -> float:
        """Token copies an expert processes, over the top-k average under balanced routing: the
        capacity when padded to it, at most the capacity otherwise (balanced routing drops none
        at a factor of 1 or more)."""
        if self.capacity_factor is None:
            return 1.0
        return self.capacity_factor if self.pad_to_capacity else min(1.0, self.capacity_factor)

    def router_score_bytes(self) -> int:
        """Bytes per expert and token the router keeps for its backward: the softmax's fp32
        scores (counted on an H100, references/benchmarks.md "Fine-grained MoE memory"), fp64
        when the router runs in fp64."""
        return 8 if self.router_dtype == "fp64" else 4

    def flags(self) -> list[str]:
        """Megatron's flags for these options but the permute fusion, which only TE's layers take
        (adapter/arguments.py, te_only_args)."""
        a = ["--moe-token-dispatcher-type", self.dispatcher]
        if self.dispatcher == "flex":
            a += ["--moe-flex-dispatcher-backend", self.flex_backend]
        if self.grouped_gemm:
            a += ["--moe-grouped-gemm"]
        if self.capacity_factor is not None:
            a += ["--moe-expert-capacity-factor", f"{self.capacity_factor:g}"]
            if self.pad_to_capacity:
                a += ["--moe-pad-expert-input-to-capacity"]
        if self.router_dtype != "model":
            a += ["--moe-router-dtype", self.router_dtype]
        if self.overlap_ep_comm:
            a += ["--overlap-moe-expert-parallel-comm"]
        return a

    @classmethod
    def from_args(cls, ns: Any) -> "MoEOptions":
        """The options a parsed Megatron command line sets (Megatron's defaults where unset)."""
        cf = getattr(ns, "moe_expert_capacity_factor", None)
        modules = getattr(ns, "recompute_modules", None) or []
        return cls(dispatcher=getattr(ns, "moe_token_dispatcher_type", None) or "allgather",
                   flex_backend=getattr(ns, "moe_flex_dispatcher_backend", None) or "deepep",
                   grouped_gemm=bool(getattr(ns, "moe_grouped_gemm", False)),
                   capacity_factor=None if cf is None or cf < 0 else float(cf),
                   pad_to_capacity=bool(getattr(ns, "moe_pad_expert_input_to_capacity", False)),
                   router_dtype=getattr(ns, "moe_router_dtype", None) or "model",
                   permute_fusion=bool(getattr(ns, "moe_permute_fusion", False)),
                   overlap_ep_comm=bool(getattr(ns, "overlap_moe_expert_parallel_comm", False)),
                   recompute=tuple(m for m in ("moe_act", "moe", "shared_experts") if m in modules))
