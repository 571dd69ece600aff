"""Megatron's own options beyond the layout that change memory, communication and launch overhead,
as NVIDIA's recipes set them: gradients reduced in bf16, FP8 weights gathered, Megatron-FSDP
sharding weights and gradients too, the fused cross-entropy, TP communication overlapped with the
GEMMs, CUDA graphs, the precision-aware optimizer's smaller states. One value.

Its defaults are the request schema's (schemas/common.json, `megatron_options`), which are
Megatron's own (all off) but for the TP overlap, which the skill turns on where TE can run it.
The planner costs them (core/memory.py, core/timing.py), render writes
them as Megatron's flags, validate reads them back from a script (adapter/described.py), and the
rule book (core/layout.py, options_rules) holds their rules.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ToolError
from .defaults import schema_defaults

# Bytes of an Adam moment by the dtype Megatron's --exp-avg-dtype / --exp-avg-sq-dtype name
STATE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0}


@dataclasses.dataclass(frozen=True)
class MegatronOptions:
    grad_reduce_in_bf16: bool = False    # --grad-reduce-in-bf16: main gradients reduced (and kept) in bf16
    fp8_param_gather: bool = False       # --fp8-param-gather: TE's FP8 weights, gathered in FP8
    fsdp: bool = False                   # --use-megatron-fsdp, optim_grads_params: weights and gradients sharded
    cross_entropy_fusion: bool = False   # --cross-entropy-loss-fusion: no fp32 copy of the logits
    tp_comm_overlap: bool = True         # --tp-comm-overlap where TE, SP and one NVLink domain allow it
    cuda_graph_impl: str = "none"        # --cuda-graph-impl: none, local, transformer_engine, full_iteration
    cuda_graph_modules: tuple[str, ...] = ()   # --cuda-graph-modules; empty: whole layers
    precision_aware_optimizer: bool = False   # --use-precision-aware-optimizer: TE's Adam keeps the states below
    exp_avg_dtype: str = "fp32"          # --exp-avg-dtype: Adam's first moment under it
    exp_avg_sq_dtype: str = "fp32"       # --exp-avg-sq-dtype: its second moment
    fsdp_grads_fp32: bool = False        # --megatron-fsdp-main-grads-dtype fp32 (read from scripts only)
    optimizer_offload: float = 0.0       # --optimizer-cpu-offload: the share of the state on the host (scripts only)
    activation_offload_layers: int = 0   # --cpu-offloading-num-layers: layers whose activations wait on the host

    @classmethod
    def from_request(cls, options: dict[str, Any] | None) -> "MegatronOptions":
        values = {**schema_defaults("megatron_options"), **(options or {})}
        return cls(**{**values, "cuda_graph_modules": tuple(values.get("cuda_graph_modules") or ())})

    @classmethod
    def from_args(cls, ns: Any) -> "MegatronOptions":
        """The options a parsed Megatron argument namespace sets (validate's read-back)."""
        use_fsdp = bool(getattr(ns, "use_megatron_fsdp", False))
        fsdp = use_fsdp and (getattr(ns, "data_parallel_sharding_strategy", None) or "optim_grads_params") \
            == "optim_grads_params"
        # Megatron-FSDP keeps its main gradients in the dtype it is told, by default ('auto') the
        # parameters' (bf16); validate_args turns the name into a torch dtype
        fsdp_grads = str(getattr(ns, "megatron_fsdp_main_grads_dtype", None) or "auto").removeprefix("torch.")
        # CUDA graphs: the deprecated --enable-cuda-graph / --external-cuda-graph name an
        # implementation too; modules may be names or Megatron's enum values (after validate_args)
        impl = str(getattr(ns, "cuda_graph_impl", None) or "none")
        if impl == "none" and getattr(ns, "enable_cuda_graph", False):
            impl = "local"
        elif impl == "none" and getattr(ns, "external_cuda_graph", False):
            impl = "transformer_engine"
        modules = tuple(str(getattr(m, "name", m)) for m in (getattr(ns, "cuda_graph_modules", None) or ()))
        def state_dtype(name: str) -> str:   # a name, or the torch dtype validate_args made of it
            value = getattr(ns, name, None)
            return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16",
                    "torch.uint8": "fp8"}.get(str(value), str(value or "fp32"))
        fraction = getattr(ns, "optimizer_offload_fraction", None)   # unset: Megatron's default, all of it
        offload = (1.0 if fraction is None else float(fraction)) if getattr(ns, "optimizer_cpu_offload", False) else 0.0
        return cls(grad_reduce_in_bf16=bool(getattr(ns, "grad_reduce_in_bf16", False)),
                   optimizer_offload=min(max(offload, 0.0), 1.0) if offload == offload else 0.0,  # NaN: none
                   precision_aware_optimizer=bool(getattr(ns, "use_precision_aware_optimizer", False)),
                   exp_avg_dtype=state_dtype("exp_avg_dtype"), exp_avg_sq_dtype=state_dtype("exp_avg_sq_dtype"),
                   fsdp_grads_fp32=fsdp and fsdp_grads in ("fp32", "float32"),
                   fp8_param_gather=bool(getattr(ns, "fp8_param_gather", False)), fsdp=fsdp,
                   cross_entropy_fusion=bool(getattr(ns, "cross_entropy_loss_fusion", False)),
                   tp_comm_overlap=bool(getattr(ns, "tp_comm_overlap", False)),
                   cuda_graph_impl=impl, cuda_graph_modules=tuple(m for m in modules if m != "full"),
                   activation_offload_layers=max(0, int(getattr(ns, "cpu_offloading_num_layers", 0) or 0)))

    @property
    def bf16_grads(self) -> bool:
        """Main gradients kept and reduced in bf16: asked for, or Megatron-FSDP's default (the
        parameters' dtype; grad_reduce_in_bf16 does not change it)."""
        return self.grad_reduce_in_bf16 or (self.fsdp and not self.fsdp_grads_fp32)

    def optimizer_state_bytes(self, precision: str, te: bool) -> float:
        """Bytes an optimizer-shard parameter keeps in the optimizer: an fp32 master copy and Adam's
        two moments (12), or under the precision-aware optimizer (TE's Adam) the moments in their
        dtypes and, for bf16 weights, only the 16 bits of the fp32 master the bf16 weight lacks
        (Megatron's store_param_remainders, on by default): NeMo's distributed Adam kept the
        same. Megatron keeps the whole fp32 master where the FP8 recipe is not delayed scaling
        (the recipe render writes, tensorwise or MXFP8; delayed scaling would keep the remainder,
        counted as the whole master). Under Megatron-FSDP the optimizer's parameters are FSDP's
        fp32 main weights, and TE's Adam, told to keep master weights, keeps an fp32 copy of each
        besides (not measured here: counted). A script's --optimizer-cpu-offload keeps its share
        on the host."""
        if not (self.precision_aware_optimizer and te):
            total = 12.0
        else:
            master = 8.0 if self.fsdp else 4.0 if precision == "fp8" else 2.0
            total = master + STATE_BYTES[self.exp_avg_dtype] + STATE_BYTES[self.exp_avg_sq_dtype]
        return total * (1.0 - self.optimizer_offload)

    def adam_step_bytes(self, te: bool) -> float:
        """Bytes per optimizer-shard parameter TE's Adam allocates at the step under the
        precision-aware optimizer: an fp32 copy of each moment kept in another dtype, for the
        whole parameter group at once (fused_adam.py's unscaled lists, freed after the kernel).
        Counted for every such moment, bf16 ones too, though TE releases that fuse a bf16 pair's
        unscaling need no copy: the plan errs on the side that fits."""
        if not (self.precision_aware_optimizer and te):
            return 0.0
        return 4.0 * sum(d != "fp32" for d in (self.exp_avg_dtype, self.exp_avg_sq_dtype))

    def check_request(self, precision: str, te: bool, distributed_optimizer: bool | None = None) -> None:
        """A bad_request where the request itself asks what no layout can run (every layout would
        break the same rule: the request's error, not the layouts'); precision: the request's
        (bf16, fp8 or any); distributed_optimizer: what its constraints fix (None: free)."""
        if distributed_optimizer is False and not self.fsdp:
            for name in ("precision_aware_optimizer", "fp8_param_gather"):
                if getattr(self, name):
                    raise ToolError("bad_request", f"{name} runs with the distributed optimizer (or Megatron-FSDP), "
                                    "which the constraints turn off", where=f"/megatron_options/{name}",
                                    fix=f"drop constraints.distributed_optimizer false, or drop {name}")
        if self.fp8_param_gather and (precision not in ("fp8", "any") or not te):
            raise ToolError("bad_request", "gathering FP8 weights needs precision fp8 on Transformer Engine's layers",
                            where="/megatron_options/fp8_param_gather",
                            fix="set precision to fp8 with Transformer Engine, or drop fp8_param_gather")
        if self.fsdp and not te:
            raise ToolError("bad_request", "Megatron-FSDP runs with Transformer Engine's layers (its adapter asserts "
                            "Transformer Engine 2.10 or newer)", where="/megatron_options/fsdp",
                            fix="plan for Transformer Engine, or drop fsdp")
        if self.precision_aware_optimizer and not te:
            raise ToolError("bad_request", "the precision-aware optimizer is Transformer Engine's Adam (Megatron "
                            "asserts its FusedAdam)", where="/megatron_options/precision_aware_optimizer",
                            fix="plan for Transformer Engine, or drop precision_aware_optimizer")
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) != "fp32" and not self.precision_aware_optimizer:
                raise ToolError("bad_request", f"{name} {getattr(self, name)} without the precision-aware optimizer: "
                                "Megatron's optimizer config asserts fp32 moments then", where=f"/megatron_options/{name}",
                                fix="set precision_aware_optimizer true, or leave the dtype at fp32")
        if self.cuda_graph_impl != "none" and not te:
            raise ToolError("bad_request", "CUDA graphs are planned for Transformer Engine's layers only (the skill's "
                            "local path is not captured)", where="/megatron_options/cuda_graph_impl",
                            fix="plan for Transformer Engine, or set cuda_graph_impl to none")
        if self.cuda_graph_modules and self.cuda_graph_impl in ("none", "full_iteration"):
            effect = "do nothing" if self.cuda_graph_impl == "none" else "are refused by Megatron"
            raise ToolError("bad_request", f"cuda_graph_modules choose parts of per-layer graphs; with "
                            f"cuda_graph_impl {self.cuda_graph_impl} they {effect}",
                            where="/megatron_options/cuda_graph_modules",
                            fix="set cuda_graph_impl to transformer_engine or local, or leave cuda_graph_modules empty")
        if self.activation_offload_layers and not te:
            raise ToolError("bad_request", "activation offload is Transformer Engine's CPU-offload context",
                            where="/megatron_options/activation_offload_layers",
                            fix="plan for Transformer Engine, or set activation_offload_layers to 0")
        if self.activation_offload_layers and self.cuda_graph_impl not in ("none", "full_iteration"):
            raise ToolError("bad_request", "Megatron refuses activation offload with per-layer CUDA graphs",
                            where="/megatron_options/activation_offload_layers",
                            fix="set cuda_graph_impl to none, or activation_offload_layers to 0")
        if "moe_preprocess" in self.cuda_graph_modules and "moe_router" not in self.cuda_graph_modules:
            raise ToolError("bad_request", "the MoE preprocessing is captured only together with the router",
                            where="/megatron_options/cuda_graph_modules", fix="add moe_router")

    def tp_overlap_runs(self, tp: int, sequence_parallel: bool, nvlink_domain: int) -> bool:
        """Where TE's userbuffers overlap TP communication with the GEMMs (--tp-comm-overlap):
        asked for, with TP > 1 under sequence parallelism (Megatron asserts it), every TP rank in
        one NVLink domain (the buffers are shared through NVLink). On TE's layers only."""
        return self.tp_comm_overlap and 1 < tp <= nvlink_domain and sequence_parallel

    def graphed_layer_share(self, moe_layer: bool) -> float:
        """The share of a layer's kernel launches that its CUDA graphs replay without the host: all
        of it for whole layers (or the whole iteration); attention and MLP each half (assumed: the
        two halves launch alike); the MoE router, with or without the dispatcher's preprocessing,
        a quarter (assumed) of an MoE layer."""
        if self.cuda_graph_impl == "none":
            return 0.0
        mods = set(self.cuda_graph_modules)
        if self.cuda_graph_impl == "full_iteration" or not mods:
            return 1.0
        mlp = ("moe" in mods or 0.5 * ("moe_router" in mods)) if moe_layer else "mlp" in mods
        return 0.5 * ("attn" in mods) + 0.5 * float(mlp)

    def te_flags(self) -> list[str]:
        """Flags that run only on Transformer Engine's layers (with the TP overlap, which depends on
        the layout: adapter/arguments.py, te_only_args)."""
        a = []
        if self.precision_aware_optimizer:   # Megatron asserts TE's FusedAdam for it
            a.append("--use-precision-aware-optimizer")
            for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
                if getattr(self, name) != "fp32":
                    a += [f"--{name.replace('_', '-')}", getattr(self, name)]
        if self.activation_offload_layers:   # Megatron's offload is TE's CPU-offload context
            a += ["--cpu-offloading-num-layers", str(self.activation_offload_layers)]
        if self.cuda_graph_impl == "none":
            return a
        a += ["--cuda-graph-impl", self.cuda_graph_impl]
        if self.cuda_graph_modules:
            a += ["--cuda-graph-modules", *self.cuda_graph_modules]
        if self.cuda_graph_impl == "full_iteration":   # Megatron asserts the NaN check off under it
            a.append("--no-check-for-nan-in-loss-and-grad")
        return a

    def env(self) -> dict[str, str]:
        """Environment the options need: TE's graphs with PyTorch's expandable segments (which render
        sets) need NCCL's graph registration off (Megatron asserts it: illegal memory accesses)."""
        return {"NCCL_GRAPH_REGISTER": "0"} if self.cuda_graph_impl == "transformer_engine" else {}

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("fsdp_grads_fp32", "optimizer_offload")}
        return {**out, "cuda_graph_modules": list(self.cuda_graph_modules)}

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
