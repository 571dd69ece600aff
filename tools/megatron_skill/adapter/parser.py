"""Megatron's own argument parser and checks, from the installed megatron-core.

``parse`` runs ``megatron.training.arguments.parse_args`` on an argument vector and,
given a world size, ``validate_args`` too: the same code ``pretrain_gpt.py`` runs at
start-up.  It needs no GPU: the one device query in validate_args (the GPU generation,
which decides only a CUDA_DEVICE_MAX_CONNECTIONS hint, and the compute capability that
grouped GEMM needs) is answered with the target GPU's, when no GPU is present.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from ..errors import ToolError
from ..locks import write_atomic
from .skill_flags import add_skill_arguments


def available() -> bool:
    """Whether Megatron's parser can be imported here (found, not imported: that takes seconds)."""
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) is not None for m in ("torch", "megatron.training"))
    except (ImportError, ValueError):
        return False


def check(argv: list[str], world_size: int | None = None, device_major: int = 9,
          env: dict[str, str | None] | None = None) -> list[str]:
    """parse's verdict: the warnings Megatron's parser and validate_args emitted, or its
    ToolError raised. Remembered on disk: importing Megatron's parser takes seconds, and its
    verdict depends only on the arguments, the installed megatron-core and the skill's own
    flags, all of which are in the key."""
    key = _verdict_key(argv, world_size, device_major, env)
    path = _cache_dir() / f"{key}.json"
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        verdict = None
    if verdict is None:
        try:
            warned: list[str] = []
            parse(argv, world_size=world_size, device_major=device_major, env=env, warnings_out=warned)
            verdict = {"ok": True, "warnings": warned}
        except ToolError as e:
            verdict = {"ok": False, "error": e.to_json()}
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(verdict))
    if not verdict.get("ok"):
        e = verdict["error"]
        raise ToolError(e["code"], e["message"], where=e.get("where"), fix=e.get("fix"))
    return list(verdict.get("warnings", []))


def _cache_dir() -> Path:
    root = os.environ.get("MEGATRON_SKILL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron-core-training")
    return Path(root) / "parser-verdicts"


def _verdict_key(argv: list[str], world_size: int | None, device_major: int, env: dict[str, str] | None) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        megatron = version("megatron-core")
    except PackageNotFoundError:
        megatron = "unknown"
    here = Path(__file__).resolve().parent
    own = b"".join((here / name).read_bytes() for name in ("parser.py", "skill_flags.py"))
    blob = json.dumps([megatron, sys.version_info[:2], hashlib.sha256(own).hexdigest(), argv, world_size,
                       device_major, env], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _module():
    """megatron.training.arguments, imported with torch.compile deferred: Megatron decorates its
    fused kernels with torch.compile at import, which loads TorchDynamo and Inductor (about
    2 s of a 4.5 s import here); the parser never runs a kernel, so the decoration is the
    identity while it imports (in this process only, and restored after)."""
    import torch

    real = torch.compile

    def deferred(model=None, **_kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = deferred
    try:
        import megatron.training.arguments as arguments
    except Exception as e:  # ImportError, or torch missing underneath
        raise ToolError("environment", f"megatron-core is not importable: {e}", where="megatron.training",
                        fix="pip install 'megatron-core==0.19.*' (Python 3.12) or use the parser manifest") from None
    finally:
        torch.compile = real
    return arguments


def parse(argv: list[str], world_size: int | None = None, device_major: int = 9,
          env: dict[str, str] | None = None, warnings_out: list[str] | None = None) -> Any:
    """The args namespace Megatron builds from argv; raises ToolError with Megatron's own message.

    env: the launch script's environment variables that validate_args reads
    (CUDA_DEVICE_MAX_CONNECTIONS, NVTE_*); by default what a rendered script sets.
    warnings_out: receives the warnings Megatron's argument code emits (what it ignores,
    switches off or changes), each once."""
    arguments = _module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _parse(arguments, argv, world_size, device_major, env)
        finally:
            if warnings_out is not None:
                for w in caught:  # only what Megatron's argument code says, not import-time notices
                    text = str(w.message).strip()
                    if "megatron/training" in w.filename.replace("\\", "/") and text not in warnings_out:
                        warnings_out.append(text)


def _reason(error: BaseException) -> str:
    """What Megatron said; for an assert without a message, the assert itself as written, with
    its place in Megatron's code."""
    if str(error).strip():
        return str(error).strip()
    import linecache
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if "megatron" in f.filename.replace("\\", "/")]
    if not frames:
        return type(error).__name__
    f = frames[-1]
    text = (linecache.getline(f.filename, f.lineno) or f.line or "").strip()
    where = f.filename.replace("\\", "/").split("site-packages/")[-1]
    return f"{text} ({where}, line {f.lineno})"


def _parse(arguments: Any, argv: list[str], world_size: int | None, device_major: int,
           env: dict[str, str] | None) -> Any:
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            args = arguments.parse_args(extra_args_provider=add_skill_arguments)
    except SystemExit:
        msg = err.getvalue().strip().splitlines()
        raise ToolError("invalid_script", f"Megatron's parser refused the arguments: {msg[-1] if msg else ''}",
                        where="argv", fix="remove or correct the flag it names") from None
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
    for k, v in env.items():   # None: the launch leaves it unset
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            arguments.validate_args(args, {})
    except (AssertionError, ValueError, RuntimeError) as e:
        raise ToolError("invalid_script", f"Megatron's validate_args refused the arguments: {_reason(e)}",
                        where="argv", fix="fix the combination it names") from None
    finally:
        arguments.get_device_arch_version = original
        torch.cuda.get_device_capability = original_cap
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return args
