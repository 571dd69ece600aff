"""Read the Megatron argument vector out of a launch script, without running it.

Understands the bash that launch scripts are made of: continuation lines, variables set
earlier (``X=1``, ``export X=...``, ``X=${X:-default}``), arrays (``ARGS=( ... )`` over
several lines, ``ARGS+=( ... )``, ``"${ARGS[@]}"``), ``#SBATCH`` directives and the
torchrun / srun / python line that starts ``*.py``.  Each argument keeps its line number.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Any

ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-a\s+)?|local\s+)?([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)$", re.S)
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(\[@\]|\[\*\])?(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
SBATCH = re.compile(r"^#SBATCH\s+(--?[A-Za-z-]+)(?:[= ]\s*(\S+))?")


@dataclasses.dataclass
class Extracted:
    args: list[str]                      # the Megatron argument vector
    lines: list[int]                     # the script line of each argument
    entry: str | None                    # the *.py that receives them
    entry_line: int | None
    env: dict[str, str]                  # variables exported or set before the launch
    nproc_per_node: int | None
    nnodes: int | None
    sbatch: dict[str, str]
    unresolved: list[str]                # variables we could not resolve


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations; keep the line number where each statement starts."""
    out, buf, start = [], "", None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if start is None:
            start = n
        if line.endswith("\\") and not line.endswith("\\\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        out.append((start, buf))
        buf, start = "", None
    if buf:
        out.append((start or 0, buf))
    return out


class _Vars:
    def __init__(self) -> None:
        self.scalars: dict[str, str] = {}
        self.arrays: dict[str, list[str]] = {}
        self.unresolved: list[str] = []

    def expand_word(self, word: str) -> list[str]:
        """A token after shlex: arrays splice in, scalars substitute (and word-split when the
        whole token is one unquoted variable)."""
        m = VAR.fullmatch(word)
        if m:
            name = m.group(1) or m.group(4)
            if name in self.arrays:
                return list(self.arrays[name])
            value = self._scalar(name, m.group(3))
            return value.split() if value is not None else [word]
        def sub(mm: re.Match) -> str:
            name = mm.group(1) or mm.group(4)
            if name in self.arrays:
                return " ".join(self.arrays[name])
            value = self._scalar(name, mm.group(3))
            return value if value is not None else mm.group(0)
        return [VAR.sub(sub, word)]

    def _scalar(self, name: str, default: str | None) -> str | None:
        if name in self.scalars:
            return self.scalars[name]
        if default is not None:
            return self.expand_text(default)
        if name not in self.unresolved:
            self.unresolved.append(name)
        return None

    def expand_text(self, text: str) -> str:
        return " ".join(w for tok in _tokens(text) for w in self.expand_word(tok))


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True, posix=True)
    except ValueError:
        return text.split()


SHELLS = {"bash", "sh", "/bin/bash", "/bin/sh", "/usr/bin/bash", "/usr/bin/env"}


def _shell_c(tokens: list[str]) -> list[str]:
    """`srun bash -c "torchrun ... pretrain_gpt.py ..."`: the command inside the string, read
    as the inner shell would (the words before the shell kept, for the launcher's options)."""
    for i in range(len(tokens) - 2):
        if tokens[i] in SHELLS and tokens[i + 1] in ("-c", "-lc", "-xc"):
            return tokens[:i] + _shell_c(_tokens(tokens[i + 2]))
    return tokens


def extract(text: str) -> Extracted:
    v = _Vars()
    sbatch: dict[str, str] = {}
    args: list[str] = []
    lines: list[int] = []
    entry = entry_line = None
    nproc = nnodes = None
    pending_array: tuple[str, bool, int, str] | None = None
    array_state = (0, None)  # parenthesis depth and open quote of the array being read
    for lineno, line in _logical_lines(text):
        stripped = line.strip()
        m = SBATCH.match(stripped)
        if m:
            sbatch[m.group(1).lstrip("-")] = m.group(2) or ""
            continue
        if pending_array:
            name, append, start, body = pending_array
            body += "\n" + line
            array_state = _scan("\n" + line, *array_state)
            if array_state[0] <= 0:
                _set_array(v, name, append, body)
                pending_array = None
            else:
                pending_array = (name, append, start, body)
            continue
        if not stripped or stripped.startswith("#"):
            continue
        am = ASSIGN.match(stripped)
        if am and not stripped.startswith(("if ", "for ", "while ")):
            name, append, value = am.group(1), am.group(2) == "+", am.group(3)
            if value.startswith("("):
                array_state = _scan(value)
                if array_state[0] <= 0:
                    _set_array(v, name, append, value)
                else:
                    pending_array = (name, append, lineno, value)
                continue
            words = [w for tok in _tokens(value) for w in v.expand_word(tok)]
            v.scalars[name] = (v.scalars.get(name, "") if append else "") + " ".join(words)
            continue
        tokens = _shell_c(_tokens(stripped))
        # The launch: the first word naming a Python script, directly or through a variable
        # ("$PRETRAIN_SCRIPT_PATH"; $ENTRY, as rendered scripts do).
        py = next((i for i, t in enumerate(tokens) if t.endswith(".py") or "$ENTRY" in t or "${ENTRY" in t
                   or ("$" in t and any(w.endswith(".py") for w in v.expand_word(t)))), None)
        if py is None:
            continue
        expanded_head = [w for t in tokens[:py] for w in v.expand_word(t)]
        for i, t in enumerate(expanded_head):
            key = t.split("=", 1)[0].replace("_", "-")
            val = t.split("=", 1)[1] if "=" in t else (expanded_head[i + 1] if i + 1 < len(expanded_head) else None)
            if key in ("--nproc-per-node", "--nproc_per_node") and val and val.isdigit():
                nproc = int(val)
            if key == "--nnodes" and val and val.split(":")[-1].isdigit():
                nnodes = int(val.split(":")[-1])
        entry, entry_line = " ".join(v.expand_word(tokens[py])), lineno
        for t in tokens[py + 1:]:
            if t in ("|", "||", "&&", ";", ">", "2>&1", "&") or t.startswith((">", "2>")):
                break
            for w in v.expand_word(t):
                if w in ('"$@"', "$@"):
                    continue
                args.append(w)
                lines.append(lineno)
    env = dict(v.scalars)
    return Extracted(args=args, lines=lines, entry=entry, entry_line=entry_line, env=env,
                     nproc_per_node=nproc, nnodes=nnodes, sbatch=sbatch, unresolved=v.unresolved)


def _scan(text: str, depth: int = 0, quote: str | None = None) -> tuple[int, str | None]:
    """Parenthesis depth and open quote after text, starting from a state: an array that
    spans many lines is scanned once, line by line, not again from its start."""
    for ch in text:
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
    return depth, quote


def _set_array(v: _Vars, name: str, append: bool, body: str) -> None:
    inner = body.strip()[1:]
    inner = inner[: inner.rfind(")")] if ")" in inner else inner
    words = [w for tok in _tokens(inner) for w in v.expand_word(tok)]
    v.arrays[name] = (v.arrays.get(name, []) if append else []) + words


def world_size(ex: Extracted) -> int | None:
    """GPUs the script starts: torchrun's nproc x nnodes, or Slurm's nodes x GPUs per node."""
    nodes = ex.nnodes
    if nodes is None and ex.sbatch.get("nodes", "").isdigit():
        nodes = int(ex.sbatch["nodes"])
    per_node = ex.nproc_per_node
    if per_node is None:
        for key in ("gpus-per-node", "ntasks-per-node"):
            val = ex.sbatch.get(key, "").split(":")[-1]
            if val.isdigit():
                per_node = int(val)
                break
    if per_node is None:
        return None
    return per_node * (nodes or 1)


def summary(ex: Extracted) -> dict[str, Any]:
    return {"entry": ex.entry, "entry_line": ex.entry_line, "num_args": len(ex.args),
            "nproc_per_node": ex.nproc_per_node, "nnodes": ex.nnodes, "sbatch": ex.sbatch,
            "unresolved_variables": ex.unresolved}
