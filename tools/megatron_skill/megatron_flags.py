"""Megatron's flag set as data: checks that need no megatron-core installed.

``build_manifest`` reads the real parser (``add_megatron_arguments``); the manifest keeps
each flag's arity, value type and choices, which is all an argument vector needs to be
checked for unknown flags, missing values, wrong types and bad choices.  ``check`` uses the
installed parser when there is one and the manifest otherwise, and says which it used.
"""
from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any

from .catalog import CATALOG_DIR
from .errors import ToolError

MANIFEST_PATH = CATALOG_DIR / "megatron_flags.json"

# Flags that users carry over from old scripts and blog posts, with what replaced them.
# Some still parse in 0.19 (deprecated and ignored, or renamed); all are reported.
OBSOLETE = {
    "--fp8-hybrid": "--fp8-format hybrid",
    "--fp8-e4m3": "--fp8-format e4m3",
    "--use-flash-attn": "nothing: a no-op in 0.19, drop it (--attention-backend chooses the kernel)",
    "--cpu-optimizer-type": "--optimizer-cpu-offload together with --use-precision-aware-optimizer "
                            "(0.19 asserts the pair)",
    "--cpu-optimizer": "--optimizer-cpu-offload together with --use-precision-aware-optimizer "
                       "(0.19 asserts the pair)",
    # The same number: virtual stages per pipeline rank (--num-layers-per-virtual-pipeline-stage
    # counts layers, another quantity).
    "--virtual-pipeline-model-parallel-size": "--num-virtual-stages-per-pipeline-rank with the same value",
    "--use-mcore-models": "nothing: Megatron-Core models are the default; drop the flag",
    "--use-legacy-models": "nothing: legacy models were removed; drop the flag",
    "--no-async-tensor-model-parallel-allreduce": "nothing: removed; drop the flag",
    "--async-tensor-model-parallel-allreduce": "nothing: always on now; drop the flag",
    "--recompute-activations": "--recompute-granularity selective",
    "--use-te": "--transformer-impl transformer_engine",
    "--fp8": "--fp8-format hybrid (with --fp8-recipe)",
}


def _type_name(t: Any) -> str:
    if t in (int, float, str):
        return t.__name__
    return "custom" if t is not None else "none"


def build_manifest() -> dict[str, Any]:
    from importlib.metadata import version

    from megatron.training.arguments import add_megatron_arguments

    from .skill_flags import add_skill_arguments

    parser = add_skill_arguments(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    flags = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        kind = type(action).__name__.strip("_")
        entry = {"dest": action.dest, "action": kind, "type": _type_name(action.type)}
        if action.nargs is not None:
            entry["nargs"] = action.nargs
        if action.choices is not None:
            entry["choices"] = sorted(str(getattr(c, "name", c)) for c in action.choices)
        for opt in action.option_strings:
            flags[opt] = entry
    return {"megatron_core": version("megatron-core"), "flags": flags}


def load_manifest() -> dict[str, Any]:
    return json.loads(MANIFEST_PATH.read_text())


def known_flags() -> set[str]:
    return set(load_manifest()["flags"])


def suggest(flag: str) -> str | None:
    if flag in OBSOLETE:
        return OBSOLETE[flag]
    close = difflib.get_close_matches(flag, known_flags(), n=1, cutoff=0.75)
    return f"did you mean {close[0]}?" if close else None


def manifest_parser() -> argparse.ArgumentParser:
    """An argparse parser rebuilt from the manifest: same flags, arity, types and choices."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False, exit_on_error=False)
    conv = {"int": int, "float": float, "str": str}
    seen = set()
    by_dest: dict[str, list[str]] = {}
    entries = load_manifest()["flags"]
    for opt, e in entries.items():
        by_dest.setdefault((e["dest"], e["action"]), []).append(opt)
    for (dest, action), opts in by_dest.items():
        if (dest, action) in seen:
            continue
        seen.add((dest, action))
        e = entries[opts[0]]
        kw: dict[str, Any] = {"dest": dest}
        if action in ("StoreTrueAction", "StoreFalseAction"):
            kw["action"] = "store_true" if action == "StoreTrueAction" else "store_false"
        elif action == "BooleanOptionalAction":
            kw["action"] = argparse.BooleanOptionalAction
            opts = [o for o in opts if not o.startswith("--no-")] or opts
        else:
            if "nargs" in e:
                kw["nargs"] = e["nargs"]
            if e["type"] in conv:
                kw["type"] = conv[e["type"]]
            if "choices" in e and e["type"] in ("str", "none"):
                kw["choices"] = e["choices"]
        try:
            parser.add_argument(*opts, **kw)
        except argparse.ArgumentError:
            pass
    return parser


def check(argv: list[str], world_size: int | None = None) -> str:
    """Parse argv with Megatron's parser (and validate_args, given a world size); without
    megatron-core, with the manifest.  Returns which was used; raises ToolError on a refusal."""
    from . import megatron_parser

    if megatron_parser.available():
        megatron_parser.check(argv, world_size=world_size)
        return "megatron.training.arguments"
    parser = manifest_parser()
    try:
        _, unknown = parser.parse_known_args(argv)
    except (argparse.ArgumentError, ValueError) as e:
        raise ToolError("invalid_script", f"Megatron's flags (manifest) refuse the arguments: {e}",
                        where="argv", fix="correct the value of the flag it names")
    if unknown:
        flag = next((u for u in unknown if u.startswith("--")), unknown[0])
        hint = suggest(flag)
        raise ToolError("invalid_script", f"unknown Megatron flag {flag}", where="argv",
                        fix=hint or "remove it; see catalog/megatron_flags.json for the flags of megatron-core "
                        + load_manifest()["megatron_core"])
    return "manifest " + load_manifest()["megatron_core"]
