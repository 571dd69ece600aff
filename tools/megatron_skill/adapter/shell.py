"""Bash as launch scripts are written, read and never run.

A launch script is data to us: which Python entry it starts, with which words, under which
launcher and environment.  This module reads the subset of bash those scripts use the way
bash itself would: quoting (an array item "--fp8-format hybrid" stays one word when quoted
as "${A[@]}" and splits when unquoted), parameter expansion (${V:-x}, ${V:=x}, ${V:+x},
${V#p}, ${V%p}, ${V/p/r}, ${#V}, ${A[i]}), $((arithmetic)), if/elif/else, case, for, while,
functions with their positional parameters, `source` of files next to the script, heredocs
(a body fed to bash or sbatch, or written with cat to a file run later), and `bash -c`
strings.

Nothing is executed.  A command substitution other than a few pure ones (echo, dirname,
basename, pwd) has an unknown value; a condition that depends on an unknown value or on the
machine (`[ -f x ]`, `python -c 'import te'`) is not decided: both ways are followed, and
each path through the script says which way it went at which line.

Why the lexer and parser are our own (measured 2026-12, on the 327 scripts the tests read and
NVIDIA's Megatron-LM examples): tree-sitter-bash 0.25.1 turns `if ! cmd <<'X'; then` (a heredoc
with more on its line, an open upstream bug) into an error node, and render's own scripts are
written so; as the front end of this evaluation it made 12 tests fail, for 1,517 lines. shfmt
3.14 refuses an array item that starts with `[` (the DeepSeek-V3 example's
`--moe-layer-freq [0]*3+[1]*58`) and costs a process, about 20 ms, per parse; bashlex reads no
arrays.
"""
from __future__ import annotations

import ast
import dataclasses
import fnmatch
import operator
import re
from pathlib import Path
from typing import Any, Callable

MAX_PATHS = 16          # paths through undecided conditions; beyond, the first way is taken
MAX_STEPS = 50_000      # commands evaluated in all; a script that loops further is cut short
MAX_DEPTH = 8           # nesting of source, functions, bash -c and heredoc scripts
MAX_LOOP = 256          # iterations of one loop
MAX_FILE_BYTES = 1 << 20


class ShellSyntax(Exception):
    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


# ---------------------------------------------------------------- lexer

@dataclasses.dataclass
class Tok:
    kind: str            # "w" word, "op" operator, "nl" newline, "arith" ((...)), "hd" heredoc body
    text: str
    line: int
    heredoc: list | None = None   # for "hd": [body, quoted], filled when the body is read


OPS = (";;&", "<<<", "<<-", "&>>", ";;", ";&", "&&", "||", "|&", "<<", ">>", ">|", ">&", "<&", "<>", "&>",
       ";", "&", "|", "(", ")", "<", ">")
META = set(" \t\n;&|()<>")
ASSIGN_HEAD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[[^\]]*\])?\+?=")
REDIRECTS = {"<", ">", ">>", ">|", "<>", "&>", "&>>", ">&", "<&", "<<<"}


def lex(text: str) -> list[Tok]:
    toks: list[Tok] = []
    i, n, line = 0, len(text), 1
    pending: list[tuple[str, bool, bool, Tok]] = []   # heredocs whose bodies start at the next line
    while i < n:
        c = text[i]
        if c in " \t\r":
            i += 1
        elif c == "\\" and text.startswith("\\\n", i):
            i, line = i + 2, line + 1
        elif c == "\n":
            toks.append(Tok("nl", "\n", line))
            i, line = i + 1, line + 1
            if pending:
                i, line = _read_heredocs(text, i, line, pending)
                pending = []
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("((", i):
            j = _closing(text, i + 1, line)
            if text.startswith("))", j - 1):
                toks.append(Tok("arith", text[i + 2:j - 1], line))
                line += text.count("\n", i, j + 1)
                i = j + 1
            else:  # "( (" written together: two subshells
                toks.append(Tok("op", "(", line))
                i += 1
        elif c in "<>&|;()":
            op = next(o for o in OPS if text.startswith(o, i))
            i += len(op)
            if op in ("<<", "<<-"):
                while i < n and text[i] in " \t":
                    i += 1
                j, _ = _word_end(text, i, line)
                raw = text[i:j]
                i = j
                delim = _unquote_delimiter(raw)
                tok = Tok("hd", delim, line, heredoc=["", raw != delim])
                toks.append(tok)
                pending.append((delim, raw != delim, op == "<<-", tok))
            else:
                toks.append(Tok("op", op, line))
        else:
            j, nl = _word_end(text, i, line)
            word = text[i:j]
            if j < n and text[j] in "<>" and word.isdigit():
                toks.append(Tok("op", "io", line))   # 2>&1: the number belongs to the redirection
            else:
                toks.append(Tok("w", word, line))
            line += nl
            i = j
    if pending:  # a heredoc without its body: the script ends first
        for _, _, _, tok in pending:
            tok.heredoc[0] = ""
    return toks


def _unquote_delimiter(raw: str) -> str:
    return raw.replace("'", "").replace('"', "").replace("\\", "")


def _read_heredocs(text: str, i: int, line: int, pending: list) -> tuple[int, int]:
    for delim, _quoted, strip_tabs, tok in pending:
        body = []
        while i < len(text):
            j = text.find("\n", i)
            j = len(text) if j < 0 else j
            raw = text[i:j]
            i, line = j + 1, line + 1
            check = raw.lstrip("\t") if strip_tabs else raw
            if check.rstrip("\r") == delim:
                break
            body.append(check)
        tok.heredoc[0] = "\n".join(body) + "\n"
    return i, line


def _word_end(text: str, i: int, line: int) -> tuple[int, int]:
    """End of the word at i, and the newlines inside it. Quotes, $(...), ${...} and `...`
    may hold metacharacters; NAME=( ... ) takes its whole parenthesised list."""
    n, start, nl = len(text), i, 0
    while i < n:
        c = text[i]
        if c in META:
            if c == "(" and ASSIGN_HEAD.fullmatch(text[start:i]):
                j = _closing(text, i, line)
                nl += text.count("\n", i, j)
                i = j + 1
                continue
            break
        if c == "\\":
            if text.startswith("\\\n", i):
                nl += 1
            i += 2
        elif c in "'\"`" or c == "$" and i + 1 < n and text[i + 1] in "({":
            if c == '"':
                j = _dquote_end(text, i + 1, line + nl)
            elif c == "$":
                j = _closing(text, i + 1, line + nl)
            elif (j := text.find(c, i + 1)) < 0:
                raise ShellSyntax(("a single quote" if c == "'" else "a backquote") + " is never closed", line + nl)
            nl += text.count("\n", i, j)
            i = j + 1
        else:
            i += 1
    return i, nl


def _dquote_end(text: str, i: int, line: int) -> int:
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i
        elif c == "$" and i + 1 < n and text[i + 1] in "({":
            i = _closing(text, i + 1, line) + 1
        elif c == "`":
            j = text.find("`", i + 1)
            i = (j if j >= 0 else n) + 1
        else:
            i += 1
    raise ShellSyntax("a double quote is never closed", line)


def _closing(text: str, i: int, line: int) -> int:
    """Index of the ")" or "}" closing the "(" or "{" at i: a parenthesis across quotes and
    comments; a ${ by its braces alone (quotes inside ${...} are rare)."""
    opening = text[i]
    parens = opening == "("
    closing = ")" if parens else "}"
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == opening:
            depth += 1
        elif c == closing:
            depth -= 1
            if depth == 0:
                return i
        elif c == "\\":
            i += 1
        elif parens and c == "'":
            j = text.find("'", i + 1)
            i = (j if j >= 0 else n)
        elif parens and c == '"':
            i = _dquote_end(text, i + 1, line)
        elif parens and c == "#" and (i == 0 or text[i - 1] in " \t\n("):
            j = text.find("\n", i)
            i = (j if j >= 0 else n) - 1
        i += 1
    raise ShellSyntax("a parenthesis is never closed" if parens else "a ${ is never closed", line)


# ---------------------------------------------------------------- parser

@dataclasses.dataclass
class Cmd:
    words: list[Tok]
    assigns: list[Tok]
    redirs: list[tuple[str, Tok]]
    line: int


@dataclasses.dataclass
class Node:
    kind: str                 # seq, andor, pipe, if, case, for, while, group, subshell, func, cond, arith, not
    line: int
    parts: list = dataclasses.field(default_factory=list)
    text: str = ""


RESERVED_END = {"then", "elif", "else", "fi", "do", "done", "esac", "}"}


class Parser:
    def __init__(self, toks: list[Tok]):
        self.t, self.i = toks, 0

    def peek(self) -> Tok | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def word_is(self, *words: str) -> bool:
        tok = self.peek()
        return tok is not None and tok.kind == "w" and tok.text in words

    def op_is(self, *ops: str) -> bool:
        tok = self.peek()
        return tok is not None and tok.kind == "op" and tok.text in ops

    def accept(self, *texts: str) -> bool:
        """Take the next token if it is one of these words or operators."""
        if self.word_is(*texts) or self.op_is(*texts):
            self.take()
            return True
        return False

    def take(self) -> Tok:
        tok = self.t[self.i]
        self.i += 1
        return tok

    def expect_word(self, word: str, opened: Tok | int) -> None:
        if not self.word_is(word):
            line = opened if isinstance(opened, int) else opened.line
            raise ShellSyntax(f"expected '{word}' for the construct opened at line {line}", line)
        self.take()

    def skip_newlines(self, ops: tuple = (";",)) -> None:
        while self.peek() is not None and (self.peek().kind == "nl" or self.op_is(*ops)):
            self.take()

    def take_word(self, message: str, line: int) -> Tok:
        if self.peek() is None or self.peek().kind != "w":
            raise ShellSyntax(message, line)
        return self.take()

    def parse_list(self, stop_words: frozenset = frozenset(), stop_ops: tuple = ()) -> Node:
        seq = Node("seq", self.peek().line if self.peek() else 0)
        while True:
            self.skip_newlines((";", "&"))
            tok = self.peek()
            if tok is None or (tok.kind == "w" and tok.text in stop_words) or (tok.kind == "op" and tok.text in stop_ops):
                return seq
            if tok.kind == "op" and tok.text in (")", ";;", ";&", ";;&"):
                raise ShellSyntax(f"unexpected '{tok.text}'", tok.line)
            if tok.kind == "w" and tok.text in RESERVED_END:
                raise ShellSyntax(f"unexpected '{tok.text}'", tok.line)
            seq.parts.append(self.parse_andor())

    def parse_andor(self) -> Node:
        node = Node("andor", self.peek().line, [(None, self.parse_pipe())])
        while self.op_is("&&", "||"):
            op = self.take().text
            self.skip_newlines(())
            node.parts.append((op, self.parse_pipe()))
        return node

    def parse_pipe(self) -> Node:
        negate = self.accept("!")
        node = Node("pipe", self.peek().line if self.peek() else 0, [self.parse_command()])
        while self.accept("|", "|&"):
            self.skip_newlines(())
            node.parts.append(self.parse_command())
        return Node("not", node.line, [node]) if negate else node

    def parse_command(self) -> Any:
        tok = self.peek()
        if tok is None:
            raise ShellSyntax("a command is missing at the end of the script", self.t[-1].line if self.t else 0)
        if tok.kind == "arith":
            self.take()
            return self._redirected(Node("arith", tok.line, text=tok.text))
        if tok.kind == "op" and tok.text == "(":
            self.take()
            body = self.parse_list(stop_ops=(")",))
            if not self.accept(")"):
                raise ShellSyntax("a subshell '(' is never closed", tok.line)
            return self._redirected(Node("subshell", tok.line, [body]))
        if tok.kind == "w":
            compound = {"if": self.parse_if, "case": self.parse_case, "for": self.parse_for,
                        "while": self.parse_while, "until": self.parse_while, "{": self.parse_group,
                        "function": self.parse_function, "[[": self.parse_cond, "select": self.parse_for}
            if tok.text in compound:
                return compound[tok.text]()
            nxt = self.t[self.i + 1] if self.i + 1 < len(self.t) else None
            after = self.t[self.i + 2] if self.i + 2 < len(self.t) else None
            if nxt and after and nxt.kind == "op" and nxt.text == "(" and after.kind == "op" and after.text == ")" \
                    and re.fullmatch(r"[A-Za-z_][\w:.-]*", tok.text):
                self.i += 3
                self.skip_newlines()
                return Node("func", tok.line, [self.parse_command()], text=tok.text)
        return self.parse_simple()

    def _redirected(self, node: Any) -> Any:
        while self.peek() is not None and (self.op_is(*REDIRECTS, "io") or self.peek().kind == "hd"):
            tok = self.take()
            if tok.kind == "op" and tok.text != "io" and self.peek() is not None and self.peek().kind == "w":
                self.take()   # the redirection's target
        return node

    def parse_simple(self) -> Cmd:
        start = self.peek()
        cmd = Cmd([], [], [], start.line)
        while True:
            tok = self.peek()
            if tok is None or tok.kind in ("nl", "arith"):
                break
            if tok.kind == "hd":
                cmd.redirs.append(("<<", self.take()))
            elif tok.kind == "op":
                if tok.text == "io":
                    self.take()
                    continue
                if tok.text not in REDIRECTS:
                    break
                op = self.take().text
                cmd.redirs.append((op, self.take_word(f"a redirection '{op}' has no target", tok.line)))
            else:
                if not cmd.words and ASSIGN_HEAD.match(tok.text):
                    cmd.assigns.append(self.take())
                elif cmd.words or tok.text not in RESERVED_END:
                    cmd.words.append(self.take())
                else:
                    break
        if not (cmd.words or cmd.assigns or cmd.redirs):
            raise ShellSyntax(f"unexpected '{start.text.strip()}'", start.line)
        return cmd

    def parse_if(self) -> Node:
        opened = self.take()
        node = Node("if", opened.line)
        while True:
            cond = self.parse_list(frozenset({"then"}))
            self.expect_word("then", opened)
            body = self.parse_list(frozenset({"elif", "else", "fi"}))
            node.parts.append((cond, body))
            if self.accept("elif"):
                continue
            if self.accept("else"):
                node.parts.append((None, self.parse_list(frozenset({"fi"}))))
            self.expect_word("fi", opened)
            return self._redirected(node)

    def parse_case(self) -> Node:
        opened = self.take()
        word = self.take_word("case without a word", opened.line)
        self.skip_newlines()
        self.expect_word("in", opened)
        node = Node("case", opened.line, text=word.text)
        node.parts.append(word)
        items = []
        while True:
            self.skip_newlines()
            if self.accept("esac"):
                break
            self.accept("(")
            patterns = [self.take_word("a case pattern is missing", opened.line)]
            while self.accept("|"):
                patterns.append(self.take_word("a case pattern is missing", opened.line))
            if not self.accept(")"):
                raise ShellSyntax("a case pattern needs ')'", patterns[-1].line)
            body = self.parse_list(frozenset({"esac"}), (";;", ";&", ";;&"))
            items.append((patterns, body))
            self.accept(";;", ";&", ";;&")
        node.parts.append(items)
        return self._redirected(node)

    def parse_for(self) -> Node:
        opened = self.take()
        tok = self.peek()
        if tok is not None and tok.kind == "arith":  # for ((i=0; i<n; i++))
            self.take()
            self.skip_newlines()
            return self._redirected(Node("for", opened.line, [None, None, self.do_group(opened)], text=tok.text))
        name = self.take_word("for without a variable", opened.line).text
        words = None
        self.skip_newlines(())
        if self.accept("in"):
            words = []
            while self.peek() is not None and self.peek().kind == "w":
                words.append(self.take())
        self.skip_newlines()
        return self._redirected(Node("for", opened.line, [name, words, self.do_group(opened)]))

    def do_group(self, opened: Tok) -> Node:
        self.expect_word("do", opened)
        body = self.parse_list(frozenset({"done"}))
        self.expect_word("done", opened)
        return body

    def parse_while(self) -> Node:
        opened = self.take()
        cond = self.parse_list(frozenset({"do"}))
        return self._redirected(Node("while", opened.line, [cond, self.do_group(opened)], text=opened.text))

    def parse_group(self) -> Node:
        opened = self.take()
        body = self.parse_list(frozenset({"}"}))
        self.expect_word("}", opened)
        return self._redirected(Node("group", opened.line, [body]))

    def parse_function(self) -> Node:
        opened = self.take()
        name = self.take_word("function without a name", opened.line).text
        if self.accept("(") and not self.accept(")"):
            raise ShellSyntax("function name() needs ')'", opened.line)
        self.skip_newlines()
        return Node("func", opened.line, [self.parse_command()], text=name)

    def parse_cond(self) -> Node:
        opened = self.take()
        toks = []
        while not self.word_is("]]"):
            if self.peek() is None or self.peek().kind == "nl":
                raise ShellSyntax("[[ is never closed with ]]", opened.line)
            toks.append(self.take())
        self.take()
        return self._redirected(Node("cond", opened.line, toks))


def parse(text: str) -> Node:
    p = Parser(lex(text))
    node = p.parse_list()
    if p.peek() is not None:
        tok = p.peek()
        raise ShellSyntax(f"unexpected '{tok.text}'", tok.line)
    return node


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
    funcs: dict[str, Node]
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


SBATCH = re.compile(r"^#SBATCH\s+(--?[A-Za-z][\w-]*)(?:[= ]\s*(\S+))?", re.M)
SHELLS = {"bash", "sh", "zsh", "dash"}
WRAPPERS = {"env", "exec", "time", "nohup", "command", "builtin", "stdbuf", "nice", "ionice", "numactl", "taskset",
            "timeout", "xargs", "apptainer", "singularity"}
# Commands that name a *.py without starting it.
NOT_LAUNCHERS = {"echo", "printf", "cat", "ls", "cp", "mv", "rm", "mkdir", "touch", "chmod", "chown", "test", "[",
                 "grep", "sed", "awk", "head", "tail", "tee", "wget", "curl", "git", "cd", "pushd", "popd", "find",
                 "du", "wc", "sort", "cut", "ln", "scp", "rsync", "sha256sum", "md5sum", "file", "stat", "diff",
                 "patch", "tar", "unzip", "which", "type", "realpath", "readlink", "dirname", "basename", "vim", "less"}
PURE_SUBST = {"echo", "dirname", "basename", "pwd", "printf", "realpath", "readlink", "cd", "true"}


_PLAIN = re.compile(r"[^\\$`]+|\\")   # a run of text with no expansion in it, or a backslash kept


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

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # -------------------------------------------------------------- driver
    def read(self, text: str) -> Reading:
        start = Path_(vars={**{k: v for k, v in self.env.items()}}, exported=set(self.env), funcs={},
                      positional=self.positional, files={}, sbatch={}, launches=[], choices=[], unresolved=[])
        start.vars.setdefault("0", str(self.script_path or "script.sh"))
        for m in SBATCH.finditer(text):
            start.sbatch[m.group(1).lstrip("-")] = m.group(2) or ""
        paths = self.run_text(text, [start], "")
        return Reading(paths, self.notes)

    def run_text(self, text: str, paths: list[Path_], where_file: str) -> list[Path_]:
        saved, self.where_file = self.where_file, where_file
        saved_src, self.src = self.src, text.splitlines()
        try:
            tree = parse(text)
        except ShellSyntax as e:
            if self.depth == 0:
                raise
            self.note(f"{where_file or 'nested script'} line {e.line}: not read ({e})")
            return paths
        try:
            return self.eval(tree, paths)
        finally:
            self.where_file, self.src = saved, saved_src

    def eval(self, node: Any, paths: list[Path_]) -> list[Path_]:
        live = [p for p in paths if p.ended is None]
        done = [p for p in paths if p.ended is not None]
        if not live:
            return paths
        return done + self._eval(node, live)

    def _eval(self, node: Any, paths: list[Path_]) -> list[Path_]:
        self.steps += 1
        if self.steps > MAX_STEPS:
            self.note(f"stopped after {MAX_STEPS:,} commands: the rest of the script was not read")
            for p in paths:
                p.ended = p.ended or "not read further (too many commands)"
            return paths
        if isinstance(node, Cmd):
            return self._each(paths, lambda p: self.command(node, p))
        if node.kind in ("seq", "pipe", "group"):
            for part in node.parts:
                paths = self.eval(part, paths)
            return paths
        if node.kind == "andor":
            return self.andor(node, paths)
        if node.kind in ("cond", "arith", "not"):
            return paths  # a test on its own changes nothing we read
        if node.kind == "func":
            return self._each(paths, lambda p: p.funcs.update({node.text: node.parts[0]}))
        one = {"subshell": self.subshell, "if": self.if_, "case": self.case, "for": self.for_, "while": self.while_}
        return self._each(paths, lambda p: one[node.kind](node, p))

    def subshell(self, node: Node, p: Path_) -> list[Path_]:
        saved_vars, saved_exp = dict(p.vars), set(p.exported)
        outs = self.eval(node.parts[0], [p])
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
        """Whether a condition list succeeds, or None when that cannot be known here."""
        self._current = p
        try:
            if isinstance(node, Cmd):
                return self.command_truth(node, p)
            if node.kind == "seq":
                value = True
                for part in node.parts:
                    value = self.truth(part, p)
                return value
            if node.kind == "andor":
                value = self.truth(node.parts[0][1], p)
                for op, part in node.parts[1:]:
                    if op == "&&" and value is False or op == "||" and value is True:
                        continue
                    right = self.truth(part, p)
                    if value is None:
                        value = None if right is None or (op == "&&" and right) or (op == "||" and not right) \
                            else right
                    else:
                        value = right
                return value
            if node.kind == "pipe":
                return self.truth(node.parts[-1], p) if len(node.parts) == 1 else None
            if node.kind == "not":
                value = self.truth(node.parts[0], p)
                return None if value is None else not value
            if node.kind == "cond":
                return self.cond([t.text for t in node.parts], p, double=True)
            if node.kind == "arith":
                return self.arith(node.text, p) != 0
        except _Unknown:
            return None
        return None

    def command_truth(self, cmd: Cmd, p: Path_) -> bool | None:
        if not cmd.words:
            return True
        name = cmd.words[0].text
        if name in ("true", ":"):
            return True
        if name == "false":
            return False
        if name in ("[", "test"):
            words = [t.text for t in cmd.words[1:]]
            if name == "[":
                if not words or words[-1] != "]":
                    return None
                words = words[:-1]
            return self.cond(words, p, double=False)
        return None

    def cond(self, raw: list[str], p: Path_, double: bool) -> bool | None:
        words: list[str] = []
        for r in raw:
            if r in ("&&", "||", "!", "(", ")", "-a", "-o") and not double or r in ("&&", "||", "!", "(", ")"):
                words.append(r)
                continue
            fields, unknown = self.expand(r, p, split=not double)
            if unknown:
                raise _Unknown()
            words.append(" ".join(fields) if double else (fields[0] if len(fields) == 1 else " ".join(fields)))
        value, rest = self._cond_or(words, double)
        return value if not rest else None

    def _cond_or(self, w: list[str], double: bool, ops: tuple = ("||", "-o")) -> tuple[bool | None, list[str]]:
        """a || b over a && b (which binds closer): True decides an ||, False an &&."""
        decides = ops[0] == "||"
        operand = (lambda x: self._cond_or(x, double, ("&&", "-a"))) if decides else (lambda x: self._cond_not(x, double))
        value, w = operand(w)
        while w and w[0] in ops:
            right, w = operand(w[1:])
            value = decides if decides in (value, right) else (None if None in (value, right) else not decides)
        return value, w

    def _cond_not(self, w: list[str], double: bool) -> tuple[bool | None, list[str]]:
        if w and w[0] == "!":
            value, w = self._cond_not(w[1:], double)
            return (None if value is None else not value), w
        if w and w[0] == "(":
            value, w = self._cond_or(w[1:], double)
            return value, (w[1:] if w and w[0] == ")" else w)
        return self._cond_prim(w, double)

    def _cond_prim(self, w: list[str], double: bool) -> tuple[bool | None, list[str]]:
        if not w:
            return False, w
        if len(w) >= 3 and w[1] in ("==", "=", "!=", "=~", "-eq", "-ne", "-lt", "-le", "-gt", "-ge", "<", ">"):
            a, op, b = w[0], w[1], w[2]
            rest = w[3:]
            if op in ("==", "=", "!="):
                same = fnmatch.fnmatchcase(a, b) if double else a == b
                return (same if op != "!=" else not same), rest
            if op == "=~":
                try:
                    return re.search(b, a) is not None, rest
                except re.error:
                    return None, rest
            if op in ("<", ">"):
                return ((a < b) if op == "<" else (a > b)), rest
            try:
                x, y = int(a or 0), int(b or 0)
            except ValueError:
                return None, rest
            return {"-eq": x == y, "-ne": x != y, "-lt": x < y, "-le": x <= y, "-gt": x > y, "-ge": x >= y}[op], rest
        if len(w) >= 2 and re.fullmatch(r"-[a-zA-Z]", w[0]):
            op, a, rest = w[0], w[1], w[2:]
            if op == "-z":
                return a == "", rest
            if op == "-n":
                return a != "", rest
            if op == "-v":
                return a in self._current.vars, rest
            return None, rest  # files, terminals: the machine decides
        return w[0] != "", w[1:]

    # -------------------------------------------------------------- compound commands
    def andor(self, node: Node, paths: list[Path_]) -> list[Path_]:
        paths = self.eval(node.parts[0][1], paths)
        prev = node.parts[0][1]
        for op, part in node.parts[1:]:
            out = []
            for p in paths:
                if p.ended:
                    out.append(p)
                    continue
                value = self.truth(prev, p)
                if value is None:
                    value = True  # commands are taken to succeed: `mkdir -p x || exit 1` goes on
                runs = value if op == "&&" else not value
                out.extend(self.eval(part, [p]) if runs else [p])
            paths, prev = out, part
        return paths

    def branch(self, p: Path_, label: str, ways: list[tuple[str, Any]]) -> list[Path_]:
        """Follow each way (a label and the node to run) on its own copy of p."""
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

    def if_(self, node: Node, p: Path_) -> list[Path_]:
        ways = []
        for cond, body in node.parts:
            if cond is None:
                ways.append(("the else branch", body))
                break
            value = self.truth(cond, p)
            if value is not False:
                ways.append((f"{self.source_line(cond.line)} true", body))
            if value is True:
                break
        else:
            tried = [self.source_line(c.line) for c, _ in node.parts if c is not None]
            ways.append((" and ".join(tried) + " false" if len(tried) == 1 else "no condition true", None))
        return self.branch(p, f"if at {self.where(node.line)}", ways)

    def where(self, line: int) -> str:
        """line N, and inside what: 'line 5 of bash -c at line 13 of the heredoc at line 219'."""
        return f"line {line}" + (f" of {self.where_file}" if self.where_file else "")

    def source_line(self, line: int) -> str:
        """The condition as written, for a path's label: `[[ "$DTYPE" == "fp8" ]]`."""
        text = self.src[line - 1].strip() if 0 < line <= len(self.src) else ""
        text = re.sub(r"^(el)?if\s+|;?\s*then\s*$", "", text)
        return "`" + (text[:77] + "..." if len(text) > 80 else text) + "`"

    def case(self, node: Node, p: Path_) -> list[Path_]:
        word_tok, items = node.parts
        fields, unknown = self.expand(word_tok.text, p, split=False)
        subject = " ".join(fields)
        ways = []
        for patterns, body in items:
            pats = [" ".join(self.expand(t.text, p, split=False)[0]) for t in patterns]
            if unknown:
                ways.append((f"'{'|'.join(t.text for t in patterns)})'", body))
            elif any(fnmatch.fnmatchcase(subject, pat) for pat in pats):
                ways = [("match", body)]
                break
        if unknown:
            ways.append(("no pattern matched", None))
        return self.branch(p, f"case {word_tok.text} at {self.where(node.line)}", ways) if ways else [p]

    def for_(self, node: Node, p: Path_) -> list[Path_]:
        name, words, body = node.parts
        if name is None:  # for ((...)): run the body once, its count is rarely what matters
            self.note(f"line {node.line}: an arithmetic for loop is read once")
            return self.eval(body, [p])
        items = list(p.positional or ()) if words is None else [f for t in words for f in self.expand(t.text, p)[0]]
        cur = [p]
        for item in items[:MAX_LOOP]:
            for q in cur:
                q.vars[name] = item
            cur = self.eval(body, cur)
        return cur

    def while_(self, node: Node, p: Path_) -> list[Path_]:
        cond, body = node.parts
        cur = [p]
        for _ in range(MAX_LOOP):
            value = self.truth(cond, cur[0]) if len(cur) == 1 else None
            if node.text == "until" and value is not None:
                value = not value
            if value is None:
                self.note(f"line {node.line}: a {node.text} loop whose condition is not known here is not followed")
            if not value:
                break
            cur = self.eval(body, cur)
            if not cur:
                break
        return cur

    # -------------------------------------------------------------- simple commands
    def command(self, cmd: Cmd, p: Path_) -> list[Path_] | None:
        self._current = p
        argv, lines = [], []
        for t in cmd.words:
            if argv and argv[0] in ("export", "declare", "typeset", "local", "readonly") and ASSIGN_HEAD.match(t.text):
                argv.append(t.text)
                lines.append(t.line)
                continue
            fields = self.expand(t.text, p)[0]
            argv += fields
            lines += [t.line] * len(fields)
        if not argv:
            for a in cmd.assigns:
                self.assign(a.text, p, export=False, line=a.line)
            return None
        prefix_env = {}
        for a in cmd.assigns:
            name, value = self._assignment_value(a.text, p)
            if isinstance(value, str):
                prefix_env[name] = value
        return self.run_argv(argv, lines, cmd, p, prefix_env)

    def run_argv(self, argv: list[str], lines: list[int], cmd: Cmd, p: Path_, prefix_env: dict[str, str],
                 prefix: list[str] | None = None) -> list[Path_] | None:
        name = argv[0]
        prefix = prefix or []
        if name in ("export", "declare", "typeset", "local", "readonly"):
            export = name == "export" or any(a.startswith("-") and "x" in a for a in argv[1:] if not ASSIGN_HEAD.match(a))
            for a in argv[1:]:
                if ASSIGN_HEAD.match(a):
                    self.assign(a, p, export=export, line=lines[0])
                elif not a.startswith("-") and re.fullmatch(r"[A-Za-z_]\w*", a):
                    if export:
                        p.exported.add(a)
                    if name != "export":
                        p.vars.setdefault(a, "" if "-a" not in argv else ())
            return None
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
            p.ended = f"exit at line {cmd.line}"
            return None
        if name == "return":
            raise _Return()
        if name in ("source", "."):
            return self.source(argv[1:], cmd, p)
        if name == "eval":
            return self.nested(" ".join(argv[1:]), p, f"eval at line {cmd.line}", prefix)
        if name in p.funcs:
            return self.call(name, argv[1:], p, cmd)
        if name in WRAPPERS or "=" in name and re.match(r"[A-Za-z_]\w*=", name):
            rest = argv[1:]
            while rest and (rest[0].startswith("-") or re.match(r"[A-Za-z_]\w*=", rest[0])):
                if "=" in rest[0] and not rest[0].startswith("-"):
                    k, v = rest[0].split("=", 1)
                    prefix_env[k] = v
                rest = rest[1:]
            if rest and rest != argv:
                k = len(argv) - len(rest)
                return self.run_argv(rest, lines[k:], cmd, p, prefix_env, prefix + argv[:k])
        # A *.py among the words: the launch (torchrun, python, srun ... python, deepspeed ...).
        entry = None if Path(name).name in NOT_LAUNCHERS else _entry_index(argv)
        shell_c = self._shell_c_index(argv)
        if shell_c is not None and (entry is None or entry > shell_c):
            k = shell_c
            shell_word = next(w for w in argv[:k] if Path(w).name in SHELLS)
            return self.nested(argv[k], p, f"{Path(shell_word).name} -c at {self.where(cmd.line)}",
                               prefix + argv[:k - 1])
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
            for op, target in cmd.redirs:
                if op == "<<" and target.heredoc is not None:
                    body = self._heredoc_text(target, p)
                    return self.nested(body, p, f"the heredoc at {self.where(target.line)}", prefix + argv[:base + 1],
                                       sbatch=is_sbatch)
            script = next((w for w in argv[base + 1:] if not w.startswith("-") and (w.endswith((".sh", ".sbatch", ".slurm"))
                                                                                 or w in p.files)), None)
            if script is not None:
                text = self._file_text(script, p)
                if text is not None:
                    return self.nested(text, p, script, prefix + argv[:base + 1], sbatch=is_sbatch)
        if name in ("cat", "tee"):
            self._write_heredoc(argv, cmd, p)
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
        aliases = {"N": "nodes", "n": "ntasks", "G": "gpus", "p": "partition", "t": "time"}
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

    def _heredoc_text(self, tok: Tok, p: Path_) -> str:
        body, quoted = tok.heredoc
        if quoted:
            return body
        return self.expand_heredoc(body, p)

    def _write_heredoc(self, argv: list[str], cmd: Cmd, p: Path_) -> None:
        body = next((self._heredoc_text(t, p) for op, t in cmd.redirs if op == "<<" and t.heredoc is not None), None)
        if body is None:
            return
        targets = [" ".join(self.expand(t.text, p, split=False)[0]) for op, t in cmd.redirs if op in (">", ">|")]
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
            for m in SBATCH.finditer(text):
                p.sbatch.setdefault(m.group(1).lstrip("-"), m.group(2) or "")
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

    def source(self, args: list[str], cmd: Cmd, p: Path_) -> list[Path_] | None:
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

    def call(self, name: str, args: list[str], p: Path_, cmd: Cmd) -> list[Path_]:
        if self.depth >= MAX_DEPTH:
            self.note(f"line {cmd.line}: {name} calls itself deeper than {MAX_DEPTH} levels; not followed")
            return [p]
        saved = p.positional
        p.positional = tuple(args)
        self.depth += 1
        try:
            outs = self.eval(p.funcs[name], [p])
        except _Return:
            outs = [p]
        finally:
            self.depth -= 1
        for q in outs:
            q.positional = saved
        return outs

    # -------------------------------------------------------------- variables
    def assign(self, raw: str, p: Path_, export: bool, line: int) -> None:
        name, value = self._assignment_value(raw, p)
        if name is None:
            return
        if value is UNKNOWN:   # X=$Y with Y left to the caller: X is as unknown as Y
            p.vars.pop(name, None)
        else:
            p.vars[name] = value
        if export:
            p.exported.add(name)

    def _assignment_value(self, raw: str, p: Path_) -> tuple[str | None, Any]:
        m = ASSIGN_HEAD.match(raw)
        if not m:
            return None, None
        head = m.group(0)
        name = re.match(r"[A-Za-z_]\w*", head).group(0)
        append = head.endswith("+=")
        value = raw[len(head):]
        index = m.group(1)
        if value.startswith("(") and value.endswith(")") and index is None:
            items: list[str] = []
            for tok in lex(value[1:-1]):
                if tok.kind == "w":
                    items += self.expand(tok.text, p)[0]
            old = p.vars.get(name, ())
            old = (old,) if isinstance(old, str) else old
            return name, tuple(old) + tuple(items) if append else tuple(items)
        fields, unknown = self.expand(value, p, split=False)
        text = " ".join(fields)
        if unknown and index is None and not append and re.fullmatch(r'"?\$\{?\w+\}?"?', value):
            return name, UNKNOWN   # X=$Y, Y left to the caller: X as unknown as Y (a longer text keeps it literal)
        if index is not None:  # A[i]=v
            arr = p.vars.get(name, ())
            arr = list((arr,) if isinstance(arr, str) else arr)
            try:
                k = int(self.arith(index[1:-1], p))
            except (_Unknown, ValueError):
                return name, tuple(arr)
            if 0 <= k < 4096:
                arr += [""] * (k + 1 - len(arr))
                arr[k] = text
            return name, tuple(arr)
        old = p.vars.get(name, "")
        if append:
            if isinstance(old, tuple):
                return name, old + (text,)
            return name, old + text
        return name, text

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
    def expand(self, raw: str, p: Path_, split: bool = True) -> tuple[list[str], bool]:
        """The fields a word becomes, and whether any part of it is unknown (kept as written)."""
        fields: list[str] = []
        cur: list[str] = []
        have = False   # the current field exists even if empty ("" or a quoted part)
        unknown = False
        i, n = 0, len(raw)

        def add_text(text: str, splittable: bool) -> None:
            nonlocal cur, have
            if not splittable or not split:
                cur.append(text)
                have = True
                return
            parts = re.split(r"[ \t\n]+", text)
            for k, part in enumerate(parts):
                if k > 0:
                    if have or cur:
                        fields.append("".join(cur))
                    cur, have = [], False
                if part:
                    cur.append(part)
                    have = True

        def add_items(items: tuple, quoted: bool) -> None:
            nonlocal cur, have
            for k, item in enumerate(items):
                if k > 0 and not split:
                    cur.append(" ")
                elif k > 0 and quoted:
                    fields.append("".join(cur))
                    cur, have = [], False
                if quoted or not split:
                    cur.append(item)
                    have = True
                else:
                    add_text((" " if k > 0 else "") + item, True)

        while i < n:
            c = raw[i]
            if c == "\\":
                if i + 1 < n and raw[i + 1] != "\n":
                    cur.append(raw[i + 1])
                    have = True
                i += 2
            elif c == "'":
                j = raw.find("'", i + 1)
                j = n if j < 0 else j
                cur.append(raw[i + 1:j])
                have = True
                i = j + 1
            elif c == '"':
                j = _dquote_end(raw, i + 1, 0) if '"' in raw[i + 1:] else n
                inner = raw[i + 1:j]
                # "${A[@]}" of an empty array (or "$@" with no arguments) is no word at all
                if not re.fullmatch(r"\$\{[A-Za-z_]\w*\[@\]\}|\$@|\$\{@\}", inner):
                    have = True
                for piece, unk in self._double_quoted(inner, p, '$`"\\\n'):
                    unknown |= unk
                    if isinstance(piece, tuple):
                        add_items(piece, quoted=True)
                    else:
                        cur.append(piece)
                i = j + 1
            elif c == "$" or c == "`":
                value, i, unk, items = self._dollar(raw, i, p, quoted=False)
                unknown |= unk
                if unk:
                    cur.append(value)   # kept as written, one piece
                    have = True
                elif items is not None:
                    add_items(items, quoted=False)
                else:
                    add_text(value, True)
            else:
                cur.append(c)
                have = True
                i += 1
        if have or cur:
            fields.append("".join(cur))
        return fields, unknown

    def expand_heredoc(self, body: str, p: Path_) -> str:
        return "".join(" ".join(x) if isinstance(x, tuple) else x for x, _ in self._double_quoted(body, p, "$`\\\n"))

    def _double_quoted(self, s: str, p: Path_, escapable: str) -> list[tuple[str | tuple, bool]]:
        """The pieces of a double-quoted text or a heredoc body: text, or what a $-expansion gives
        (its text or its array items), each with whether it is unknown."""
        pieces, k = [], 0
        while k < len(s):
            if s[k] == "\\" and k + 1 < len(s) and s[k + 1] in escapable:
                pieces.append((s[k + 1] if s[k + 1] != "\n" else "", False))
                k += 2
            elif s[k] in "$`":
                value, k, unk, items = self._dollar(s, k, p, quoted=True)
                pieces.append((value if items is None else items, unk))
            else:
                plain = _PLAIN.match(s, k).group(0)
                pieces.append((plain, False))
                k += len(plain)
        return pieces

    def _dollar(self, s: str, i: int, p: Path_, quoted: bool) -> tuple[str, int, bool, tuple | None]:
        """Expand the $-thing at s[i]: (text, next index, unknown, array items or None)."""
        if s[i] == "`":
            j = s.find("`", i + 1)
            j = len(s) if j < 0 else j
            return self._subst_result(s[i + 1:j], s[i:j + 1], j + 1, p)
        if i + 1 >= len(s):
            return "$", i + 1, False, None
        nxt = s[i + 1]
        if s.startswith("$((", i):
            j = _closing(s, i + 1, 0)
            text = s[i:j + 1]
            try:
                return str(self.arith(s[i + 3:j - 1], p)), j + 1, False, None
            except _Unknown:
                return text, j + 1, True, None
        if nxt == "(":
            j = _closing(s, i + 1, 0)
            return self._subst_result(s[i + 2:j], s[i:j + 1], j + 1, p)
        if nxt == "{":
            j = _closing(s, i + 1, 0)
            try:
                return self._brace(s[i + 2:j], s[i:j + 1], j + 1, p, quoted)
            except _Unknown:
                return s[i:j + 1], j + 1, True, None
        m = re.match(r"[A-Za-z_]\w*|[0-9]|[@*#?$!\-]", s[i + 1:])
        if not m:
            return "$", i + 1, False, None
        name = m.group(0)
        end = i + 1 + len(name)
        if name in ("?", "$", "!", "-"):
            return s[i:end], end, True, None
        value = self.lookup(name, p)
        if value is None:
            if name in ("@", "*"):
                return "", end, False, ()   # the script's own arguments: nothing known, nothing added
            self.unresolved(name, p)
            return s[i:end], end, True, None
        if isinstance(value, tuple):
            if name in ("@", "*"):
                return "", end, False, value
            return (value[0] if value else ""), end, False, None
        return value, end, False, None

    def _subst_result(self, body: str, text: str, end: int, p: Path_) -> tuple[str, int, bool, None]:
        try:
            return self.substitute(body, p), end, False, None
        except _Unknown:
            return text, end, True, None

    def substitute(self, body: str, p: Path_) -> str:
        """$(...) of the pure commands (echo, dirname, basename, pwd, cd X && pwd); else unknown."""
        try:
            tree = parse(body)
        except ShellSyntax:
            raise _Unknown() from None
        cwd = str(self.base) if self.base else "."
        out = []
        for andor in tree.parts:
            if andor.kind != "andor":
                raise _Unknown()
            for _, pipe in andor.parts:
                if pipe.kind != "pipe" or len(pipe.parts) != 1 or not isinstance(pipe.parts[0], Cmd):
                    raise _Unknown()
                cmd = pipe.parts[0]
                argv = []
                for t in cmd.words:
                    fields, unk = self.expand(t.text, p)
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

    def _brace(self, inner: str, text: str, end: int, p: Path_, quoted: bool) -> tuple[str, int, bool, tuple | None]:
        m = re.match(r"(#?)(!?)([A-Za-z_]\w*|[0-9]+|[@*#])(\[([^\]]*)\])?(.*)$", inner, re.S)
        if not m:
            return text, end, True, None
        length, indirect, name, _, index, op = m.groups()
        value = self.lookup(name, p)
        if indirect and isinstance(value, str):
            name, value = value, self.lookup(value, p)
        if isinstance(value, tuple) and index is None and name not in ("@", "*"):
            value = value[0] if value else ""
        if index is not None:
            if value is None:
                items = None
            else:
                arr = value if isinstance(value, tuple) else (value,)
                if index in ("@", "*"):
                    items = arr
                else:
                    try:
                        k = int(self.arith(index, p))
                    except (_Unknown, ValueError):
                        return text, end, True, None
                    items = None
                    value = arr[k] if -len(arr) <= k < len(arr) else ""
            if items is not None:
                if length:
                    return str(len(items)), end, False, None
                if op:
                    items = tuple(self._apply_op(x, op, p) for x in items)
                return (" ".join(items), end, False, None) if index == "*" and quoted else ("", end, False, items)
        if length:
            if value is None:
                self.unresolved(name, p)
                return text, end, True, None
            return str(len(value) if isinstance(value, str) else len(value)), end, False, None
        if name in ("@", "*") and isinstance(value, tuple):
            return "", end, False, value
        mm = re.match(r"(:?)([-=+?])(.*)$", op, re.S)
        if mm:
            colon, kind, word = mm.groups()
            is_set = value is not None and not (colon and value == "")
            if kind == "+":
                return (self._word(word, p) if is_set else ""), end, False, None
            if is_set:
                return value, end, False, None
            if kind == "?":
                self.unresolved(name, p)
                return text, end, True, None
            fill = self._word(word, p)
            if kind == "=":
                p.vars[name] = fill
            return fill, end, False, None
        if value is None:
            self.unresolved(name, p)
            return text, end, True, None
        return self._apply_op(value, op, p), end, False, None

    def _word(self, word: str, p: Path_) -> str:
        fields, unknown = self.expand(word, p, split=False)
        if unknown:
            raise _Unknown()
        return " ".join(fields)

    def _apply_op(self, value: str, op: str, p: Path_) -> str:
        if not op:
            return value
        mm = re.fullmatch(r"(##?|%%?)(.*)", op, re.S)
        if mm:
            return _strip(value, self._word(mm.group(2), p), longest=len(mm.group(1)) == 2, suffix=mm.group(1)[0] == "%")
        mm = re.fullmatch(r"(//?)([^/]*)(?:/(.*))?", op, re.S)
        if mm:
            pat, rep = fnmatch.translate(self._word(mm.group(2), p)).removesuffix(r"\Z"), self._word(mm.group(3) or "", p)
            pat = pat.removeprefix("(?s:").removesuffix(")")
            try:
                return re.sub(pat, lambda _: rep, value, count=0 if mm.group(1) == "//" else 1)
            except re.error:
                return value
        mm = re.fullmatch(r":(-?\s*\d+)(?::(\d+))?", op)
        if mm:
            start = int(mm.group(1))
            return value[start:start + int(mm.group(2))] if mm.group(2) else value[start:]
        if op == "^^":
            return value.upper()
        if op == ",,":
            return value.lower()
        return value

    # -------------------------------------------------------------- arithmetic
    def arith(self, expr: str, p: Path_) -> int:
        expr = expr.strip()
        expr, _ = self.expand(expr, p, split=False) if "$" in expr else ([expr], False)
        expr = " ".join(expr)
        m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*(\+\+|--)\s*|\s*(\+\+|--)\s*([A-Za-z_]\w*)\s*", expr)
        if m:
            name = m.group(1) or m.group(4)
            old = self._int_var(name, p)
            new = old + (1 if "++" in expr else -1)
            p.vars[name] = str(new)
            return old if m.group(1) else new
        m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*([-+*/%]?)=(?!=)(.*)", expr, re.S)
        if m:
            name, op, rhs = m.groups()
            value = _safe_eval(rhs, lambda n: self._int_var(n, p))
            if op:
                value = _safe_eval(f"{self._int_var(name, p)} {op} ({value})", lambda n: 0)
            p.vars[name] = str(value)
            return value
        return _safe_eval(expr, lambda n: self._int_var(n, p))

    def _int_var(self, name: str, p: Path_) -> int:
        value = self.lookup(name, p)
        if value is None:
            raise _Unknown()
        if isinstance(value, tuple):
            value = value[0] if value else ""
        value = value.strip() or "0"
        if re.fullmatch(r"[-+]?\d+", value):
            return int(value)
        if re.fullmatch(r"[A-Za-z_]\w*", value) and value != name:
            return self._int_var(value, p)
        return _safe_eval(value, lambda n: self._int_var(n, p))


def _strip(value: str, pattern: str, longest: bool, suffix: bool) -> str:
    """${V#p}, ${V##p}, ${V%p}, ${V%%p}: the shortest or longest match of p cut from the start or end."""
    cuts = range(len(value) + 1) if longest == suffix else range(len(value), -1, -1)
    for k in cuts:
        if fnmatch.fnmatchcase(value[k:] if suffix else value[:k], pattern):
            return value[:k] if suffix else value[k:]
    return value


_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod,
        ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
        ast.BitXor: operator.xor, ast.Pow: operator.pow}
_CMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Eq: operator.eq,
        ast.NotEq: operator.ne}
LIMIT = 1 << 63


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


def _safe_eval(expr: str, var: Callable[[str], int]) -> int:
    """Bash integer arithmetic on 64-bit values: + - * / % ** << >> & | ^, comparisons, && || !,
    and a ? b : c; names are variables. Anything else is unknown."""
    text = expr.replace("&&", " and ").replace("||", " or ")
    text = re.sub(r"!(?!=)", " not ", text)
    m = re.fullmatch(r"(.+?)\?(.+):(.+)", text, re.S)
    if m:
        return _safe_eval(m.group(2), var) if _safe_eval(m.group(1), var) else _safe_eval(m.group(3), var)
    text = re.sub(r"\b0[xX]([0-9a-fA-F]+)\b", lambda mm: str(int(mm.group(1), 16)), text)
    try:
        tree = ast.parse(text.strip() or "0", mode="eval")
    except SyntaxError:
        raise _Unknown() from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return var(node.id)
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand)
            if isinstance(node.op, ast.USub):
                return -v
            if isinstance(node.op, ast.UAdd):
                return v
            if isinstance(node.op, ast.Not):
                return int(not v)
            if isinstance(node.op, ast.Invert):
                return ~v
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                if b == 0:
                    raise _Unknown()
                if isinstance(node.op, ast.Mod):
                    return int(a - b * int(a / b))
                return int(a / b)
            if isinstance(node.op, ast.Pow) and (b < 0 or b > 64 or abs(a) > LIMIT):
                raise _Unknown()
            if isinstance(node.op, (ast.LShift, ast.RShift)) and not 0 <= b < 64:
                raise _Unknown()
            fn = _BIN.get(type(node.op))
            if fn is None:
                raise _Unknown()
            out = fn(a, b)
            if abs(out) >= LIMIT:
                raise _Unknown()
            return out
        if isinstance(node, ast.BoolOp):
            vals = [ev(v) for v in node.values]
            return int(all(vals)) if isinstance(node.op, ast.And) else int(any(vals))
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, right in zip(node.ops, node.comparators):
                r = ev(right)
                fn = _CMP.get(type(op))
                if fn is None or not fn(left, r):
                    return 0
                left = r
            return 1
        raise _Unknown()

    return ev(tree)


def read(text: str, script_path: Path | None = None, env: dict[str, str] | None = None,
         positional: tuple[str, ...] | None = None) -> Reading:
    """Every path through the script, each with its launches. Raises ShellSyntax for a script
    bash itself could not parse."""
    return Reader(script_path, env, positional).read(text)
