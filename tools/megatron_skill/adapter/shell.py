"""Bash as launch scripts are written, read and never run.

A launch script is data to us: which Python entry it starts, with which words, under which
launcher and environment.  This module reads the scripts the way bash itself would: quoting
(an array item "--fp8-format hybrid" stays one word when quoted as "${A[@]}" and splits when
unquoted), parameter expansion (${V:-x}, ${V:=x}, ${V:+x}, ${V#p}, ${V%p}, ${V/p/r}, ${#V},
${A[i]}), $((arithmetic)), if/elif/else, case, for, while, functions with their positional
parameters, `source` of files next to the script, heredocs (a body fed to bash or sbatch, or
written with cat to a file run later), and `bash -c` strings.

Nothing is executed.  A command substitution other than a few pure ones (echo, dirname,
basename, pwd) has an unknown value; a condition that depends on an unknown value or on the
machine (`[ -f x ]`, `python -c 'import te'`) is not decided: both ways are followed, and
each path through the script says which way it went at which line.

The parsing is shfmt's (mvdan/sh, the `shfmt` binary of the PyPI package shfmt-py, MIT/BSD):
`shfmt --to-json -ln bash` gives its typed syntax tree (Stmt, CallExpr, IfClause, ...; words as
Lit, SglQuoted, DblQuoted, ParamExp, CmdSubst and ArithmExp parts; arithmetic and [[ ]] tests
already parsed), and this module evaluates that tree: no text is scanned again for `$`, quotes or
braces.  It replaced a lexer and recursive-descent parser of our own (2026-12), measured with
dev/compare_shell_reader.py on 203 distinct scripts (112 of NVIDIA Megatron-LM's examples at
core_v0.19.0, 82 that the reader's tests hand it, 8 that render writes, the test fixture): 184
read the same (launches, words, lines, environment, path labels, notes); 17 are scripts bash
cannot parse either, refused at the same line in shfmt's words; in 2 (NVIDIA's nemotron-nano-vl
scripts, whose `sh -c` string does not parse) the old reader had left the nested string's name
on the labels of the lines after it.  The module went from 1,576 lines to about 1,490.  A shfmt
process costs 9 ms for the median script (1.5 KB) and 24 ms for the largest (19 KB); a text
is parsed once per read, so the corpus's 203 reads ran 310 processes in 4.5 s (the old reader:
1.0 s).  shfmt's JSON is indented, about 1 KB per word and quadratic in the nesting: a 1 MiB
script of short words took 22-50 s and 3.4 GB, 2,000 nested ifs (36 KB) 778 MB of JSON and 3.2 GB.
So before shfmt runs, a cheap scan estimates the JSON (_json_estimate) and a text whose tree would
pass MAX_JSON_BYTES is refused; a read parses at most MAX_READ_BYTES and MAX_PARSES texts.  The
largest accepted, 40,000 array items in 589 KB, reads in about 6 s and 0.5 GB.  The estimate misses
trees that nest one level per operator (`a && a && ...` of 4,000: 20 KB, estimated 13 MB, 1.7 GB of
JSON and 7.9 GB in shfmt; `$((1+1+...))` likewise), so the process itself is bounded too: its answer
is read up to MAX_JSON_BYTES, its address space limited to SHFMT_MEMORY_BYTES (that chain: refused
in about 5 s), its process group killed after SHFMT_TIMEOUT_S.

Other parsers were measured first.  tree-sitter-bash 0.25.1 turns `if ! cmd <<'X'; then` (a
heredoc with more on its line, which render writes) into an error node; bashlex reads no arrays
and is GPL.  shfmt 3.14 refuses an unquoted array item that starts with `[` (NVIDIA's DeepSeek-V3
`--moe-layer-freq [0]*3+[1]*58`): parse() works around that one gap (see there).
"""
from __future__ import annotations

import bisect
import dataclasses
import fnmatch
import functools
import importlib.metadata
import json
import operator
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from ..errors import ToolError

MAX_PATHS = 16          # paths through undecided conditions; beyond, the first way is taken
MAX_STEPS = 50_000      # commands evaluated in all; a script that loops further is cut short
MAX_DEPTH = 8           # nesting of source, functions, bash -c and heredoc scripts
MAX_LOOP = 256          # iterations of one loop
MAX_FILE_BYTES = 1 << 20
MAX_PARSE_BYTES = 1 << 20     # one text given to shfmt (and MAX_JSON_BYTES of its answer)
MAX_READ_BYTES = 2 << 20      # all the texts one read parses (sourced files, heredocs, bash -c)
MAX_PARSES = 256              # distinct texts one read parses (a shfmt process each)
MAX_BRACKET_RETRIES = 64
SHFMT_TIMEOUT_S = 60      # the largest script accepted parses in about 3.5 s on an idle machine
SHFMT_ENV = "MEGATRON_SKILL_SHFMT"   # the shfmt binary to use instead of the one found


class ShellSyntax(Exception):
    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


class ScriptTooLarge(ShellSyntax):
    """A text longer, or nested deeper, than the reader parses."""


# ---------------------------------------------------------------- front end: shfmt's syntax tree

def shfmt_binary() -> str:
    """The shfmt binary: $MEGATRON_SKILL_SHFMT if set, else the one the shfmt-py package installed (as its
    install record says, wherever that package is on sys.path), else one beside this interpreter or on PATH."""
    override = os.environ.get(SHFMT_ENV)
    found = [override] if override is not None else [
        _recorded_shfmt(), os.path.join(sysconfig.get_path("scripts"), "shfmt"),
        os.path.join(os.path.dirname(sys.executable), "shfmt"), shutil.which("shfmt")]
    for path in found:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise ToolError("environment", "reading a shell script needs the shfmt parser, and none is installed"
                    + (f" ({SHFMT_ENV}={override} is not an executable file)" if override is not None else ""),
                    fix="pip install shfmt-py (tools/setup.sh installs it with the skill)")


@functools.lru_cache(maxsize=1)
def _recorded_shfmt() -> str | None:
    try:
        files = importlib.metadata.distribution("shfmt-py").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((os.path.normpath(f.locate()) for f in files if f.name in ("shfmt", "shfmt.exe")), None)


_TOO_DEEP = "the script nests commands deeper than the reader follows"
# shfmt's JSON is indented, about 1 KB for each word or operator of a script, 5% more for each level of
# nesting it sits in, 8 levels for a $( (measured: a flat 128 KiB script gave 40-54 MB of JSON; 40,000
# array items in 589 KB, 85 MB (shfmt 3.5 s, 0.5 GB); 2,000 nested ifs in 36 KB, 778 MB and 3.2 GB).
MAX_JSON_BYTES = 128 << 20
_NESTING = re.compile(rb"'[^']*'?|#[^\n]*|\\.|\$\(|[(){}]|(?:^|(?<=[\s;&|(!]))(?:if|case|for|while|until|select|fi|esac|done)"
                      rb"(?=[\s;&|)]|$)", re.M)
_TOKENS = re.compile(rb"[\w./:@%+,-]+|[^\w\s]")
_OPENS = {b"(": 1, b"$(": 8, b"{": 1, b"if": 1, b"case": 1, b"for": 1, b"while": 1, b"until": 1, b"select": 1}
_CLOSES = {b")", b"}", b"fi", b"esac", b"done"}


def _json_estimate(data: bytes) -> int:
    """About how many bytes shfmt's JSON of the text takes (more rather than less): a cheap scan of its
    words and its nesting (quotes, comments and keywords roughly as bash sees them) before the process runs."""
    total = at = depth = 0
    stack: list[int] = []

    def cost(start: int, end: int, words: bool = True) -> int:
        return ((len(_TOKENS.findall(data, start, end)) * 1100 if words else 0) + end - start) * (20 + depth) // 20
    for m in _NESTING.finditer(data):
        token = m.group(0)
        total += cost(at, m.start()) + cost(m.start(), m.end(), words=token[:1] not in b"'#")
        at = m.end()
        if token in _OPENS:
            stack.append(_OPENS[token])
            depth += stack[-1]
        elif token in _CLOSES and stack:
            depth -= stack.pop()
    return total + cost(at, len(data))


_ERROR = re.compile(r"^(?:<standard input>:)?(\d+):(\d+): (.*)$")
_RAW_TYPES = {None, "Word", "ParamExp", "CmdSubst", "ArithmExp", "ProcSubst", "ExtGlob"}


def _hook(data: bytes, inserted: list[int] = ()) -> Callable[[dict], Any]:
    """json object_hook: positions become the node's line ("Pos"); words and expansions keep the
    text they were written as ("Raw"), for labels and for values left as written: without the
    backslashes parse() inserted (at the offsets `inserted`, ascending)."""
    def written(start: int, end: int) -> bytes:
        k = bisect.bisect_left(inserted, start)
        out, at = [], start
        while k < len(inserted) and inserted[k] < end:
            out.append(data[at:inserted[k]])
            at, k = inserted[k] + 1, k + 1
        return b"".join(out) + data[at:end]

    def hook(d: dict) -> Any:
        if "Offset" in d and "Line" in d and "Col" in d:
            return (d["Line"], d["Offset"])
        out = {k: v for k, v in d.items() if not isinstance(v, tuple)}
        pos, end, kind = d.get("Pos"), d.get("End"), d.get("Type")
        if isinstance(pos, tuple):
            out["Pos"] = pos[0]
            if isinstance(end, tuple) and kind in _RAW_TYPES and (kind is not None or "Parts" in d):
                out["Raw"] = written(pos[1], end[1]).decode("utf-8", errors="replace")
        if isinstance(d.get("InPos"), tuple) and d["InPos"][0]:
            out["InPos"] = True
        return out
    return hook


_TOO_LARGE = ("the text is too large or nested too deeply to read: its syntax tree would take {size}, the reader "
              f"takes {MAX_JSON_BYTES >> 20} MiB")
_SHFMT_FIX = "pip install --force-reinstall shfmt-py"
# The estimate is a guess (a chain `a && b && ...` or `$((1+1+...))` nests one level per operator); these
# bound the parser itself: the address space of its process and the JSON read from it.
SHFMT_MEMORY_BYTES = 4 << 30


def _run_shfmt(data: bytes) -> tuple[int, bytes, str]:
    """shfmt's exit status, JSON and message for a text. Bounded: an answer over MAX_JSON_BYTES is refused as
    ScriptTooLarge (the process killed), the process's memory is limited to SHFMT_MEMORY_BYTES (it ends with
    Go's 'out of memory'), and one that does not end within SHFMT_TIMEOUT_S is an environment error."""
    binary = shfmt_binary()
    try:   # files, not pipes, for the text and the messages: only the answer is read while it runs
        stdin, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        stdin.write(data)
        stdin.seek(0)
    except OSError as e:
        raise ToolError("environment", f"the text for the shfmt parser needs a temporary file: {e}",
                        fix="set TMPDIR to a writable folder with room") from None
    with stdin, stderr:
        try:
            proc = subprocess.Popen([binary, "--to-json", "-ln", "bash"], stdin=stdin, stdout=subprocess.PIPE,
                                    stderr=stderr, start_new_session=True)
        except OSError as e:
            raise ToolError("environment", f"the shfmt parser ({binary}) did not start: {e}", fix=_SHFMT_FIX) from None
        late: list[bool] = []
        timer = threading.Timer(SHFMT_TIMEOUT_S, _kill, (proc, late))
        try:
            try:
                resource.prlimit(proc.pid, resource.RLIMIT_AS, (SHFMT_MEMORY_BYTES, SHFMT_MEMORY_BYTES))
            except (AttributeError, OSError, ValueError):
                pass   # no prlimit here (not Linux), or the process has already ended
            timer.start()
            answer, size = [], 0
            while chunk := proc.stdout.read(1 << 20):
                size += len(chunk)
                if size > MAX_JSON_BYTES:
                    raise ScriptTooLarge(_TOO_LARGE.format(size=f"more than {MAX_JSON_BYTES >> 20} MiB"), 1)
                answer.append(chunk)
            proc.wait()
        finally:
            timer.cancel()
            _kill(proc)
            proc.stdout.close()
        if late:
            raise ToolError("environment", f"the shfmt parser ({binary}) did not answer within {SHFMT_TIMEOUT_S} s",
                            fix=_SHFMT_FIX)
        stderr.seek(0)
        return proc.returncode, b"".join(answer), stderr.read(1 << 16).decode("utf-8", errors="replace").strip()


def _kill(proc: subprocess.Popen, late: list[bool] | None = None) -> None:
    """End the parser's process group (a wrapper script's children too) if anything of it still runs."""
    if late is not None and proc.poll() is None:
        late.append(True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


def parse(text: str) -> dict:
    """shfmt's File node for a bash text; ShellSyntax where shfmt (and bash) cannot parse it."""
    data = text.replace("\r\n", "\n").encode("utf-8", errors="replace")
    if len(data) > MAX_PARSE_BYTES:
        raise ScriptTooLarge(f"the text is {len(data):,} bytes; the reader parses at most {MAX_PARSE_BYTES:,} "
                             "(a launch script is kilobytes)", 1)
    if (estimate := _json_estimate(data)) > MAX_JSON_BYTES:
        raise ScriptTooLarge(_TOO_LARGE.format(size=f"about {estimate >> 20:,} MiB"), 1)
    inserted: list[int] = []
    for _ in range(MAX_BRACKET_RETRIES + 1):
        returncode, answer, err = _run_shfmt(data)
        if returncode == 0:
            try:
                tree = json.loads(answer, object_hook=_hook(data, inserted))
            except RecursionError:
                raise ScriptTooLarge(_TOO_DEEP, 1) from None
            except ValueError:   # not JSON, or not UTF-8: not shfmt's answer
                tree = None
            if not isinstance(tree, dict) or tree.get("Type") != "File":
                raise ToolError("environment", f"the shfmt parser ({shfmt_binary()}) answered something other "
                                f"than a syntax tree: {answer[:100]!r}", fix=_SHFMT_FIX)
            return tree
        if "exceeded max depth" in err:
            raise ScriptTooLarge(_TOO_DEEP, 1)
        m = _ERROR.match(err.splitlines()[0] if err else "")
        if m is None and re.search(r"^fatal error: (runtime: )?(out of memory|cannot allocate memory)", err, re.M):
            raise ScriptTooLarge(_TOO_LARGE.format(size=f"more than {SHFMT_MEMORY_BYTES >> 30} GiB of memory in "
                                                        "the parser"), 1)
        if m is None:
            raise ToolError("environment", f"the shfmt parser failed: {err[:300] or 'no message'}", fix=_SHFMT_FIX)
        line, col, message = int(m.group(1)), int(m.group(2)), m.group(3)
        # shfmt 3.14 reads an unquoted array item that starts with `[` as an index (`[0]*3+[1]*58` in
        # NVIDIA's DeepSeek-V3 example) and refuses it without the `=`; bash takes it as a word. A
        # backslash before that `[` gives the same word's value to a reader that never globs, and
        # moves no line.
        if message.startswith("`[x]` must be followed by `=`"):
            start = sum(len(x) for x in data.split(b"\n")[:line - 1]) + line - 1
            at = start + col - 1
            if data[at:at + 1] == b"[":
                data = data[:at] + b"\\" + data[at:]
                inserted = sorted([i + (i >= at) for i in inserted] + [at])
                continue
        raise ShellSyntax(message, line)
    raise ShellSyntax("too many array items that start with '['", 1)


def _parts(word: dict | None) -> list[dict]:
    return (word or {}).get("Parts") or []


def _unescape(text: str, escapable: str | None) -> str:
    """A literal's backslashes: unquoted (escapable None) each escapes the next character; in double
    quotes and heredocs only those of `escapable`. A backslash-newline is removed."""
    return re.sub(r"\\(.)" if escapable is None else r"\\([" + re.escape(escapable) + "\n])",
                  lambda m: "" if m.group(1) == "\n" else m.group(1), text, flags=re.S)


_C_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "e": "\x1b", "f": "\f", "v": "\v"}


# ---------------------------------------------------------------- evaluation

@dataclasses.dataclass
class Launch:
    argv: list[str]                  # the whole command, after expansion
    lines: list[int]                 # the script line of each word
    entry_index: int                 # argv[entry_index] is the *.py
    env: dict[str, str]              # exported variables and the command's own assignments
    prefix: list[str]                # words of enclosing commands (srun ... bash -c "...")
    sbatch: dict[str, str]
    where: str                       # "line N" (and the file, for a sourced one)

    @property
    def entry(self) -> str:
        return self.argv[self.entry_index]

    @property
    def args(self) -> list[str]:
        return self.argv[self.entry_index + 1:]

    @property
    def launcher(self) -> list[str]:
        return self.prefix + self.argv[:self.entry_index]


@dataclasses.dataclass
class Path_:
    """One way through the script: its variables, what it launched, which way it went."""
    vars: dict[str, Any]
    exported: set
    funcs: dict[str, dict]           # function bodies: shfmt Stmt nodes
    positional: tuple | None         # None: the script's own arguments, unknown here
    files: dict[str, str]            # files written by heredocs (cat > f <<EOF)
    sbatch: dict[str, str]
    launches: list[Launch]
    choices: list[str]               # the undecided conditions, and the way taken
    unresolved: list[str]
    ended: str | None = None         # "exit at line N"

    def fork(self) -> "Path_":
        return Path_(dict(self.vars), set(self.exported), dict(self.funcs), self.positional, dict(self.files),
                     dict(self.sbatch), list(self.launches), list(self.choices), list(self.unresolved), self.ended)


UNKNOWN = object()   # the value of an assignment from something the script leaves to its caller


class _Return(Exception):
    pass


class _Unknown(Exception):
    """A value that cannot be known without running something."""


@dataclasses.dataclass
class Reading:
    paths: list[Path_]
    notes: list[str]


# an #SBATCH line's option and its value (--nodes=2, --nodes 2, -N 2, -N2, -t01:00:00)
SBATCH_LINE = re.compile(r"^#SBATCH\s+(\S+)(?:[ =]+(\S+))?", re.M)
# sbatch's and srun's one-letter options, by their long names (the names the reader keeps)
SBATCH_SHORT = {"N": "nodes", "n": "ntasks", "G": "gpus", "p": "partition", "t": "time"}


def sbatch_directives(text: str) -> dict[str, str]:
    """The #SBATCH lines' options by long name, -N 2, -N2, --nodes=2 and --nodes 2 alike; a later
    line overrides an earlier one, as sbatch reads them."""
    out: dict[str, str] = {}
    for m in SBATCH_LINE.finditer(text):
        opt, value = m.group(1), m.group(2) or ""
        if opt.startswith("--"):
            name, eq, attached = opt[2:].partition("=")
            out[name] = attached if eq else value
        elif opt.startswith("-") and len(opt) >= 2:
            out[SBATCH_SHORT.get(opt[1], opt[1])] = opt[2:].lstrip("=") or value   # -N2: attached
    return out


ASSIGN_HEAD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[[^\]]*\])?\+?=")
SHELLS = {"bash", "sh", "zsh", "dash"}
DECLARE = {"export", "declare", "typeset", "local", "readonly"}
WRAPPERS = {"env", "exec", "time", "nohup", "command", "builtin", "stdbuf", "nice", "ionice", "numactl", "taskset",
            "timeout", "xargs", "apptainer", "singularity"}
# Commands that name a *.py without starting it.
NOT_LAUNCHERS = {"echo", "printf", "cat", "ls", "cp", "mv", "rm", "mkdir", "touch", "chmod", "chown", "test", "[",
                 "grep", "sed", "awk", "head", "tail", "tee", "wget", "curl", "git", "cd", "pushd", "popd", "find",
                 "du", "wc", "sort", "cut", "ln", "scp", "rsync", "sha256sum", "md5sum", "file", "stat", "diff",
                 "patch", "tar", "unzip", "which", "type", "realpath", "readlink", "dirname", "basename", "vim", "less"}
PURE_SUBST = {"echo", "dirname", "basename", "pwd", "printf", "realpath", "readlink", "cd", "true"}
LIMIT = 1 << 63


class _Fields:
    """The fields a word becomes, built part by part as bash splits them."""

    def __init__(self, split: bool):
        self.split, self.fields, self.cur, self.have, self.unknown = split, [], [], False, False

    def literal(self, text: str) -> None:
        self.cur.append(text)
        self.have = True

    def text(self, text: str) -> None:   # an unquoted expansion's value: split at blanks
        if not self.split:
            return self.literal(text)
        for k, part in enumerate(re.split(r"[ \t\n]+", text)):
            if k > 0:
                self.end_field()
            if part:
                self.literal(part)

    def end_field(self) -> None:
        if self.have or self.cur:
            self.fields.append("".join(self.cur))
        self.cur, self.have = [], False

    def items(self, items: tuple, quoted: bool) -> None:
        for k, item in enumerate(items):
            if k > 0 and not self.split:
                self.cur.append(" ")
            elif k > 0 and quoted:
                self.fields.append("".join(self.cur))
                self.cur, self.have = [], False
            if quoted or not self.split:
                self.literal(item)
            else:
                self.text((" " if k > 0 else "") + item)

    def done(self) -> list[str]:
        if self.have or self.cur:
            self.fields.append("".join(self.cur))
        return self.fields


class Reader:
    def __init__(self, script_path: Path | None, env: dict[str, str] | None,
                 positional: tuple[str, ...] | None = None):
        self.script_path = script_path
        self.base = script_path.parent if script_path else None
        self.env = dict(env or {})
        self.positional = positional   # the script's own arguments ($1 ...); None: unknown
        self.steps = 0
        self.depth = 0
        self.notes: list[str] = []
        self.where_file = ""
        self.src: list[str] = []
        self._current: Path_ | None = None
        self._trees: dict[str, dict | ShellSyntax] = {}
        self._parsed = 0
        self._arith_depth = 0

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # -------------------------------------------------------------- driver
    def parse(self, text: str) -> dict:
        """The text's tree, parsed once per read; a read parses MAX_PARSES texts, MAX_READ_BYTES in all."""
        tree = self._trees.get(text)
        if tree is None:
            self._parsed += len(text)
            try:
                if self._parsed > MAX_READ_BYTES or len(self._trees) >= MAX_PARSES:
                    raise ScriptTooLarge(f"the script and what it runs are more than {MAX_READ_BYTES:,} bytes or "
                                         f"{MAX_PARSES} texts", 1)
                tree = parse(text)
            except ShellSyntax as e:
                tree = e
            self._trees[text] = tree
        if isinstance(tree, ShellSyntax):
            raise tree
        return tree

    def read(self, text: str) -> Reading:
        start = Path_(vars={**{k: v for k, v in self.env.items()}}, exported=set(self.env), funcs={},
                      positional=self.positional, files={}, sbatch={}, launches=[], choices=[], unresolved=[])
        start.vars.setdefault("0", str(self.script_path or "script.sh"))
        start.sbatch.update(sbatch_directives(text))
        paths = self.run_text(text, [start], "")
        return Reading(paths, self.notes)

    def run_text(self, text: str, paths: list[Path_], where_file: str) -> list[Path_]:
        saved, self.where_file = self.where_file, where_file
        saved_src, self.src = self.src, text.splitlines()
        try:
            try:
                tree = self.parse(text)
            except ShellSyntax as e:
                if self.depth == 0:
                    raise
                self.note(f"{where_file or 'nested script'} line {e.line}: not read ({e})")
                return paths
            return self.eval(tree.get("Stmts") or [], paths)
        finally:
            self.where_file, self.src = saved, saved_src

    def eval(self, stmts: list[dict], paths: list[Path_]) -> list[Path_]:
        for stmt in stmts:
            paths = self.stmt(stmt, paths)
        return paths

    def stmt(self, stmt: dict, paths: list[Path_]) -> list[Path_]:
        live = [p for p in paths if p.ended is None]
        if not live:
            return paths
        done = [p for p in paths if p.ended is not None]
        self.steps += 1
        if self.steps > MAX_STEPS:
            self.note(f"stopped after {MAX_STEPS:,} commands: the rest of the script was not read")
            for p in live:
                p.ended = p.ended or "not read further (too many commands)"
            return done + live
        cmd = stmt.get("Cmd")
        if cmd is None or stmt.get("Negated"):
            return done + live   # `! cmd` on its own, a test, changes nothing we read
        kind = cmd["Type"]
        if kind == "BinaryCmd" and cmd["Op"] in ("&&", "||"):
            return done + self.andor(_andor(cmd), live)
        if kind == "BinaryCmd":   # a pipeline: each command in turn
            return done + self.stmt(cmd["Y"], self.stmt(cmd["X"], live))
        if kind == "Block":
            return done + self.eval(cmd.get("Stmts") or [], live)
        if kind == "TimeClause" and cmd.get("Stmt"):
            saved, self._prefix = self._prefix, self._prefix + ["time"] + (["-p"] if cmd.get("PosixFormat") else [])
            try:
                return done + self.stmt(cmd["Stmt"], live)
            finally:
                self._prefix = saved
        one = {"CallExpr": lambda p: self.command(cmd, stmt, p), "DeclClause": lambda p: self.declare(cmd, p),
               "Subshell": lambda p: self.subshell(cmd, p), "IfClause": lambda p: self.if_(cmd, p),
               "CaseClause": lambda p: self.case(cmd, p), "ForClause": lambda p: self.for_(cmd, p),
               "WhileClause": lambda p: self.while_(cmd, p), "ArithmCmd": lambda p: self._arith_effect([cmd["X"]], p),
               "LetClause": lambda p: self._arith_effect(cmd.get("Exprs") or [], p),
               "FuncDecl": lambda p: p.funcs.update({cmd["Name"]["Value"]: cmd["Body"]})}
        return done + (self._each(live, one[kind]) if kind in one else live)

    def _arith_effect(self, exprs: list[dict], p: Path_) -> None:
        """(( N++ )) and let on their own: their assignments."""
        self._current = p
        try:
            for x in exprs:
                self.arith(x, p)
        except _Unknown:
            pass

    def subshell(self, node: dict, p: Path_) -> list[Path_]:
        saved_vars, saved_exp = dict(p.vars), set(p.exported)
        outs = self.eval(node.get("Stmts") or [], [p])
        for q in outs:
            q.vars, q.exported = dict(saved_vars), set(saved_exp)
            if q.ended and q.ended.startswith("exit"):
                q.ended = None
        return outs

    def _each(self, paths: list[Path_], fn: Callable[[Path_], list[Path_] | None]) -> list[Path_]:
        out = []
        for p in paths:
            res = fn(p)
            out.extend([p] if res is None else res)
        return out

    # -------------------------------------------------------------- conditions
    def truth(self, node: Any, p: Path_) -> bool | None:
        """Whether a condition (a list of statements, or one) succeeds, or None when that cannot be
        known here."""
        self._current = p
        try:
            if isinstance(node, list):
                value = True
                for stmt in node:
                    value = self.truth(stmt, p)
                return value
            cmd = node.get("Cmd")
            if node.get("Negated"):
                value = self.truth({"Cmd": cmd}, p)
                return None if value is None else not value
            kind = (cmd or {}).get("Type")
            if kind == "BinaryCmd" and cmd["Op"] in ("&&", "||"):
                parts = _andor(cmd)
                value = self.truth(parts[0][1], p)
                for op, part in parts[1:]:
                    if op == "&&" and value is False or op == "||" and value is True:
                        continue
                    right = self.truth(part, p)
                    if value is None:
                        value = None if right is None or (op == "&&" and right) or (op == "||" and not right) \
                            else right
                    else:
                        value = right
                return value
            if kind == "CallExpr":
                return self.command_truth(cmd, p)
            if kind == "TestClause":
                return self.test(cmd["X"], p)
            if kind == "ArithmCmd":
                return self.arith(cmd["X"], p) != 0
        except _Unknown:
            return None
        return None

    def command_truth(self, cmd: dict, p: Path_) -> bool | None:
        words = cmd.get("Args") or []
        if not words:
            return True
        name = words[0]["Raw"]
        if name in ("true", ":"):
            return True
        if name == "false":
            return False
        if name in ("[", "test"):
            words = words[1:]
            if name == "[":
                if not words or words[-1]["Raw"] != "]":
                    return None
                words = words[:-1]
            ops = ("&&", "||", "!", "(", ")", "-a", "-o")
            w = [x["Raw"] if x["Raw"] in ops else self._test_word(x, p, split=True) for x in words]
            value, rest = self._cond_or(w)
            return value if not rest else None
        return None

    def _test_word(self, word: dict, p: Path_, split: bool = False) -> str:
        fields, unknown = self.expand(word, p, split=split)
        if unknown:
            raise _Unknown()
        return fields[0] if split and len(fields) == 1 else " ".join(fields)

    def test(self, node: dict, p: Path_) -> bool | None:
        """A [[ ]] test; every word is expanded (an unknown one makes the whole test unknown)."""
        kind, op = node["Type"], node.get("Op")
        if kind == "ParenTest":
            return self.test(node["X"], p)
        if kind == "UnaryTest" and op == "!":
            value = self.test(node["X"], p)
            return None if value is None else not value
        if kind == "UnaryTest":
            return self._unary(op, self._test_word(node["X"], p))
        if kind == "BinaryTest" and op in ("&&", "||"):
            a, b, decides = self.test(node["X"], p), self.test(node["Y"], p), op == "||"
            return decides if decides in (a, b) else (None if None in (a, b) else not decides)
        if kind == "BinaryTest":
            return self._binary(self._test_word(node["X"], p), op, self._test_word(node["Y"], p), double=True)
        return self._test_word(node, p) != ""

    def _cond_or(self, w: list[str], ops: tuple = ("||", "-o")) -> tuple[bool | None, list[str]]:
        """[ a -o b ] over a -a b (which binds closer): True decides an -o, False an -a."""
        decides = ops[0] == "||"
        operand = (lambda x: self._cond_or(x, ("&&", "-a"))) if decides else self._cond_not
        value, w = operand(w)
        while w and w[0] in ops:
            right, w = operand(w[1:])
            value = decides if decides in (value, right) else (None if None in (value, right) else not decides)
        return value, w

    def _cond_not(self, w: list[str]) -> tuple[bool | None, list[str]]:
        if w and w[0] == "!":
            value, w = self._cond_not(w[1:])
            return (None if value is None else not value), w
        if w and w[0] == "(":
            value, w = self._cond_or(w[1:])
            return value, (w[1:] if w and w[0] == ")" else w)
        if not w:
            return False, w
        if len(w) >= 3 and w[1] in ("==", "=", "!=", "=~", "-eq", "-ne", "-lt", "-le", "-gt", "-ge", "<", ">"):
            return self._binary(w[0], w[1], w[2], double=False), w[3:]
        if len(w) >= 2 and re.fullmatch(r"-[a-zA-Z]", w[0]):
            return self._unary(w[0], w[1]), w[2:]
        return w[0] != "", w[1:]

    def _binary(self, a: str, op: str, b: str, double: bool) -> bool | None:
        if op in ("==", "=", "!="):
            same = fnmatch.fnmatchcase(a, b) if double else a == b
            return same if op != "!=" else not same
        if op == "=~":
            try:
                return re.search(b, a) is not None
            except re.error:
                return None
        if op in ("<", ">"):
            return (a < b) if op == "<" else (a > b)
        try:
            x, y = int(a or 0), int(b or 0)
        except ValueError:
            return None
        return {"-eq": x == y, "-ne": x != y, "-lt": x < y, "-le": x <= y, "-gt": x > y, "-ge": x >= y}.get(op)

    def _unary(self, op: str, a: str) -> bool | None:
        if op == "-z":
            return a == ""
        if op == "-n":
            return a != ""
        if op == "-v":
            return a in self._current.vars
        return None  # files, terminals: the machine decides

    # -------------------------------------------------------------- compound commands
    def andor(self, parts: list[tuple[str | None, dict]], paths: list[Path_]) -> list[Path_]:
        paths = self.stmt(parts[0][1], paths)
        prev = parts[0][1]
        for op, part in parts[1:]:
            out = []
            for p in paths:
                if p.ended:
                    out.append(p)
                    continue
                value = self.truth(prev, p)
                if value is None:
                    value = True  # commands are taken to succeed: `mkdir -p x || exit 1` goes on
                runs = value if op == "&&" else not value
                out.extend(self.stmt(part, [p]) if runs else [p])
            paths, prev = out, part
        return paths

    def branch(self, p: Path_, label: str, ways: list[tuple[str, Any]]) -> list[Path_]:
        """Follow each way (a label and the statements to run) on its own copy of p."""
        room = MAX_PATHS - self._live_paths + 1
        if room < len(ways):
            self.note(f"more than {MAX_PATHS} paths through the script: at {label} and later, only the first way "
                      "is followed")
            ways = ways[:1]
        out = []
        for i, (how, body) in enumerate(ways):
            q = p if i == len(ways) - 1 else p.fork()
            if len(ways) > 1:
                q.choices.append(f"{label}: {how}")
            out.extend(self.eval(body, [q]) if body is not None else [q])
        self._live_paths += len(ways) - 1
        return out

    _live_paths = 1

    def if_(self, node: dict, p: Path_) -> list[Path_]:
        ways, clause, tried = [], node, []
        while clause is not None:
            cond = clause.get("Cond")
            if not cond:
                ways.append(("the else branch", clause.get("Then") or []))
                break
            value = self.truth(cond, p)
            tried.append(self.source_line(cond[0]["Pos"]))
            if value is not False:
                ways.append((f"{tried[-1]} true", clause.get("Then") or []))
            if value is True:
                break
            clause = clause.get("Else")
        else:
            ways.append((" and ".join(tried) + " false" if len(tried) == 1 else "no condition true", None))
        return self.branch(p, f"if at {self.where(node['Pos'])}", ways)

    def where(self, line: int) -> str:
        """line N, and inside what: 'line 5 of bash -c at line 13 of the heredoc at line 219'."""
        return f"line {line}" + (f" of {self.where_file}" if self.where_file else "")

    def source_line(self, line: int) -> str:
        """The condition as written, for a path's label: `[[ "$DTYPE" == "fp8" ]]`."""
        text = self.src[line - 1].strip() if 0 < line <= len(self.src) else ""
        text = re.sub(r"^(el)?if\s+|;?\s*then\s*$", "", text)
        return "`" + (text[:77] + "..." if len(text) > 80 else text) + "`"

    def case(self, node: dict, p: Path_) -> list[Path_]:
        fields, unknown = self.expand(node["Word"], p, split=False)
        subject = " ".join(fields)
        ways: list = []
        items = node.get("Items") or []
        hit, falls = None, False   # a known subject: the bodies bash runs (;& falls into the next body,
        for k, item in enumerate(items):   # ;;& goes on testing the patterns after it)
            patterns = item.get("Patterns") or []
            body = list(item.get("Stmts") or [])
            if unknown:
                j = k
                while items[j].get("Op") == ";&" and j + 1 < len(items):
                    j += 1
                    body += items[j].get("Stmts") or []
                ways.append((f"'{'|'.join(w['Raw'] for w in patterns)})'", body))
            elif falls or any(fnmatch.fnmatchcase(subject, " ".join(self.expand(w, p, split=False)[0]))
                              for w in patterns):
                hit = (hit or []) + body
                falls = item.get("Op") == ";&"
                if item.get("Op") not in (";&", ";;&"):
                    break
        if hit is not None:
            ways = [("match", hit)]
        if unknown:
            ways.append(("no pattern matched", None))
        return self.branch(p, f"case {node['Word']['Raw']} at {self.where(node['Pos'])}", ways) if ways else [p]

    def for_(self, node: dict, p: Path_) -> list[Path_]:
        loop, body = node["Loop"], node.get("Do") or []
        if loop["Type"] != "WordIter":  # for ((...)): run the body once, its count is rarely what matters
            self.note(f"line {node['Pos']}: an arithmetic for loop is read once")
            return self.eval(body, [p])
        name = loop["Name"]["Value"]
        items = [f for w in loop.get("Items") or [] for f in self.expand(w, p)[0]] if loop.get("InPos") \
            else list(p.positional or ())
        cur = [p]
        for item in items[:MAX_LOOP]:
            for q in cur:
                q.vars[name] = item
            cur = self.eval(body, cur)
        return cur

    def while_(self, node: dict, p: Path_) -> list[Path_]:
        kind = "until" if node.get("Until") else "while"
        cur = [p]
        for _ in range(MAX_LOOP):
            value = self.truth(node.get("Cond") or [], cur[0]) if len(cur) == 1 else None
            if kind == "until" and value is not None:
                value = not value
            if value is None:
                self.note(f"line {node['Pos']}: a {kind} loop whose condition is not known here is not followed")
            if not value:
                break
            cur = self.eval(node.get("Do") or [], cur)
            if not cur:
                break
        return cur

    # -------------------------------------------------------------- simple commands
    def command(self, cmd: dict, stmt: dict, p: Path_) -> list[Path_] | None:
        self._current = p
        argv, lines = [], []
        for word in cmd.get("Args") or []:
            fields = self.expand(word, p)[0]
            argv += fields
            lines += [word["Pos"]] * len(fields)
        if not argv:
            for a in cmd.get("Assigns") or []:
                self.assign(a, p, export=False)
            return None
        prefix_env = {}
        for a in cmd.get("Assigns") or []:
            name, value = self._assignment_value(a, p)
            if isinstance(value, str):
                prefix_env[name] = value
        return self.run_argv(argv, lines, cmd["Pos"], stmt.get("Redirs") or [], p, prefix_env)

    def declare(self, node: dict, p: Path_, words: list[Any] | None = None, variant: str | None = None) -> None:
        """export, declare, local ...: the clause's Assign nodes, or the words of a command (env export A=1)."""
        variant = variant or node["Variant"]["Value"]
        items: list[Any] = []
        for a in (node.get("Args") or []) if words is None else words:
            if isinstance(a, str):
                items.append(a)
            elif a.get("Naked") and "Name" in a:
                items.append(a["Name"]["Value"])
            elif a.get("Naked"):
                items += self.expand(a.get("Value"), p)[0]
            else:
                items.append(a)
        opts = [a for a in items if isinstance(a, str) and a.startswith("-")]
        export = variant == "export" or any("x" in o for o in opts)
        for a in items:
            if not isinstance(a, str):
                self.assign(a, p, export=export)
            elif ASSIGN_HEAD.match(a):
                name, value = a.split("=", 1)
                name = name.rstrip("+").split("[")[0]
                p.vars[name] = value
                if export:
                    p.exported.add(name)
            elif not a.startswith("-") and re.fullmatch(r"[A-Za-z_]\w*", a):
                if export:
                    p.exported.add(a)
                if variant != "export":
                    p.vars.setdefault(a, "" if "-a" not in opts else ())

    def run_argv(self, argv: list[str], lines: list[int], line: int, redirs: list[dict], p: Path_,
                 prefix_env: dict[str, str], prefix: list[str] | None = None) -> list[Path_] | None:
        name = argv[0]
        prefix = prefix or []
        if name in DECLARE:
            return self.declare({}, p, argv[1:], name)
        if name == "unset":
            for a in argv[1:]:
                if not a.startswith("-"):
                    p.vars.pop(a, None)
                    p.exported.discard(a)
            return None
        if name == "set":
            if "--" in argv:
                p.positional = tuple(argv[argv.index("--") + 1:])
            return None
        if name == "shift":
            k = int(argv[1]) if len(argv) > 1 and argv[1].isdigit() else 1
            if p.positional is not None:
                p.positional = p.positional[k:]
            return None
        if name in ("exit",):
            p.ended = f"exit at line {line}"
            return None
        if name == "return":
            raise _Return()
        if name in ("source", "."):
            return self.source(argv[1:], p)
        if name == "eval":
            return self.nested(" ".join(argv[1:]), p, f"eval at line {line}", prefix)
        if name in p.funcs:
            return self.call(name, argv[1:], p, line)
        if name in WRAPPERS or "=" in name and re.match(r"[A-Za-z_]\w*=", name):
            rest = argv[1:]
            while rest and (rest[0].startswith("-") or re.match(r"[A-Za-z_]\w*=", rest[0])):
                if "=" in rest[0] and not rest[0].startswith("-"):
                    k, v = rest[0].split("=", 1)
                    prefix_env[k] = v
                rest = rest[1:]
            if rest and rest != argv:
                k = len(argv) - len(rest)
                return self.run_argv(rest, lines[k:], line, redirs, p, prefix_env, prefix + argv[:k])
        # A *.py among the words: the launch (torchrun, python, srun ... python, deepspeed ...).
        entry = None if Path(name).name in NOT_LAUNCHERS else _entry_index(argv)
        shell_c = self._shell_c_index(argv)
        if shell_c is not None and (entry is None or entry > shell_c):
            k = shell_c
            shell_word = next(w for w in argv[:k] if Path(w).name in SHELLS)
            return self.nested(argv[k], p, f"{Path(shell_word).name} -c at {self.where(line)}", prefix + argv[:k - 1])
        if entry is not None:
            env = {k: v for k, v in p.vars.items() if k in p.exported and isinstance(v, str)}
            env.update(prefix_env)
            where = self.where(lines[entry])
            p.launches.append(Launch(argv=argv, lines=lines, entry_index=entry, env=env, prefix=self._prefix + prefix,
                                     sbatch=dict(p.sbatch), where=where))
            return None
        # A script run through a shell or sbatch: from a heredoc, a file written earlier, or next to us.
        base = next((i for i, w in enumerate(argv) if Path(w).name in SHELLS | {"sbatch", "srun"}), None)
        if base is not None:
            is_sbatch = Path(argv[base]).name == "sbatch"
            if is_sbatch:
                self._sbatch_options(argv[base + 1:], p)
            for r in redirs:
                if r["Op"] in ("<<", "<<-"):
                    return self.nested(self._heredoc_text(r, p), p, f"the heredoc at {self.where(r['Pos'])}",
                                       prefix + argv[:base + 1], sbatch=is_sbatch)
            script = next((w for w in argv[base + 1:] if not w.startswith("-") and (w.endswith((".sh", ".sbatch", ".slurm"))
                                                                                 or w in p.files)), None)
            if script is not None:
                text = self._file_text(script, p)
                if text is not None:
                    return self.nested(text, p, script, prefix + argv[:base + 1], sbatch=is_sbatch)
        if name in ("cat", "tee"):
            self._write_heredoc(argv, redirs, p)
        return None

    def _shell_c_index(self, argv: list[str]) -> int | None:
        for i, w in enumerate(argv[:-1]):
            if Path(w).name in SHELLS:
                j = i + 1
                while j < len(argv) and argv[j].startswith("-") and argv[j] != "--":
                    if "c" in argv[j][1:] and not argv[j].startswith("--"):
                        return j + 1 if j + 1 < len(argv) else None
                    j += 1
                return None
        return None

    def _sbatch_options(self, words: list[str], p: Path_) -> None:
        aliases = SBATCH_SHORT
        i = 0
        while i < len(words) and words[i].startswith("-"):
            w = words[i]
            if w.startswith("--") and "=" in w:
                k, v = w[2:].split("=", 1)
                p.sbatch[k] = v
            elif i + 1 < len(words) and (w.startswith("--") or w[1:] in aliases):
                p.sbatch[aliases.get(w[1:], w.lstrip("-"))] = words[i + 1]
                i += 1
            i += 1

    def _heredoc_text(self, redir: dict, p: Path_) -> str:
        """A heredoc's body: as written when its delimiter is quoted, else expanded."""
        quoted = any(part["Type"] != "Lit" or "\\" in part.get("Value", "") for part in _parts(redir.get("Word")))
        body = self._quoted_text(redir.get("Hdoc"), p, "$`\\", quoted)
        if redir["Op"] == "<<-":
            body = re.sub(r"(?m)^\t+", "", body)
        return body

    def _write_heredoc(self, argv: list[str], redirs: list[dict], p: Path_) -> None:
        body = next((self._heredoc_text(r, p) for r in redirs if r["Op"] in ("<<", "<<-")), None)
        if body is None:
            return
        targets = [" ".join(self.expand(r.get("Word"), p, split=False)[0]) for r in redirs
                   if r["Op"] in (">", ">|") and (r.get("N") or {}).get("Value", "1") == "1"]
        targets += [w for w in argv[1:] if not w.startswith("-")] if argv[0] == "tee" else []
        for t in targets:
            p.files[t] = body

    def _file_text(self, name: str, p: Path_) -> str | None:
        if name in p.files:
            return p.files[name]
        if self.base is None:
            return None
        path = Path(name)
        for candidate in ([path] if path.is_absolute() else [self.base / path, self.base / path.name]):
            try:
                if candidate.is_file() and candidate.stat().st_size <= MAX_FILE_BYTES:
                    data = candidate.read_bytes()
                    if b"\0" not in data:
                        return data.decode("utf-8", errors="replace")
            except OSError:
                continue
        self.note(f"{name} is not next to the script: not read")
        return None

    def nested(self, text: str, p: Path_, where: str, prefix: list[str], sbatch: bool = False) -> list[Path_]:
        if self.depth >= MAX_DEPTH:
            self.note(f"{where}: nested deeper than {MAX_DEPTH} levels, not read")
            return [p]
        if sbatch:
            for k, v in sbatch_directives(text).items():
                p.sbatch.setdefault(k, v)
        self.depth += 1
        saved = self._prefix
        self._prefix = saved + prefix
        try:
            outs = self.run_text(text, [p], where)
        finally:
            self.depth -= 1
            self._prefix = saved
        return outs

    _prefix: list[str] = []

    def source(self, args: list[str], p: Path_) -> list[Path_] | None:
        if not args:
            return None
        text = self._file_text(args[0], p)
        if text is None:
            return None
        saved = p.positional
        if len(args) > 1:
            p.positional = tuple(args[1:])
        outs = self.nested(text, p, args[0], [])
        for q in outs:
            q.positional = saved if len(args) > 1 else q.positional
        return outs

    def call(self, name: str, args: list[str], p: Path_, line: int) -> list[Path_]:
        if self.depth >= MAX_DEPTH:
            self.note(f"line {line}: {name} calls itself deeper than {MAX_DEPTH} levels; not followed")
            return [p]
        saved = p.positional
        p.positional = tuple(args)
        self.depth += 1
        try:
            outs = self.stmt(p.funcs[name], [p])
        except _Return:
            outs = [p]
        finally:
            self.depth -= 1
        for q in outs:
            q.positional = saved
        return outs

    # -------------------------------------------------------------- variables
    def assign(self, node: dict, p: Path_, export: bool) -> None:
        name, value = self._assignment_value(node, p)
        if value is UNKNOWN:   # X=$Y with Y left to the caller: X is as unknown as Y
            p.vars.pop(name, None)
        else:
            p.vars[name] = value
        if export:
            p.exported.add(name)

    def _assignment_value(self, node: dict, p: Path_) -> tuple[str, Any]:
        name, append, index = node["Name"]["Value"], node.get("Append"), node.get("Index")
        old = p.vars.get(name, "")
        if "Array" in node and index is None:
            # [k]=v places an item, the items after it follow from k+1; "${A[@]}" gives them in index
            # order without the unset ones between (no empty words for a gap)
            placed: dict[int, str] = {}
            at = 0
            for elem in node["Array"].get("Elems") or []:
                values = self.expand(elem.get("Value"), p)[0]
                k = self._index(elem.get("Index"), p)
                if k is not None:
                    values, at = [" ".join(values)], k
                for v in values:
                    placed[at] = v
                    at += 1
            items = tuple(placed[k] for k in sorted(placed))
            old = () if name not in p.vars else (old,) if isinstance(old, str) else old   # A+=(x), A unset: (x)
            return name, tuple(old) + items if append else items
        fields, unknown = self.expand(node.get("Value"), p, split=False)
        text = " ".join(fields)
        if unknown and index is None and not append and _bare_parameter(node.get("Value")):
            return name, UNKNOWN   # X=$Y, Y left to the caller: X as unknown as Y (a longer text keeps it literal)
        if index is not None:  # A[i]=v
            arr = list((old,) if isinstance(old, str) else old)
            k = self._index(index, p)
            if k is not None:
                arr += [""] * (k + 1 - len(arr))
                arr[k] = text
            return name, tuple(arr)
        if append:
            if isinstance(old, tuple):
                return name, old + (text,)
            return name, old + text
        return name, text

    def _index(self, index: dict | None, p: Path_) -> int | None:
        try:
            k = self.arith(index, p) if index is not None else None
        except _Unknown:
            return None
        return k if k is not None and 0 <= k < 4096 else None

    def lookup(self, name: str, p: Path_) -> str | tuple | None:
        if name.isdigit() and name != "0":
            if p.positional is None:
                return None
            k = int(name)
            return p.positional[k - 1] if k <= len(p.positional) else ""
        if name == "#":
            return None if p.positional is None else str(len(p.positional))
        if name in ("@", "*"):
            return None if p.positional is None else tuple(p.positional)
        if name in p.vars:
            return p.vars[name]
        if name == "BASH_SOURCE":
            return (str(self.script_path or "script.sh"),)
        if name in ("PWD",) and self.base is not None:
            return str(self.base)
        return None

    def unresolved(self, name: str, p: Path_) -> None:
        if name not in p.unresolved and name not in ("@", "*"):
            p.unresolved.append(name)

    # -------------------------------------------------------------- expansion
    def expand(self, word: dict | None, p: Path_, split: bool = True) -> tuple[list[str], bool]:
        """The fields a word becomes, and whether any part of it is unknown (kept as written)."""
        out = _Fields(split)
        for part in _parts(word):
            kind = part["Type"]
            if kind == "Lit":
                out.literal(_unescape(part.get("Value", ""), None))
            elif kind == "SglQuoted":
                value = part.get("Value", "")
                if part.get("Dollar"):
                    value = re.sub(r"\\(.)", lambda m: _C_ESCAPES.get(m.group(1), m.group(1)), value, flags=re.S)
                out.literal(value)
            elif kind == "DblQuoted":
                inner = part.get("Parts") or []
                # "${A[@]}" of an empty array (or "$@" with no arguments) is no word at all
                if not (len(inner) == 1 and _all_items(inner[0])):
                    out.have = True
                for piece, unk in self._quoted(inner, p, '$`"\\'):
                    out.unknown |= unk
                    if isinstance(piece, tuple):
                        out.items(piece, quoted=True)
                    else:
                        out.cur.append(piece)
            elif kind in ("ParamExp", "CmdSubst", "ArithmExp"):
                value, unk, items = self._dollar(part, p, quoted=False)
                out.unknown |= unk
                if unk:
                    out.literal(value)   # kept as written, one piece
                elif items is not None:
                    out.items(items, quoted=False)
                else:
                    out.text(value)
            else:   # <(...), extended globs: kept as written
                out.unknown |= kind == "ProcSubst"
                out.literal(part.get("Raw", ""))
        return out.done(), out.unknown

    def _quoted_text(self, word: dict | None, p: Path_, escapable: str, as_written: bool = False) -> str:
        """A heredoc body: its text, expanded unless its delimiter was quoted."""
        if as_written:
            return "".join(part.get("Value", part.get("Raw", "")) for part in _parts(word))
        return "".join(" ".join(x) if isinstance(x, tuple) else x for x, _ in self._quoted(_parts(word), p, escapable))

    def _quoted(self, parts: list[dict], p: Path_, escapable: str) -> list[tuple[str | tuple, bool]]:
        """The pieces of a double-quoted text or a heredoc body: text, or what a $-expansion gives
        (its text or its array items), each with whether it is unknown."""
        pieces: list[tuple[str | tuple, bool]] = []
        for part in parts:
            if part["Type"] == "Lit":
                pieces.append((_unescape(part.get("Value", ""), escapable), False))
            elif part["Type"] in ("ParamExp", "CmdSubst", "ArithmExp"):
                value, unk, items = self._dollar(part, p, quoted=True)
                pieces.append((value if items is None else items, unk))
            else:
                pieces.append((part.get("Raw", part.get("Value", "")), False))
        return pieces

    def _dollar(self, part: dict, p: Path_, quoted: bool) -> tuple[str, bool, tuple | None]:
        """Expand a $-part: (text, unknown, array items or None); unknown: the text as written."""
        try:
            if part["Type"] == "CmdSubst":
                return self.substitute(part.get("Stmts") or [], p), False, None
            if part["Type"] == "ArithmExp":
                return str(self.arith(part["X"], p)), False, None
            return self._param(part, p, quoted)
        except _Unknown:
            return part["Raw"], True, None

    def substitute(self, stmts: list[dict], p: Path_) -> str:
        """$(...) of the pure commands (echo, dirname, basename, pwd, cd X && pwd); else unknown."""
        cwd = str(self.base) if self.base else "."
        out = []
        for stmt in stmts:
            cmd = stmt.get("Cmd") or {}
            cmds = [s.get("Cmd") or {} for _, s in _andor(cmd)] if cmd.get("Op") in ("&&", "||") else [cmd]
            for c in cmds:
                if stmt.get("Negated") or c.get("Type") != "CallExpr":
                    raise _Unknown()
                argv = []
                for w in c.get("Args") or []:
                    fields, unk = self.expand(w, p)
                    if unk:
                        raise _Unknown()
                    argv += fields
                if not argv or argv[0] not in PURE_SUBST:
                    raise _Unknown()
                name, args = argv[0], [a for a in argv[1:] if not a.startswith("-")]
                if name == "echo":
                    out.append(" ".join(argv[1:]))
                elif name == "printf":
                    out.append(" ".join(args[1:]) if args and "%s" in args[0] else (args[0] if args else ""))
                elif name == "dirname":
                    out.append(str(Path(args[0]).parent) if args else ".")
                elif name == "basename":
                    b = Path(args[0]).name if args else ""
                    out.append(b[: -len(args[1])] if len(args) > 1 and b.endswith(args[1]) else b)
                elif name == "cd":
                    cwd = str(Path(cwd) / args[0]) if args else cwd
                elif name == "pwd":
                    out.append(cwd)
                elif name in ("realpath", "readlink"):
                    out.append(str(Path(cwd) / args[0]) if args else cwd)
        return "\n".join(out).rstrip("\n")

    def _param(self, part: dict, p: Path_, quoted: bool) -> tuple[str, bool, tuple | None]:
        """$V and ${...}: raises _Unknown where the value is not known."""
        name = part["Param"]["Value"]
        if name in ("?", "$", "!", "-") or part.get("Names") or part.get("Width"):
            raise _Unknown()
        value = self.lookup(name, p)
        if part.get("Short") and name in ("@", "*") and value is None:
            return "", False, ()   # the script's own arguments: nothing known, nothing added
        if part.get("Excl") and isinstance(value, str):
            name, value = value, self.lookup(value, p)
        index = part.get("Index")
        at = _literal(index) if index is not None else None
        if isinstance(value, tuple) and index is None and name not in ("@", "*"):
            value = value[0] if value else ""
        exp = part.get("Exp") or {}
        if index is not None and value is not None:
            arr = value if isinstance(value, tuple) else (value,)
            if at in ("@", "*"):
                if part.get("Length"):
                    return str(len(arr)), False, None
                items = self._slice(arr, part, p) if part.get("Slice") else tuple(self._apply_op(x, part, p) for x in arr)
                return (" ".join(items), False, None) if at == "*" and quoted else ("", False, items)
            k = self.arith(index, p)
            value = arr[k] if -len(arr) <= k < len(arr) else ""
        if part.get("Length"):
            if value is None:
                self.unresolved(name, p)
                raise _Unknown()
            return str(len(value)), False, None
        if name in ("@", "*") and isinstance(value, tuple):
            items = self._slice((self.lookup("0", p) or "",) + value, part, p) if part.get("Slice") else value
            return (" ".join(items), False, None) if name == "*" and quoted else ("", False, items)
        op = exp.get("Op", "")
        if op.lstrip(":") in ("-", "=", "+", "?"):
            is_set = value is not None and not (op.startswith(":") and value == "")
            if op.endswith("+"):
                return (self._word(exp.get("Word"), p) if is_set else ""), False, None
            if is_set:
                return value, False, None
            if op.endswith("?"):
                self.unresolved(name, p)
                raise _Unknown()
            fill = self._word(exp.get("Word"), p)
            if op.endswith("="):
                p.vars[name] = fill
            return fill, False, None
        if value is None:
            self.unresolved(name, p)
            raise _Unknown()
        return self._apply_op(value, part, p), False, None

    def _slice(self, items: tuple, part: dict, p: Path_) -> tuple:
        """${A[@]:o:n} and ${@:o:n} take n items from the o-th (counted from the end when negative): a slice
        of the array, not of each item's text. ${@:0} starts at $0, so the caller passes it first."""
        start = self.arith(part["Slice"]["Offset"], p) if part["Slice"].get("Offset") else 0
        if start < 0 and (start := start + len(items)) < 0:
            return ()
        if not part["Slice"].get("Length"):
            return items[start:]
        n = self.arith(part["Slice"]["Length"], p)
        if n < 0:
            raise _Unknown()   # bash refuses it: "substring expression < 0"
        return items[start:start + n]

    def _word(self, word: dict | None, p: Path_) -> str:
        fields, unknown = self.expand(word, p, split=False)
        if unknown:
            raise _Unknown()
        return " ".join(fields)

    def _apply_op(self, value: str, part: dict, p: Path_) -> str:
        """${V#p} ${V%p} ${V/p/r} ${V:o:n} ${V^^} ${V,,} on one value."""
        op = (part.get("Exp") or {}).get("Op", "")
        if op in ("#", "##", "%", "%%"):
            return _strip(value, self._word(part["Exp"].get("Word"), p), longest=len(op) == 2, suffix=op[0] == "%")
        if part.get("Repl"):
            repl = part["Repl"]
            pat = fnmatch.translate(self._word(repl.get("Orig"), p)).removesuffix(r"\Z")
            pat = pat.removeprefix("(?s:").removesuffix(")")
            rep = self._word(repl.get("With"), p)
            try:
                return re.sub(pat, lambda _: rep, value, count=0 if repl.get("All") else 1)
            except re.error:
                return value
        if part.get("Slice"):
            start = self.arith(part["Slice"]["Offset"], p) if part["Slice"].get("Offset") else 0
            start = max(len(value) + start, 0) if start < 0 else start
            if not part["Slice"].get("Length"):
                return value[start:]
            n = self.arith(part["Slice"]["Length"], p)
            return value[start:start + n] if n >= 0 else value[start:len(value) + n]
        cases = {"^^": str.upper, ",,": str.lower, "^": lambda v: v[:1].upper() + v[1:],
                 ",": lambda v: v[:1].lower() + v[1:]}
        return cases[op](value) if op in cases else value

    # -------------------------------------------------------------- arithmetic
    def arith(self, node: dict, p: Path_) -> int:
        """Bash integer arithmetic over shfmt's parsed expression, on 64-bit values; anything not
        known raises _Unknown."""
        kind, op = node.get("Type"), node.get("Op")
        if kind == "ParenArithm":
            return self.arith(node["X"], p)
        if kind == "UnaryArithm" and op in ("++", "--"):
            name = _name(node["X"])
            old = self._int_var(name, p)
            new = old + (1 if op == "++" else -1)
            p.vars[name] = str(new)
            return old if node.get("Post") else new
        if kind == "UnaryArithm":
            v = self.arith(node["X"], p)
            ops = {"-": lambda: -v, "+": lambda: v, "!": lambda: int(not v), "~": lambda: ~v}
            if op not in ops:
                raise _Unknown()
            return ops[op]()
        if kind == "BinaryArithm" and op == "?":
            branches = node["Y"]
            return self.arith(branches["X"] if self.arith(node["X"], p) else branches["Y"], p)
        if kind == "BinaryArithm" and op.endswith("=") and op not in ("==", "!=", "<=", ">="):
            name = _name(node["X"])
            value = self.arith(node["Y"], p)
            if op != "=":
                value = _binop(op[:-1], self._int_var(name, p), value)
            p.vars[name] = str(value)
            return value
        if kind == "BinaryArithm" and op in ("&&", "||"):
            a = self.arith(node["X"], p)
            if (op == "&&") != bool(a):
                return int(bool(a))
            return int(bool(self.arith(node["Y"], p)))
        if kind == "BinaryArithm":
            a = self.arith(node["X"], p)
            return _binop(op, a, self.arith(node["Y"], p))
        if kind == "Word":
            parts = _parts(node)
            if len(parts) == 1 and parts[0]["Type"] == "Lit" and re.fullmatch(r"[A-Za-z_]\w*", parts[0].get("Value", "")):
                return self._int_var(parts[0].get("Value", ""), p)
            return self._arith_text(self._word(node, p), p)
        raise _Unknown()

    def _int_var(self, name: str, p: Path_) -> int:
        value = self.lookup(name, p)
        if value is None:
            raise _Unknown()
        if isinstance(value, tuple):
            value = value[0] if value else ""
        return self._arith_text(value, p)

    def _arith_text(self, text: str, p: Path_) -> int:
        """A number, or a variable's value read as an expression (bash evaluates it too)."""
        text = text.strip() or "0"
        if re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if re.fullmatch(r"0[xX][0-9a-fA-F]+", text):
            return int(text, 16)
        if self._arith_depth >= MAX_DEPTH or "\n" in text:
            raise _Unknown()
        self._arith_depth += 1
        try:
            if re.fullmatch(r"[A-Za-z_]\w*", text):
                return self._int_var(text, p)
            stmts = self.parse(f"(( {text} ))").get("Stmts") or []
            if len(stmts) != 1 or (stmts[0].get("Cmd") or {}).get("Type") != "ArithmCmd":
                raise _Unknown()
            return self.arith(stmts[0]["Cmd"]["X"], p)
        except ShellSyntax:
            raise _Unknown() from None
        finally:
            self._arith_depth -= 1


def _andor(cmd: dict) -> list[tuple[str | None, dict]]:
    """a && b || c as shfmt nests it (left first), flat: [(None, a), ("&&", b), ("||", c)]."""
    x = cmd["X"]
    inner = x.get("Cmd") or {}
    if inner.get("Type") == "BinaryCmd" and inner["Op"] in ("&&", "||") and not x.get("Negated") \
            and not x.get("Redirs"):
        head = _andor(inner)
    else:
        head = [(None, x)]
    return head + [(cmd["Op"], cmd["Y"])]


def _literal(word: dict | None) -> str | None:
    parts = _parts(word)
    return parts[0].get("Value", "") if len(parts) == 1 and parts[0]["Type"] == "Lit" else None


def _name(node: dict) -> str:
    """The variable an arithmetic assignment or ++/-- names."""
    name = _literal(node) if node.get("Type") == "Word" else None
    if name is None or not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise _Unknown()
    return name


def _plain_param(part: dict) -> bool:
    """$Y or ${Y} of a name or a positional parameter, nothing applied ($! and $? stay as written)."""
    return part["Type"] == "ParamExp" and re.fullmatch(r"\w+", part["Param"]["Value"]) is not None \
        and not any(part.get(k) for k in ("Exp", "Index", "Slice", "Repl", "Length", "Excl", "Names", "Width"))


def _bare_parameter(word: dict | None) -> bool:
    """$Y, ${Y} or "$Y" alone, or one command substitution $(...) / `...` alone: a value only the
    run knows (the script's own commands are never run here)."""
    parts = _parts(word)
    if len(parts) == 1 and parts[0]["Type"] == "DblQuoted":
        parts = parts[0].get("Parts") or []
    return len(parts) == 1 and (_plain_param(parts[0]) or parts[0]["Type"] == "CmdSubst")


def _all_items(part: dict) -> bool:
    """"${A[@]}", "$@", "${@}" or a slice of them ("${A[@]:1}"): the items, each a word, and no word when
    there are none."""
    if part["Type"] != "ParamExp" or any(part.get(k) for k in ("Exp", "Repl", "Length", "Excl", "Names")):
        return False
    return part["Param"]["Value"] == "@" if part.get("Index") is None else _literal(part["Index"]) == "@"


_ARITH_OPS: dict[str, Callable[[int, int], Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "**": operator.pow, "<<": operator.lshift,
    ">>": operator.rshift, "&": operator.and_, "|": operator.or_, "^": operator.xor, ",": lambda a, b: b,
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne}


def _binop(op: str, a: int, b: int) -> int:
    """One binary operator of bash arithmetic on 64-bit values; unknown past them or on a division by 0."""
    if op in ("/", "%"):
        if b == 0:
            raise _Unknown()
        q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)   # bash truncates toward zero
        return q if op == "/" else a - b * q
    if op == "**" and (b < 0 or b > 64 or abs(a) > LIMIT) or op in ("<<", ">>") and not 0 <= b < 64 \
            or op not in _ARITH_OPS:
        raise _Unknown()
    out = int(_ARITH_OPS[op](a, b))
    if abs(out) >= LIMIT:
        raise _Unknown()
    return out


def _strip(value: str, pattern: str, longest: bool, suffix: bool) -> str:
    """${V#p}, ${V##p}, ${V%p}, ${V%%p}: the shortest or longest match of p cut from the start or end."""
    cuts = range(len(value) + 1) if longest == suffix else range(len(value), -1, -1)
    for k in cuts:
        if fnmatch.fnmatchcase(value[k:] if suffix else value[:k], pattern):
            return value[:k] if suffix else value[k:]
    return value


LAUNCH_MODULES = {"torch.distributed.run", "torch.distributed.launch"}


def _entry_index(argv: list[str]) -> int | None:
    """Where the program a command starts is named: a *.py word, or the module after a `-m`
    (python -m pkg.train, torchrun -m pkg.train) other than the launchers' own modules."""
    for i, w in enumerate(argv):
        if i > 0 and argv[i - 1] == "-c":
            continue
        if w.endswith(".py") and "=" not in w and not w.startswith("-"):
            return i
        if i > 0 and argv[i - 1] == "-m" and w not in LAUNCH_MODULES and re.fullmatch(r"[\w.]+", w):
            return i
    return None


def read(text: str, script_path: Path | None = None, env: dict[str, str] | None = None,
         positional: tuple[str, ...] | None = None) -> Reading:
    """Every path through the script, each with its launches. Raises ShellSyntax for a script
    bash itself could not parse (ScriptTooLarge for one longer or deeper than the reader parses)."""
    try:
        return Reader(script_path, env, positional).read(text)
    except RecursionError:
        raise ScriptTooLarge(_TOO_DEEP, 1) from None
