"""Megatron's own argument parser and checks, from the installed megatron-core.

``parse`` runs ``megatron.training.arguments.parse_args`` on an argument vector and,
given a world size, ``validate_args`` too: the same code ``pretrain_gpt.py`` runs at
start-up.  It needs no GPU: the one device query in validate_args (the GPU generation,
which decides only a CUDA_DEVICE_MAX_CONNECTIONS hint, and the compute capability that
grouped GEMM needs) is answered with the target GPU's, when no GPU is present.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from .. import files
from ..errors import EXIT_CODES, ToolError
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
    verdict = _verdict(files.read_record(path))
    if verdict is None:
        warned: list[str] = []
        try:
            parse(argv, world_size=world_size, device_major=device_major, env=env, warnings_out=warned)
            verdict = {"ok": True, "warnings": warned}
        except ToolError as e:
            verdict = {"ok": False, "error": e.to_json(), "warnings": warned}
        _remember(path, verdict)
    if not verdict.get("ok"):
        e = verdict["error"]
        raise Refusal(e["code"], e["message"], where=e.get("where"), fix=e.get("fix"),
                      warnings=verdict.get("warnings", []))
    return list(verdict.get("warnings", []))


class Refusal(ToolError):
    """Megatron's refusal of an argument vector, with the warnings it gave before it stopped."""

    def __init__(self, *args: Any, warnings: list[str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.warnings = list(warnings or [])


# Whether verdicts are written to the cache: not during a dry run (contract.call turns it off),
# which writes nothing anywhere; MEGATRON_SKILL_CACHE=off turns the cache off altogether.
REMEMBER: contextvars.ContextVar[bool] = contextvars.ContextVar("remember_verdicts", default=True)
OFF = ("off", "0", "none", "no")


def _remember(path: Path, value: dict) -> None:
    if not REMEMBER.get() or os.environ.get("MEGATRON_SKILL_CACHE", "").lower() in OFF:
        return
    with contextlib.suppress(OSError, ValueError, ToolError):
        files.output_folder(path.parent, where="MEGATRON_SKILL_CACHE")  # no link to nowhere, no file on the way
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(value))


def _verdict(record: dict | None) -> dict | None:
    """A cached verdict, or None for anything of another shape (a damaged or forged cache file is
    parsed again, never trusted: its error would be raised as Megatron's)."""
    if not record or not isinstance(record.get("ok"), bool) or not isinstance(record.get("warnings", []), list) \
            or not all(isinstance(w, str) for w in record.get("warnings", [])):
        return None
    if record["ok"]:
        return record
    error = record.get("error")
    if not isinstance(error, dict) or error.get("code") not in EXIT_CODES or not isinstance(error.get("message"), str) \
            or not all(isinstance(error.get(k), (str, type(None))) for k in ("where", "fix")):
        return None
    return record


def _cache_dir() -> Path:
    if os.environ.get("MEGATRON_SKILL_CACHE", "").lower() in OFF:
        return Path(os.devnull) / "off"   # no cache: nothing is read (a path below a device) or written
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
    """megatron.training.arguments, imported with two of torch's import-time costs deferred, in this
    process only and restored after: Megatron decorates its fused kernels with torch.compile at
    import, which loads TorchDynamo and Inductor (about 2 s of a 4.5 s import here), and registers
    custom ops, for each of which torch reads the source lines around the registering call (about
    0.2 s) only to name its file and line. The parser never runs a kernel: the decoration is the
    identity, and the place is read from the frame. Whatever the import prints goes to stderr:
    stdout is the answer's."""
    import torch

    def deferred(model=None, **_kwargs):
        return model if model is not None else (lambda fn: fn)

    def place(stacklevel: int) -> str:
        frame = sys._getframe(stacklevel)
        return f"{frame.f_code.co_filename}:{frame.f_lineno}"

    library_utils = getattr(getattr(torch, "_library", None), "utils", None)
    patched = [(torch, "compile", deferred)] + (
        [(library_utils, "get_source", place)] if hasattr(library_utils, "get_source") else [])
    real = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, stand_in in patched:
        setattr(owner, name, stand_in)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import megatron.training.arguments as arguments
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # ImportError, torch missing underneath, or an exit at import
        raise ToolError("environment", f"megatron-core is not importable: {type(e).__name__}: {e}",
                        where="megatron.training",
                        fix="pip install 'megatron-core==0.19.*' (Python 3.12) or use the parser manifest") from None
    finally:
        for owner, name, original in real:
            setattr(owner, name, original)
    _docstrings_once()
    return arguments


def _docstrings_once() -> None:
    """Megatron 0.19 builds its parser anew on every parse_args, and each time reads the source of
    its config dataclasses (inspect.getsource, then ast.parse) for their fields' help text: about
    0.15 s a parse here, which validate pays several times (the script's arguments, the repaired
    copy, Megatron's defaults). The text depends on the class alone: kept per class after the
    first, in this process. Where the method is not there (another release), nothing changes."""
    try:
        from megatron.training import argument_utils
    except ImportError:
        return
    factory = getattr(argument_utils, "ArgumentGroupFactory", None)
    read = getattr(factory, "_get_field_docstrings", None)
    if read is None or getattr(read, "_kept_per_class", False):
        return
    kept: dict[type, dict[str, str]] = {}

    def per_class(self, src_cfg_class):
        if src_cfg_class not in kept:
            kept[src_cfg_class] = read(self, src_cfg_class)
        return dict(kept[src_cfg_class])

    per_class._kept_per_class = True
    per_class.__wrapped__ = read
    factory._get_field_docstrings = per_class


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


def _last_said(printed: str) -> str:
    """The last line Megatron printed before it stopped: what it stopped for."""
    lines = [ln.strip() for ln in printed.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _refusal(step: str, error: BaseException, printed: str) -> ToolError:
    """Any way Megatron's code ends while it reads the arguments, as one ToolError: an exit
    (argparse's error, exit() after a printed message, --help), an assert, or any other exception."""
    said = _last_said(printed)
    if isinstance(error, SystemExit):
        if step == "parser":
            return ToolError("invalid_script", f"Megatron's parser refused the arguments: {said}", where="argv",
                             fix="remove or correct the flag it names")
        code = "" if error.code in (0, None) else f", exit status {error.code}"
        return ToolError("invalid_script", f"Megatron's validate_args stopped the run (exit{code}): "
                         f"{said or 'it printed no reason'}", where="argv", fix="do what Megatron's message says")
    if isinstance(error, (AssertionError, ValueError, RuntimeError)):
        return ToolError("invalid_script", f"Megatron's {step} refused the arguments: {_reason(error)}",
                         where="argv", fix="fix the combination it names")
    return ToolError("invalid_script", f"Megatron's {step} failed on the arguments: {type(error).__name__}: "
                     f"{_reason(error)}", where="argv", fix="correct the flag whose value the error names")


def _run_megatron(step: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args) with what it prints kept (never on stdout) and every way it can end but by
    returning turned into a ToolError; step names it in the message ("parser", "validate_args")."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
            return fn(*args, **kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 -- exit(), sys.exit, asserts and anything else Megatron raises
        raise _refusal(step, e, printed.getvalue()) from None


def _parse(arguments: Any, argv: list[str], world_size: int | None, device_major: int,
           env: dict[str, str] | None) -> Any:
    if "-h" in argv or "--help" in argv:   # argparse would print the help (0.19's fails on a '%') and exit
        raise ToolError("invalid_script", "-h / --help asks Megatron's parser for its help: not a training argument",
                        where="argv", fix="remove -h / --help")
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        args = _run_megatron("parser", arguments.parse_args, extra_args_provider=add_skill_arguments)
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
    _set_env(env)
    try:
        _run_megatron("validate_args", arguments.validate_args, args, {})
    finally:
        arguments.get_device_arch_version = original
        torch.cuda.get_device_capability = original_cap
        _set_env(saved_env)
    _optimizer_config(args)
    return args


# What the optimizer config's own check says when Transformer Engine's FusedAdam is not importable:
# a fact of this Python, not of the arguments (the job's Python is checked where it runs).
TE_ADAM_MISSING = "requires FusedAdam from TransformerEngine"


def _optimizer_config(args: Any) -> None:
    """Megatron's optimizer config, built from the arguments as its training loop builds it
    (megatron.training.training.get_megatron_optimizer_config, already imported with the argument
    module): its __post_init__ asserts what validate_args leaves to it, e.g. the precision-aware
    optimizer only with Adam and the distributed optimizer, Adam's state dtypes fp32 without it."""
    from megatron.training.training import get_megatron_optimizer_config

    try:
        _run_megatron("optimizer config", get_megatron_optimizer_config, args)
    except ToolError as e:
        if TE_ADAM_MISSING not in e.message:
            raise


def _set_env(env: dict[str, str | None]) -> None:
    """Set each variable; None: unset it."""
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# Megatron 0.19's parser defaults for the values validate compares with training recipes, as
# recorded from megatron-core 0.19.2; used only where megatron-core is not installed (defaults()
# reads the installed parser otherwise).
RECORDED_DEFAULTS = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.999,
                     "weight_decay": 0.01, "lr_warmup_iters": 0, "lr_warmup_fraction": None,
                     "lr_warmup_samples": 0, "distributed_backend": "nccl"}


def defaults(dests: tuple[str, ...] = tuple(RECORDED_DEFAULTS)) -> tuple[dict[str, Any], str]:
    """Megatron's own defaults for dests: its parser run on no arguments (the installed
    megatron-core, remembered on disk per version), or the values recorded from 0.19 where it is
    not installed; and which of the two answered."""
    if not available():
        return {d: RECORDED_DEFAULTS.get(d) for d in dests}, "recorded from megatron-core 0.19.2 (not installed here)"
    from importlib.metadata import PackageNotFoundError, version

    try:
        megatron = version("megatron-core")
    except PackageNotFoundError:
        megatron = "unknown"
    key = hashlib.sha256(json.dumps(["defaults", megatron, sorted(dests)]).encode()).hexdigest()[:32]
    path = _cache_dir() / f"{key}.json"
    cached = files.read_record(path)
    if cached is not None and set(cached) == set(dests) and all(
            isinstance(v, (int, float, str, bool, type(None))) for v in cached.values()):
        return cached, f"Megatron's parser (megatron-core {megatron})"
    try:
        args = parse([])
    except ToolError:
        return {d: RECORDED_DEFAULTS.get(d) for d in dests}, "recorded from megatron-core 0.19.2 (its parser failed here)"
    found = {d: getattr(args, d, None) for d in dests}
    found = {d: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for d, v in found.items()}
    _remember(path, found)
    return found, f"Megatron's parser (megatron-core {megatron})"
