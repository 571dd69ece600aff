"""Megatron's own argument parser and checks, from the installed megatron-core.

``parse`` runs ``megatron.training.arguments.parse_args`` on an argument vector and,
given a world size, ``validate_args`` too: the same code ``pretrain_gpt.py`` runs at
start-up.  It needs no GPU: the one device query in validate_args (the GPU generation,
which decides only a CUDA_DEVICE_MAX_CONNECTIONS hint, and the compute capability that
grouped GEMM needs) is answered with the target GPU's, when no GPU is present.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any

from .errors import ToolError
from .skill_flags import add_skill_arguments


def available() -> bool:
    try:
        import megatron.training.arguments  # noqa: F401
        return True
    except Exception:
        return False


def _module():
    try:
        import megatron.training.arguments as arguments
    except Exception as e:  # ImportError, or torch missing underneath
        raise ToolError("environment", f"megatron-core is not importable: {e}", where="megatron.training",
                        fix="pip install 'megatron-core==0.19.*' (Python 3.12) or use the parser manifest")
    return arguments


def parse(argv: list[str], world_size: int | None = None, device_major: int = 9,
          env: dict[str, str] | None = None) -> Any:
    """The args namespace Megatron builds from argv; raises ToolError with Megatron's own message.

    env: the launch script's environment variables that validate_args reads
    (CUDA_DEVICE_MAX_CONNECTIONS, NVTE_*); by default what a rendered script sets."""
    arguments = _module()
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            args = arguments.parse_args(extra_args_provider=add_skill_arguments)
    except SystemExit:
        msg = err.getvalue().strip().splitlines()
        raise ToolError("invalid_script", f"Megatron's parser refused the arguments: {msg[-1] if msg else ''}",
                        where="argv", fix="remove or correct the flag it names")
    finally:
        sys.argv = saved
    if world_size is None:
        return args
    args.world_size, args.rank = world_size, 0
    import torch

    original = arguments.get_device_arch_version
    original_cap = torch.cuda.get_device_capability
    if not torch.cuda.is_available():
        arguments.get_device_arch_version = lambda: device_major
        torch.cuda.get_device_capability = lambda *a, **k: (device_major, 0)
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if env is None else env
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            arguments.validate_args(args, {})
    except (AssertionError, ValueError, RuntimeError) as e:
        raise ToolError("invalid_script", f"Megatron's validate_args refused the arguments: {e}",
                        where="argv", fix="fix the combination it names")
    finally:
        arguments.get_device_arch_version = original
        torch.cuda.get_device_capability = original_cap
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return args
