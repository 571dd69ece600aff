"""Every change the runtime makes to Megatron's code, in one registry.

Each patch names the megatron-core versions it was written for, the attribute it replaces or
wraps, and what that attribute must look like (its parameters, the attributes it relies on).
Before a patch is installed its target is checked: a target that moved or changed shape is a
clear error naming the patch, instead of a patch that silently stops applying (or applies to
the wrong thing). tests/test_patches.py checks every target against the installed
megatron-core, so an upgrade that breaks one fails there first.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

WRITTEN_FOR = (">=", "0.19.2"), ("<", "0.20")


class PatchError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str                          # what it does, for the run's log
    target: str                        # "module:attribute.path" that it replaces or wraps
    install: Callable[[], bool]        # False where it does not apply here (nothing done)
    parameters: tuple[str, ...] = ()   # parameters the target (a function) must take
    requires: tuple[str, ...] = ()     # other "module:attribute" the patch relies on
    versions: tuple = WRITTEN_FOR      # megatron-core versions it was written for

    def check(self) -> None:
        """The target and what the patch relies on exist, take the parameters it passes, and
        the installed megatron-core is one it was written for; else PatchError."""
        have = _megatron_version()
        if have is not None and not _in_range(have, self.versions):
            raise PatchError(f"patch '{self.name}' was written for megatron-core "
                             f"{','.join(op + v for op, v in self.versions)}; this is {have}: check "
                             f"{self.target} against it and widen the range in runtime/patches.py")
        for where in (self.target, *self.requires):
            obj = resolve(where)
            if obj is _MISSING:
                raise PatchError(f"patch '{self.name}': {where} is not in megatron-core {have}; the code it "
                                 f"changes has moved (runtime/patches.py)")
        target = resolve(self.target)
        if self.parameters:
            try:
                params = inspect.signature(target).parameters
            except (TypeError, ValueError):
                raise PatchError(f"patch '{self.name}': {self.target} is no longer a function") from None
            missing = [p for p in self.parameters if p not in params]
            if missing:
                raise PatchError(f"patch '{self.name}': {self.target} no longer takes {', '.join(missing)} "
                                 f"(it takes {', '.join(params)}); the patch must be rewritten for it")

    def apply(self) -> bool:
        self.check()
        return self.install()


_MISSING = object()


def resolve(where: str):
    """The object "pkg.module:Class.attr" names, or _MISSING."""
    module, _, path = where.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return _MISSING
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def _megatron_version() -> str | None:
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


def _parts(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def _in_range(have: str, spec: tuple) -> bool:
    h = _parts(have)
    ops = {">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "==": lambda a, b: a == b}
    return all(ops[op](h, _parts(v)) for op, v in spec)


def registry() -> list[Patch]:
    """Every patch the runtime may install, in the order the entry script applies them."""
    from . import compat, fused_adam, fused_rope, gpu_profile, wgrad_accum

    return [
        Patch("dataset helpers: the prebuilt helpers_cpp, no make", "megatron.core.datasets.utils:compile_helpers",
              compat.skip_helper_build),
        Patch("distributed optimizer: optimizer state made before a checkpoint loads (no TE or apex)",
              "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict",
              compat.patch_dist_optimizer_resume, parameters=("self", "model_sharded_state_dict", "is_loading"),
              requires=("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer."
                        "_init_optimizer_states_with_dummy_values",)),
        Patch("selective recompute: CheckpointWithoutOutput without TE's FP8 state",
              "megatron.core.tensor_parallel.random:CheckpointWithoutOutput.__init__",
              compat.patch_checkpoint_without_output, parameters=("self", "fp8")),
        Patch("gradient-accumulation fusion: weight gradients added into fp32 main_grad by torch.addmm",
              "megatron.core.tensor_parallel.layers:_grad_accum_fusion_available", wgrad_accum.install),
        Patch("optimizer: torch's fused AdamW where Megatron falls back to torch's optimizer",
              "megatron.core.optimizer:USING_PYTORCH_OPTIMIZER", fused_adam.install,
              requires=("torch.optim.optimizer:register_optimizer_step_pre_hook",)),
        Patch("RoPE: Megatron's unfused function, torch.compile'd",
              "megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_bshd", fused_rope.install,
              parameters=("t", "freqs")),
        Patch("CPU stands in for the CUDA device where no GPU is present", "torch.cuda:current_device",
              compat.cpu_stands_in_for_cuda, requires=("torch.cuda:synchronize",)),
        Patch("kernel profile of one iteration", "megatron.training.training:train_step", gpu_profile.install,
              parameters=("forward_step_func", "data_iterator", "model", "optimizer")),
    ]


def by_name(prefix: str) -> Patch:
    return next(p for p in registry() if p.name.startswith(prefix))
