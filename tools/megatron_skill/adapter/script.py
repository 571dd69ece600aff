"""The Megatron launches of a script, one per path through it, read by shell.py.

A path is one way through the script's undecided conditions (`if [[ $FP8 == 1 ]]` with FP8
unset, `if python -c 'import transformer_engine'`); each path that starts a Python entry
gives one Extracted: the entry, its argument vector with the line of each word, the
launcher's world size, the environment the launch sees, and the choices that led there.
Where a path starts several Python scripts (data preparation, then training), the Megatron
one is the entry named pretrain_* / train*, else the one passing the most Megatron flags.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from ..errors import ToolError
from . import shell


@dataclasses.dataclass
class Extracted:
    args: list[str]                      # the Megatron argument vector
    lines: list[int]                     # the script line of each argument
    entry: str | None                    # the *.py that receives them
    entry_line: int | None
    env: dict[str, str]                  # variables the launch sees (exported, or set on its command)
    nproc_per_node: int | None
    nnodes: int | None
    sbatch: dict[str, str]
    unresolved: list[str]                # variables we could not resolve
    choices: list[str] = dataclasses.field(default_factory=list)   # the undecided conditions, and the way taken
    where: str | None = None             # "line 188", or inside what (bash -c, a heredoc, a sourced file)
    launcher: list[str] = dataclasses.field(default_factory=list)
    other_entries: list[str] = dataclasses.field(default_factory=list)  # other Python scripts the path starts
    world: int | None = None


@dataclasses.dataclass
class Reading:
    launches: list[Extracted]            # one per path that starts a Python entry
    paths: int                           # paths through the script, with or without a launch
    ended: list[str]                     # how the paths without a launch end
    notes: list[str]                     # what the reader could not follow
    flag_variables: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # variables holding flags
    placeholders: list[str] = dataclasses.field(default_factory=list)  # a template's <...>, read quoted


def read(text: str, script_path: Path | None = None, env: dict[str, str] | None = None,
         known_flags: frozenset[str] | set[str] | None = None, positional: list[str] | None = None) -> Reading:
    placeholders: list[str] = []
    try:
        try:
            reading = shell.read(text, script_path, env, None if positional is None else tuple(positional))
        except shell.ShellSyntax as first:
            # a template's placeholders (DATA_PATH=<Specify path>) are redirections to bash: read
            # them quoted, so that the rest of the script is checked too (validate says to fill them)
            quoted, placeholders = quote_placeholders(text)
            if not placeholders:
                raise
            try:
                reading = shell.read(quoted, script_path, env, None if positional is None else tuple(positional))
            except shell.ShellSyntax:
                raise first from None   # the script's own error, where bash meets it
    except shell.ScriptTooLarge as e:
        raise ToolError("invalid_script", f"the script is not read: {e}", where="/script",
                        fix="give validate the launch script itself (launch scripts are kilobytes, their commands "
                            "nested a few levels), or its Megatron arguments as args") from None
    except shell.ShellSyntax as e:
        line = text.splitlines()[e.line - 1] if 0 < e.line <= len(text.splitlines()) else ""
        placeholder = re.search(r"=\s*<[^>]*>", line)
        fix = ("fill in the placeholder " + placeholder.group(0).lstrip("= ") + " (bash reads < and > as "
               "redirections)") if placeholder else "fix the shell syntax there (bash -n script.sh shows the same error)"
        raise ToolError("invalid_script", f"bash cannot parse the script: {e} (line {e.line})", where=f"line {e.line}",
                        fix=fix) from None
    launches, ended = [], []
    for path in reading.paths:
        if not path.launches:
            ended.append(f"{'; '.join(path.choices) or 'the script'}: {path.ended or 'starts no Python entry'}")
            continue
        chosen = _megatron_launch(path.launches, known_flags or set())
        launches.append(_extracted(chosen, path, [la.entry for la in path.launches if la is not chosen]))
    return Reading(launches=launches, paths=len(reading.paths), ended=ended, notes=reading.notes,
                   flag_variables=_flag_variables(reading.paths, known_flags or set()), placeholders=placeholders)


# <Specify path>, <PATH_OF_DATA>: a word of a template, in code; not a heredoc's <<, a process
# substitution <(...), nor a redirection from a file (a name with a dot, or a space before the
# '>' that redirects the output: `done <hosts.txt >nodes.txt`)
PLACEHOLDER = re.compile(r"(?<![<\w\"'$])<([A-Za-z_][^<>\n\"'()|;&$`.]{0,80}(?<!\s))>(?![>&])")


def quote_placeholders(text: str) -> tuple[str, list[str]]:
    """text with each template placeholder outside comments quoted as a word, and the placeholders."""
    found: list[str] = []
    lines = []
    for line in text.splitlines(keepends=True):
        code, hash_, comment = line.partition(" #") if not line.lstrip().startswith("#") else ("", "", line)
        if not hash_ and not code:
            lines.append(line)
            continue
        found += [f"<{m}>" for m in PLACEHOLDER.findall(code)]
        lines.append(PLACEHOLDER.sub(lambda m: f'"<{m.group(1)}>"', code) + hash_ + comment)
    return "".join(lines), list(dict.fromkeys(found))


def _flag_variables(paths: list[shell.Path_], known: frozenset[str] | set[str]) -> dict[str, list[str]]:
    """Variables (strings or arrays) that hold Megatron flags, as the first path leaves them: what
    a configuration file sourced by a launch script defines."""
    out: dict[str, list[str]] = {}
    for name, value in (paths[0].vars.items() if paths else []):
        words = list(value) if isinstance(value, tuple) else str(value).split()
        if sum(w.split("=", 1)[0] in known for w in words) >= 2:
            out[name] = [w for item in words for w in (item.split() if item.startswith("--") else [item])]
    return out


def _megatron_launch(launches: list[shell.Launch], known: set[str]) -> shell.Launch:
    def score(la: shell.Launch) -> tuple[int, int]:
        named = re.match(r"(pretrain|train)", entry_stem(la.entry)) is not None
        return int(named), sum(a.split("=", 1)[0] in known for a in la.args if a.startswith("--"))
    return max(launches, key=score)


def _extracted(la: shell.Launch, path: shell.Path_, others: list[str]) -> Extracted:
    args = [a for a in la.args if a not in ('"$@"', "$@")]
    lines = [ln for a, ln in zip(la.args, la.lines[la.entry_index + 1:]) if a not in ('"$@"', "$@")]
    sbatch = dict(la.sbatch)
    opts = _launcher_options(la.launcher)
    for key in ("nodes", "ntasks-per-node", "gpus-per-node", "ntasks"):
        if key in opts.get("srun", {}):
            sbatch.setdefault(key, opts["srun"][key])
    nproc = opts.get("nproc_per_node")
    nnodes = opts.get("nnodes")
    ex = Extracted(args=args, lines=lines, entry=la.entry, entry_line=la.lines[la.entry_index], env=dict(la.env),
                   nproc_per_node=nproc, nnodes=nnodes, sbatch=sbatch, unresolved=list(path.unresolved),
                   choices=list(path.choices), where=la.where, launcher=la.launcher, other_entries=others)
    ex.world = _world(ex, opts)
    return ex


def entry_stem(entry: str) -> str:
    """pretrain_gpt for /x/pretrain_gpt.py, pretrain_mimo for examples.mimo.pretrain_mimo."""
    name = Path(entry).name
    return name[:-3] if name.endswith(".py") else name.rsplit(".", 1)[-1]


TORCHRUN = {"torchrun", "torch.distributed.run", "torch.distributed.launch"}


def _launcher_options(words: list[str]) -> dict[str, Any]:
    """torchrun's --nproc-per-node and --nnodes (DeepSpeed's runner: --num_gpus, --num_nodes); srun's
    node and task counts."""
    out: dict[str, Any] = {"torchrun": False, "srun": {}, "python": False}
    current = None
    for i, w in enumerate(words):
        name = Path(w).name
        if name in TORCHRUN or (w == "-m" and i + 1 < len(words) and words[i + 1] in TORCHRUN):
            out["torchrun"], current = True, "torchrun"
            continue
        if name == "deepspeed":   # DeepSpeed's runner (Megatron-DeepSpeed scripts): GPUs per node x nodes too
            out["torchrun"], current = True, "deepspeed"
            continue
        if name == "srun":
            current = "srun"
            continue
        if re.fullmatch(r"python[\d.]*", name):
            out["python"] = True
            continue
        key, _, val = w.partition("=")
        if not val and i + 1 < len(words) and not words[i + 1].startswith("-"):
            val = words[i + 1]
        key = key.replace("_", "-")
        if current == "torchrun":
            if key == "--nproc-per-node" and val.isdigit():
                out["nproc_per_node"] = int(val)
            elif key == "--nnodes" and val.split(":")[-1].isdigit():
                out["nnodes"] = int(val.split(":")[-1])
            elif key == "--standalone":
                out.setdefault("nnodes", 1)
        elif current == "deepspeed":
            if key in ("--num-gpus", "--num-nodes") and val.isdigit():
                out["nproc_per_node" if key == "--num-gpus" else "nnodes"] = int(val)
        elif current == "srun":
            aliases = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
                       "--ntasks-per-node": "ntasks-per-node", "--gpus-per-node": "gpus-per-node"}
            if key in aliases:
                out["srun"][aliases[key]] = val
    return out


def _int(value: str | None) -> int | None:
    value = (value or "").split(":")[-1].split("(")[0]
    return int(value) if value.isdigit() else None


def _world(ex: Extracted, opts: dict[str, Any]) -> int | None:
    """Ranks the launch starts: torchrun's processes per node x nodes; under srun without
    torchrun, one rank per task; a bare python, one rank (or the WORLD_SIZE it is given)."""
    nodes = ex.nnodes or _int(ex.sbatch.get("nodes"))
    if opts["torchrun"]:
        if ex.nproc_per_node is None:
            return None
        return ex.nproc_per_node * (nodes or 1)
    if any(Path(w).name == "srun" for w in ex.launcher):
        if _int(ex.sbatch.get("ntasks")):
            return _int(ex.sbatch.get("ntasks"))
        per_node = _int(ex.sbatch.get("ntasks-per-node"))
        return per_node * (nodes or 1) if per_node else None
    if _int(ex.env.get("WORLD_SIZE")):
        return _int(ex.env.get("WORLD_SIZE"))
    if ex.sbatch and _int(ex.sbatch.get("gpus-per-node")):   # an sbatch script that runs the launch itself
        return _int(ex.sbatch["gpus-per-node"]) * (nodes or 1)
    if all(Path(w).name in shell.WRAPPERS or re.fullmatch(r"python[\d.]*", Path(w).name) or w.startswith("-")
           for w in ex.launcher):
        return 1
    return None


def world_size(ex: Extracted) -> int | None:
    return ex.world


def summary(ex: Extracted) -> dict[str, Any]:
    out = {"entry": ex.entry, "entry_line": ex.entry_line, "where": ex.where, "num_args": len(ex.args),
           "nproc_per_node": ex.nproc_per_node, "nnodes": ex.nnodes, "sbatch": ex.sbatch,
           "unresolved_variables": ex.unresolved}
    if ex.choices:
        out["choices"] = ex.choices
    if ex.other_entries:
        out["other_entries"] = ex.other_entries
    return out
