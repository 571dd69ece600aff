"""Fixes for running megatron.training from the megatron-core pip wheel without TE or apex.

1. The wheel ships the dataset index helpers prebuilt (megatron/core/datasets/helpers_cpp)
   but not their Makefile, while megatron.training's start-up runs ``make`` on rank 0 and
   exits when it fails.  When the prebuilt module imports, there is nothing to compile.
2. Resuming with the distributed optimizer and neither TE nor apex: DistributedOptimizer.
   state_dict() reads the Adam 'step' from the inner torch optimizer's state, which is
   empty before the first step, so load_checkpoint fails its ``assert len(steps) == 1``
   (megatron-core 0.19.2, seen on an H200).  Megatron's own Megatron-FSDP path first fills
   the state with dummy values that the load then overwrites; the fix does the same here.
"""
from __future__ import annotations


def prebuilt_helpers_available() -> bool:
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def apply() -> list[str]:
    """Apply what this megatron-core needs; returns what was done, for the log."""
    done = []
    if prebuilt_helpers_available():
        import megatron.core.datasets.utils as dataset_utils

        dataset_utils.compile_helpers = lambda: None
        done.append("dataset helpers: using the prebuilt helpers_cpp (no make)")
    if _patch_dist_optimizer_resume():
        done.append("distributed optimizer: optimizer state initialised before loading a checkpoint (no TE/apex)")
    return done


def _patch_dist_optimizer_resume() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return False
    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls.sharded_state_dict, "_skill_patched", False):
        return True
    original = cls.sharded_state_dict

    def sharded_state_dict(self, *args, **kwargs):
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return original(self, *args, **kwargs)

    sharded_state_dict._skill_patched = True
    cls.sharded_state_dict = sharded_state_dict
    return True


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
        return True
    except Exception:
        return False
