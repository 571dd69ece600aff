"""Fixes for running megatron.training from the megatron-core pip wheel without TE or apex.

1. The wheel ships the dataset index helpers prebuilt (megatron/core/datasets/helpers_cpp)
   but not their Makefile, while megatron.training's start-up runs ``make`` on rank 0 and
   exits when it fails.  When the prebuilt module imports, there is nothing to compile.
2. Resuming with the distributed optimizer and neither TE nor apex: DistributedOptimizer.
   state_dict() reads the Adam 'step' from the inner torch optimizer's state, which is
   empty before the first step, so load_checkpoint fails its ``assert len(steps) == 1``
   (megatron-core 0.19.2).  Megatron's own Megatron-FSDP path first fills
   the state with dummy values that the load then overwrites; the fix does the same here.
3. Selective recompute of the norms (--recompute-modules layernorm) without TE:
   CheckpointWithoutOutput sets ``self.fp8 = fp8 is not None``, true for its default
   fp8=False, and so calls TE's FP8GlobalStateManager, which is not there (NameError,
   megatron-core 0.19.2).  Without TE there is no FP8 state to save: off.
4. On a machine without a GPU (the CPU loop, checkpoint conversion): the MoE router moves its
   weight to ``torch.cuda.current_device()`` and the MoE aux-loss tensors are made there,
   dist_checkpointing's save calls ``torch.cuda.synchronize()``, and a pipelined model with tied
   embeddings moves the shared weight with ``.cuda()`` before summing it across its two stages.
   With no CUDA device, the current device is the CPU and there is nothing to synchronize.
"""
from __future__ import annotations


def prebuilt_helpers_available() -> bool:
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def skip_helper_build() -> bool:
    """megatron.training's start-up compiles the dataset helpers with make: with the prebuilt
    module present, there is nothing to compile."""
    if not prebuilt_helpers_available():
        return False
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None
    return True


def _wrap_method(cls, name: str, make) -> None:
    """Replace cls.name by make(original) once; a second apply() leaves it as it is."""
    original = getattr(cls, name)
    if getattr(original, "_skill_patched", False):
        return
    wrapped = make(original)
    wrapped._skill_patched = True
    setattr(cls, name, wrapped)


def patch_checkpoint_without_output() -> bool:
    from megatron.core.tensor_parallel import random

    if getattr(random, "HAVE_TE", True):
        return False

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.fp8 = False
        return __init__

    _wrap_method(random.CheckpointWithoutOutput, "__init__", make)
    return True


def patch_dist_optimizer_resume() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return False

    def make(original):
        def sharded_state_dict(self, *args, **kwargs):
            is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
            if is_loading and not self.optimizer.state:
                self._init_optimizer_states_with_dummy_values()
            return original(self, *args, **kwargs)
        return sharded_state_dict

    _wrap_method(distrib_optimizer.DistributedOptimizer, "sharded_state_dict", make)
    return True




def cpu_stands_in_for_cuda() -> bool:
    """Where no GPU is present, torch.cuda.current_device() answers "cpu", synchronize() does
    nothing and Tensor.cuda() is the tensor itself, so that Megatron's device-placement calls
    keep tensors on the CPU."""
    import torch

    if torch.cuda.is_available():
        return False
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    return True
