"""Megatron's flag set as data: checks that need no megatron-core installed.

``build_manifest`` reads the real parser (``add_megatron_arguments``); the manifest keeps
each flag's arity, value type and choices, which is all an argument vector needs to be
checked for unknown flags, missing values, wrong types and bad choices.  ``check`` uses the
installed parser when there is one and the manifest otherwise, and says which it used.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import re
from typing import Any, Callable

from ..core.catalog import CATALOG_DIR
from ..errors import ToolError

MANIFEST_PATH = CATALOG_DIR / "megatron_flags.json"

@dataclasses.dataclass(frozen=True)
class Obsolete:
    """A flag users carry over from old scripts and posts, and what replaces it in 0.19.
    takes_value: it is followed by a value; becomes: the words that replace it, where
    "{value}" is that value (None: no exact words, the flag is kept and `why` says what to do);
    why: said with the fix; refused: 0.19's parser reads it but validate_args stops on it."""
    takes_value: bool
    becomes: tuple[str, ...] | None
    why: str = ""
    refused: bool = False

    def replacement(self, value: str | None, original: list[str] | None = None) -> list[str]:
        if self.becomes is None:
            return list(original or [])
        return [w.replace("{value}", value or "") for w in self.becomes]

    def fix_text(self, flag: str, value: str | None = None) -> str:
        if self.becomes is None:
            return self.why
        old = f"{flag} {value}" if self.takes_value and value is not None else flag
        new = " ".join(self.replacement(value)) if value is not None or not self.takes_value else \
            " ".join(self.becomes).replace("{value}", "N")
        text = f"replace {old} with {new}" if self.becomes else f"delete {old}"
        return text + (f" ({self.why})" if self.why else "")


_PAIR = ("--optimizer-cpu-offload", "--use-precision-aware-optimizer")
_HYBRID_PATTERN = ("0.19 describes a hybrid model by its layers: --hybrid-layer-pattern, a letter a layer (M Mamba, "
                   "* attention, - MLP, E MoE), e.g. M-M-M*-M-M-")
# Some still parse in 0.19 (deprecated and ignored, or renamed); all are reported, and the
# severity comes from whether Megatron's parser still accepts them.
OBSOLETE = {
    "--fp8-hybrid": Obsolete(False, ("--fp8-format", "hybrid")),
    "--fp8-e4m3": Obsolete(False, ("--fp8-format", "e4m3")),
    "--fp8": Obsolete(False, ("--fp8-format", "hybrid"), "with --fp8-recipe for the scaling"),
    "--use-flash-attn": Obsolete(False, (), "a no-op in 0.19: --attention-backend chooses the kernel"),
    "--cpu-optimizer-type": Obsolete(True, _PAIR, "0.19 asserts the pair; Adam is its only optimizer there"),
    "--cpu-optimizer": Obsolete(False, _PAIR, "0.19 asserts the pair"),
    # The same number: virtual stages per pipeline rank (--num-layers-per-virtual-pipeline-stage
    # counts layers, another quantity).
    "--virtual-pipeline-model-parallel-size": Obsolete(True, ("--num-virtual-stages-per-pipeline-rank", "{value}"),
                                                       "the same number: virtual stages per pipeline rank"),
    "--use-mcore-models": Obsolete(False, (), "Megatron-Core models are the default; 0.19 ignores the flag"),
    "--use-legacy-models": Obsolete(False, (), "legacy models were removed"),
    "--no-async-tensor-model-parallel-allreduce": Obsolete(False, (), "removed"),
    "--async-tensor-model-parallel-allreduce": Obsolete(False, (), "always on now"),
    "--recompute-activations": Obsolete(False, ("--recompute-granularity", "selective"),
                                        "0.19 translates it so"),
    "--use-te": Obsolete(False, ("--transformer-impl", "transformer_engine")),
    # What it did where it existed: every layer's input kept and the layer recomputed in the
    # backward (full, uniform, one layer a chunk). --recompute-activations, which Megatron's own
    # message names, is selective recompute: less memory saved.
    "--checkpoint-activations": Obsolete(False, ("--recompute-granularity", "full", "--recompute-method", "uniform",
                                                 "--recompute-num-layers", "1"),
                                         "what it did: full recompute of every layer; --recompute-activations is "
                                         "selective recompute, which saves less memory", refused=True),
    "--use-rotary-position-embeddings": Obsolete(False, ("--position-embedding-type", "rope"),
                                                 "0.19 translates it so"),
    # Renamed when recompute replaced "activation checkpointing" (Megatron-LM 2022): the method
    # and count keep their meaning, and 0.19 asks the full granularity beside a method.
    "--activations-checkpoint-method": Obsolete(True, ("--recompute-granularity", "full", "--recompute-method",
                                                       "{value}"), "renamed; the same method"),
    "--activations-checkpoint-num-layers": Obsolete(True, ("--recompute-num-layers", "{value}"),
                                                    "renamed; the same count"),
    "--distribute-checkpointed-activations": Obsolete(False, ("--distribute-saved-activations",), "renamed"),
    "--use-custom-fsdp": Obsolete(False, ("--use-megatron-fsdp",), "renamed"),
    "--custom-fsdp": Obsolete(False, ("--use-megatron-fsdp",), "renamed"),
    "--data-impl": Obsolete(True, (), "removed: the dataset's index file says its format"),
    # Mamba hybrids of 2024 gave ratios; 0.19 takes the layers themselves, one letter each
    "--hybrid-attention-ratio": Obsolete(True, None, _HYBRID_PATTERN),
    "--hybrid-mlp-ratio": Obsolete(True, None, _HYBRID_PATTERN),
}


def last_value(args: list[str], flag: str) -> str | None:
    """The value of flag's last occurrence in args (the one Megatron's parser keeps): "" for a
    switch, None where args do not give it."""
    found = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name == flag:
            found = value if eq else (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "")
    return found


def _given_as(words: list[str], args: list[str]) -> bool:
    """Whether args give each flag of words with the value words give it."""
    return all(last_value(args, w) == last_value(words, w) for w in words if w.startswith("--"))


@dataclasses.dataclass(frozen=True)
class ConditionalGroup:
    """Flags an entry script adds to Megatron's parser only under a condition (an optional
    package importing): each flag with the values it takes (0 or 1) and its choices."""
    name: str
    entry: str
    condition: str
    source: str
    flags: dict[str, tuple[int, tuple[str, ...] | None]]


# Read from NVIDIA/Megatron-LM at tag core_v0.19.0 (commit 5be9626709af2722333bf54797c954c09edeada3):
# pretrain_gpt.py imports megatron.post_training.arguments.add_modelopt_args inside a try and,
# where the import succeeds (has_nvidia_modelopt), passes it as extra_args_provider; the flags are
# the add_argument calls of add_modelopt_args in megatron/post_training/arguments.py (its one
# group, "modelopt-generic"). The megatron-core wheel ships no megatron.post_training.
CONDITIONAL_GROUPS = (
    ConditionalGroup(
        name="modelopt", entry="pretrain_gpt",
        condition="Megatron-LM's pretrain_gpt.py adds it only where NVIDIA Model Optimizer imports "
                  "(nvidia-modelopt installed beside a Megatron-LM checkout, whose megatron.post_training "
                  "the megatron-core wheel does not ship)",
        source="NVIDIA/Megatron-LM core_v0.19.0, megatron/post_training/arguments.py (add_modelopt_args), "
               "used by pretrain_gpt.py when has_nvidia_modelopt",
        flags={"--export-model-type": (1, ("GPTModel", "HybridModel", "MambaModel")),
               "--export-legacy-megatron": (0, None), "--export-te-mcore-model": (0, None),
               "--export-default-te-spec": (0, None), "--export-force-local-attention": (0, None),
               "--export-kv-cache-quant": (1, ("none", "fp8", "fp8_affine", "nvfp4", "nvfp4_affine", "nvfp4_rotate")),
               "--export-real-quant-cfg": (1, ("fp8_real_quant", "fp8_blockwise_real_quant", "None")),
               "--export-quant-cfg": (1, None), "--export-kd-teacher-load": (1, None),
               "--export-kd-teacher-model-config": (1, None),
               "--export-kd-teacher-ckpt-format": (1, ("torch", "torch_dist", "torch_dcp")),
               "--export-kd-cfg": (1, None), "--finetune-hf-dataset": (1, None), "--finetune-data-split": (1, None),
               "--qad-train-target": (1, ("base", "mtp", "both")), "--freeze-base-for-mtp": (0, None),
               "--export-qk-l2-norm": (0, None), "--export-moe-apply-probs-on-input": (0, None),
               "--export-offline-model": (0, None), "--modelopt-enabled": (0, None), "--enable-gpt-oss": (0, None)}),
)


def conditional_group(flag: str) -> ConditionalGroup | None:
    """The optional argument group that holds flag, or None."""
    return next((g for g in CONDITIONAL_GROUPS if flag in g.flags), None)


@dataclasses.dataclass(frozen=True)
class Retired:
    """A flag Megatron's own code says is retired: its words, and whether validate_args stops
    on it (an assert or an exit) or reads on (ignored or translated, said in its help)."""
    says: str
    refused: bool


def _megatron_arguments_source() -> str | None:
    """The text of the installed megatron/training/arguments.py, found without importing it."""
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "training" / "arguments.py"
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace")
    return None


def _string(node: Any) -> str | None:
    """A string literal as Python joins it ('a' 'b', 'a' + 'b'); None for anything computed."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string(node.left), _string(node.right)
        return left + right if left is not None and right is not None else None
    return None


_RETIRED_WORDS = r"no longer valid|(?<![\w-])deprecated[\].:]"


def _retired_in_help(tree: Any) -> dict[str, tuple[str, str]]:
    """dest -> (flag, help) of every flag whose help calls it deprecated; and every flag's dest."""
    import ast
    import re

    out: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        opts = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        if not opts:
            continue
        kw = {k.arg: k.value for k in node.keywords}
        dest = _string(kw["dest"]) if "dest" in kw else opts[0][2:].replace("-", "_")
        text = _string(kw["help"]) if "help" in kw else None
        out[dest] = (opts[0], text if text and re.search(_RETIRED_WORDS, text, re.I) else "")
    return out


def _refused_in_validate_args(tree: Any) -> dict[str, str]:
    """dest -> Megatron's words, for each flag validate_args stops on as retired: `assert args.X is
    None, '... no longer valid ...'` and `if args.X: print(...); exit()`."""
    import ast
    import re

    body = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "validate_args"), None)
    out: dict[str, str] = {}
    for node in ast.walk(body) if body else ():
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Attribute) and isinstance(node.test.ops[0], ast.Is):
            said = _string(node.msg) or ""
            if re.search(_RETIRED_WORDS, said, re.I):
                out[node.test.left.attr] = said
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Attribute):
            calls = [c for stmt in node.body for c in ast.walk(stmt) if isinstance(c, ast.Call)]
            if any(ast.unparse(c.func) in ("exit", "sys.exit", "quit") for c in calls):
                said = next((t for c in calls for t in map(_string, c.args) if t), "")
                if re.search(_RETIRED_WORDS, said, re.I):
                    out[node.test.attr] = said
    return out


@functools.lru_cache(maxsize=1)
def megatron_retired() -> dict[str, Retired]:
    """The flags the installed Megatron's own code calls retired, read from its source (not
    imported: that takes seconds): {flag: Retired}. Empty where megatron-core is absent."""
    import ast

    text = _megatron_arguments_source()
    if text is None:
        return {}
    tree = ast.parse(text)
    in_help = _retired_in_help(tree)
    out = {flag: Retired(says, refused=False) for flag, says in in_help.values() if says}
    for dest, says in _refused_in_validate_args(tree).items():
        if dest in in_help:
            out[in_help[dest][0]] = Retired(says, refused=True)
    return out


def obsolete_entry(flag: str) -> Obsolete | None:
    """What replaces a flag: the skill's exact words (OBSOLETE) where it has them; else Megatron's
    own, a rename where they say "use --NEW instead" of a flag that takes a value."""
    import re

    if flag in OBSOLETE:
        return OBSOLETE[flag]
    retired = megatron_retired().get(flag)
    if retired is None:
        return None
    takes_value = flag in known_flags() and arity(flag) != 0
    rename = re.search(r"use (--[\w-]+) instead", retired.says)
    if rename and takes_value and rename.group(1) in known_flags():
        return Obsolete(True, (rename.group(1), "{value}"), "as Megatron's own message says", retired.refused)
    return Obsolete(takes_value, None, f"Megatron 0.19 says: {retired.says}", retired.refused)


def rewrite_obsolete(args: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """args with every obsolete flag replaced as its entry says (a replacement already present
    is not added twice; a flag with no exact replacement is kept), and the changes: flag, its
    value, the words removed and added."""
    out: list[str] = []
    changes: list[dict[str, Any]] = []
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        entry = obsolete_entry(flag) if args[i].startswith("--") else None
        if entry is None:
            out.append(args[i])
            i += 1
            continue
        value = inline or None
        removed = [args[i]]
        if entry.takes_value and not inline and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            removed.append(value)
        added = entry.replacement(value, removed)
        present = [w for w in added if w.startswith("--") and (w in out or w in args)]
        fix = entry.fix_text(flag, value)
        if entry.becomes is not None and present and len(present) == sum(w.startswith("--") for w in added):
            if _given_as(added, args):
                fix = f"delete {' '.join(removed)}: the launch's {' '.join(added)} already says it"
            added = []
        out += added
        changes.append({"flag": flag, "value": value, "removed": removed, "added": added, "fix": fix})
        i += len(removed)
    return out, changes


@dataclasses.dataclass(frozen=True)
class Combination:
    """A pair of settings Megatron 0.19's validate_args refuses (an assert), known to the skill
    so that the planning-only install (no megatron-core) still catches it. Each is tested
    against Megatron's own validate_args (tests/test_validate.py). flag: the flag it names,
    whose removal is the repair validate makes before Megatron's own checks run."""
    code: str
    when: Callable[[argparse.Namespace], bool]
    message: str
    fix: str
    flag: str


COMBINATIONS = (
    Combination("tp_comm_overlap_needs_sp", lambda ns: ns.tp_comm_overlap and not ns.sequence_parallel,
                "--tp-comm-overlap without --sequence-parallel",
                "add --sequence-parallel (Megatron overlaps TP communication only with it)", "--tp-comm-overlap"),
    Combination("fp8_param_gather_needs_distopt",
                lambda ns: ns.fp8_param_gather and not (ns.use_distributed_optimizer or ns.use_megatron_fsdp
                                                        or ns.use_torch_fsdp2),
                "--fp8-param-gather without the distributed optimizer", "add --use-distributed-optimizer",
                "--fp8-param-gather"),
    Combination("overlap_param_gather_needs_distopt",
                lambda ns: ns.overlap_param_gather and not (ns.use_distributed_optimizer or ns.use_megatron_fsdp),
                "--overlap-param-gather without the distributed optimizer",
                "add --use-distributed-optimizer (or drop --overlap-param-gather)", "--overlap-param-gather"),
    Combination("overlap_param_gather_needs_grad_reduce",
                lambda ns: ns.overlap_param_gather and not ns.overlap_grad_reduce,
                "--overlap-param-gather without --overlap-grad-reduce", "add --overlap-grad-reduce",
                "--overlap-param-gather"),
    Combination("optimizer_cpu_offload_needs_precision_aware",
                lambda ns: ns.optimizer_cpu_offload and not ns.use_precision_aware_optimizer,
                "--optimizer-cpu-offload without --use-precision-aware-optimizer",
                "add --use-precision-aware-optimizer (the offloaded optimizer runs through its code path)",
                "--optimizer-cpu-offload"),
    Combination("fp4_and_fp8", lambda ns: bool(ns.fp4 and ns.fp8), "--fp4-format together with --fp8-format",
                "choose one of the two", "--fp4-format"),
    Combination("fp16_and_bf16", lambda ns: bool(ns.fp16 and ns.bf16), "--fp16 together with --bf16",
                "keep one: --bf16 (no loss scaling needed) on Ampere and newer, --fp16 on older GPUs", "--fp16"),
)


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


@functools.lru_cache(maxsize=1)
def load_manifest() -> dict[str, Any]:
    return json.loads(MANIFEST_PATH.read_text())


@functools.lru_cache(maxsize=1)
def known_flags() -> frozenset[str]:
    return frozenset(load_manifest()["flags"])


def arity(flag: str) -> int | None:
    """How many values a known flag takes: 0 for a switch, None for a list (nargs + or *)."""
    nargs = load_manifest()["flags"][flag].get("nargs")
    if nargs in ("+", "*"):
        return None
    return 1 if nargs is None else int(nargs) if str(nargs).isdigit() else 1


@functools.lru_cache(maxsize=1)
def _flags_by_dest() -> dict[str, str]:
    """Each argument's name in Megatron's namespace (its dest) -> its first flag that sets a value."""
    out: dict[str, str] = {}
    for flag, entry in load_manifest()["flags"].items():
        if entry["action"] != "StoreFalseAction" and (entry["dest"] not in out or flag == _flag_of(entry["dest"])):
            out[entry["dest"]] = flag   # the flag named as the argument is, where there are several
    return out


def _flag_of(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def flags_named(text: str) -> list[str]:
    """The flags of the arguments a text of Megatron's code names as args.NAME, in order."""
    by_dest = _flags_by_dest()
    return list(dict.fromkeys(by_dest[m] for m in re.findall(r"\bargs\.(\w+)", text) if m in by_dest))


def suggest(flag: str) -> str | None:
    entry = obsolete_entry(flag)
    if entry is not None:
        return entry.fix_text(flag)
    close = difflib.get_close_matches(flag, known_flags(), n=1, cutoff=0.75)
    return f"did you mean {close[0]}?" if close else None


@functools.lru_cache(maxsize=1)
def manifest_parser() -> argparse.ArgumentParser:
    """An argparse parser rebuilt from the manifest: same flags, arity, types and choices. Built
    once a process (1,600 flags: 70 ms) and only parsed with after: parsing leaves it unchanged."""
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


def check(argv: list[str], world_size: int | None = None, env: dict[str, str] | None = None) -> str:
    """Parse argv with Megatron's parser (and validate_args, given a world size, under env: the
    variables the script sets that validate_args reads); without megatron-core, with the manifest.
    Returns which was used; raises ToolError on a refusal."""
    from . import parser as megatron_parser

    if megatron_parser.available():
        megatron_parser.check(argv, world_size=world_size, env=env)
        return "megatron.training.arguments"
    parser = manifest_parser()
    try:
        _, unknown = parser.parse_known_args(argv)
    except (argparse.ArgumentError, ValueError) as e:
        raise ToolError("invalid_script", f"Megatron's flags (manifest) refuse the arguments: {e}",
                        where="argv", fix="correct the value of the flag it names") from None
    if unknown:
        flag = next((u for u in unknown if u.startswith("--")), unknown[0])
        hint = suggest(flag)
        raise ToolError("invalid_script", f"unknown Megatron flag {flag}", where="argv",
                        fix=hint or "remove it; see catalog/megatron_flags.json for the flags of megatron-core "
                        + load_manifest()["megatron_core"])
    return "manifest " + load_manifest()["megatron_core"]


def check_values(argv: list[str]) -> str:
    """The values of argv against the manifest (arity, types, choices): no import of Megatron,
    so it answers at once. Returns what was used; raises ToolError on a refusal."""
    try:
        manifest_parser().parse_known_args(argv)
    except (argparse.ArgumentError, ValueError) as e:
        raise ToolError("invalid_script", f"Megatron's flags refuse the arguments: {e}", where="argv",
                        fix="correct the value of the flag it names") from None
    return "flag manifest of megatron-core " + load_manifest()["megatron_core"]
