"""Fixes for running megatron.training from the megatron-core pip wheel.

The wheel ships the dataset index helpers prebuilt (megatron/core/datasets/helpers_cpp)
but not their Makefile, while megatron.training's start-up runs ``make`` on rank 0 and
exits when it fails.  When the prebuilt module imports, there is nothing to compile.
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
    return done


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
        return True
    except Exception:
        return False
