"""Hostile inputs of kinds the generated probes (test_fuzz_schema.py, test_fuzz_runs.py) do not
make, each through the command line as a user or a script would send it: request files that are
huge, binary, UTF-16, with duplicate keys, odd numbers or deep nesting; request paths that are
sockets, devices, loops or names with a newline; stdin empty, closed or a folder; flags given
twice; odd environment variables (HOME unset, ASCII or UTF-16 stdio, a deleted working folder,
no usable temporary folder); output folders no one may write; stdout closed by its reader;
validate given a 10 MB one-line script or one that would fork-bomb; logs of 10^6 lines or one
50 MB line; hostile tokenizer folders; two identical runs at once; dry runs that must write nothing.

Every case asserts the contract: one strict-JSON envelope of the tool on stdout, the exit code its
answer documents, an error code other than internal with a message and fix (and where, for an
error about the request), no traceback and no raw escape sequence on stderr, an answer within
TIME_BOUND_S, and nothing written outside the paths the request names (a dry run: nothing at all,
the parser cache included). Each tool process runs under the probes' memory cap.

Not here: stdin that is a folder (Python itself stops before any code of the skill runs: "Fatal
Python error: init_sys_streams"), a full disk (no small file system can be mounted here), and
permission denied as such (the tests run as root, whom chmod 000 does not stop; sysfs, which
refuses even root, stands in for a folder no one may write).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import ROOT
from test_fuzz_schema import (
    BASE,
    GOOD_FILES,
    SECRET,
    _prepared,
    _sandbox,
    _snapshot,
    answer_problem,
    cap_memory,
    written_outside,
)

from megatron_skill.contract import exit_code
from megatron_skill.errors import EXIT_CODES

LAUNCH = str(ROOT / "tools" / "launch.py")
# No hang: an answer within 60 s of the process's start. On an idle 2-core machine the slowest case
# (render writing a script: Python, torch and Megatron's parser imported) answers in 5 s and logs'
# 10^6 lines in 10 s; with other work on the machine (load 5-6, three probes at once) they and a
# real prepare-data took up to 46 s.
TIME_BOUND_S = 60
TOOLS = sorted(BASE)
NEEDS_WHERE = {"bad_request", "bad_model", "not_found"}  # an error about the request says where in it
MiB = 2**20
# A numeric field of each tool's request (on-event, doctor and import-hf have none at the top:
# a key it does not know instead).
NUMBER_FIELD = {"plan": "num_gpus", "render": "num_gpus", "train": "seq_length", "bench": "num_gpus",
                "validate": "num_gpus", "logs": "seq_length", "prepare-data": "workers", "export-hf": "max_shard_gib"}


@dataclasses.dataclass
class Case:
    cls: str
    name: str
    tool: str
    argv: list[str] = dataclasses.field(default_factory=list)   # after the tool's name
    request: Any = None        # dict, bytes or callable(work) -> either: written to work/request.json
    stdin: Any = None          # bytes, "closed", or a path relative to work opened as stdin
    setup: Callable[[Path, Path], None] | None = None  # (root, work), before the snapshot
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)  # None: unset
    allowed: tuple[str, ...] = ()   # paths (relative to work) the case may write below
    expect: tuple[str, ...] | None = None   # the outcomes allowed ("ok" or error codes); None: any documented
    cwd: str = "work"   # "gone": a folder removed after the process starts in it (by another shell)
    close_stdout: bool = False     # the reader goes away before the answer (| head -c 0)
    close_stderr: bool = False
    after: Callable[[Path, Path, dict | None], str | None] | None = None  # extra check

    @property
    def id(self) -> str:
        return f"{self.cls}-{self.tool}-{self.name}"


def _base(tool: str, **over) -> dict:
    """The tool's valid request (a dry run where it would act), with over merged in."""
    return {**_prepared(tool, BASE[tool]), **over}


# ---- the sandbox of a case ---------------------------------------------------------------------
def _prepare(root: Path) -> Path:
    work = _sandbox(root)
    (work / "in" / "tok").mkdir()
    for name in ("tokenizer_config.json", "tokenizer.json"):
        (work / "in" / "tok" / name).write_bytes(GOOD_FILES[name])
    (root / "outside").mkdir()
    (root / "outside" / "mine.txt").write_text("a file of the user's\n")
    (root / "cache").mkdir()
    return work


def _dry(case: Case, request: Any) -> bool:
    return "--dry-run" in case.argv or (isinstance(request, dict) and request.get("dry_run") is True)


def _run(case: Case, root: Path) -> tuple[list[str], dict | None]:
    """Run one case in root; the problems found (none: the contract held) and the answer."""
    work = _prepare(root)
    if case.setup:
        case.setup(root, work)
    request = case.request(work) if callable(case.request) else case.request
    argv = list(case.argv)
    if request is not None:
        (work / "request.json").write_bytes(request if isinstance(request, bytes) else json.dumps(request).encode())
        argv = ["--request", "request.json", *argv]
    env = {**os.environ, "HOME": str(root / "home"), "MEGATRON_SKILL_CACHE": str(root / "cache"),
           "MEGATRON_SKILL_EVENTS_SECRET": SECRET, "PYTHONWARNINGS": "ignore"}
    env.pop("XDG_CACHE_HOME", None)
    env.pop("MEGATRON_SKILL_DEBUG", None)
    for key, value in case.env.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value.replace("{root}", str(root))
    stdin: Any = subprocess.DEVNULL
    if isinstance(case.stdin, bytes):
        stdin = subprocess.PIPE
    elif isinstance(case.stdin, str) and case.stdin != "closed":
        stdin = os.open(work / case.stdin if not case.stdin.startswith("/") else case.stdin, os.O_RDONLY)

    def preexec():
        cap_memory()
        if case.stdin == "closed":
            os.close(0)
        if case.close_stderr:
            os.close(2)

    command, cwd = [sys.executable, LAUNCH, case.tool, *argv], work
    if case.cwd == "gone":  # the request's relative paths then have no folder to resolve in
        (root / "gone").mkdir()
        command = ["/bin/sh", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "sh", str(root / "gone"),
                   sys.executable, LAUNCH, case.tool, *[str((work / a).absolute()) if a == "request.json" else a
                                                        for a in argv]]
    before = _snapshot(root)
    started = time.monotonic()
    proc = subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env,
                            preexec_fn=preexec)
    if case.close_stdout:
        proc.stdout.close()
    try:
        out, err = proc.communicate(case.stdin if isinstance(case.stdin, bytes) else None, timeout=TIME_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return [f"no answer within {TIME_BOUND_S} s"], None
    finally:
        if isinstance(stdin, int) and stdin >= 0:
            os.close(stdin)
    seconds = time.monotonic() - started
    out = out or b""
    after = _snapshot(root) if root.exists() else {}
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    allowed = list(case.allowed) + ([] if _dry(case, request) else ["../cache"])  # the parser's verdicts
    allowed += ["../gone"] if case.cwd == "gone" else []
    return _problems(case, proc.returncode, out, err, seconds, changed, work, allowed), _answer(out)


def _answer(out: bytes) -> dict | None:
    try:
        value = json.loads(out.decode("utf-8"), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _problems(case: Case, code: int, out: bytes, err: bytes, seconds: float, changed: list[str],
              work: Path, allowed_paths: list[str]) -> list[str]:
    problems = []
    if b"Traceback (most recent call last)" in out + err:
        problems.append("a traceback: " + (out + err).decode("utf-8", "replace")[-600:])
    if code < 0:
        problems.append(f"killed by signal {-code}")
    if b"\x1b" in err or b"\x07" in err:
        problems.append(f"a raw escape sequence on stderr (a terminal would act on it): {err[-300:]!r}")
    allowed = [Path(os.path.normpath(work / a)) for a in allowed_paths]
    wrong = written_outside(changed, allowed)
    if wrong:
        problems.append(f"wrote outside the request's paths: {wrong[:5]}")
    if seconds > TIME_BOUND_S:
        problems.append(f"answered after {seconds:.1f} s")
    if case.close_stdout:
        if code not in set(EXIT_CODES.values()) | {0, 7}:
            problems.append(f"exit {code} with its reader gone")
        return problems
    env = _answer(out)
    if env is None:
        return problems + [f"stdout is not one strict JSON object: {out[:300]!r} (stderr {err[-300:]!r})"]
    problem = answer_problem(case.tool, env, 0.0, [], False)
    if problem:
        problems.append(problem)
    elif not env["ok"]:
        error = env["error"]
        if error["code"] in NEEDS_WHERE and not error.get("where"):
            problems.append(f"a {error['code']} error without where: {error}")
    if code != exit_code(env):
        problems.append(f"exit {code}, where the answer documents {exit_code(env)}")
    outcome = "ok" if env.get("ok") else env.get("error", {}).get("code")
    if case.expect is not None and outcome not in case.expect:
        problems.append(f"answered {outcome}, expected one of {case.expect}: {json.dumps(env)[:400]}")
    if case.after:
        extra = case.after(work.parent, work, env)
        if extra:
            problems.append(extra)
    return problems


# ---- the cases ---------------------------------------------------------------------------------
CASES: list[Case] = []


def add(*cases: Case) -> None:
    CASES.extend(cases)


def _dup_keys(tool: str) -> bytes:
    """The request with a key given twice: dry_run true then false where the tool acts (a reader who
    sees the first would think it safe), else a field twice with two values."""
    good = _base(tool)
    text = json.dumps(good)[:-1]
    if "dry_run" in good:
        return (text + ', "dry_run": false}').encode()
    key, value = ("num_gpus", 16) if "num_gpus" in good else ("log", "in/other.log") if tool == "logs" else \
        ("args", ["--num-layers", "3"]) if tool == "validate" else ("zz", 1)
    return (text + f', "{key}": {json.dumps(value)}}}').encode()


def _number(tool: str, literal: str) -> bytes:
    field = NUMBER_FIELD.get(tool, "zz_number")
    return (json.dumps(_base(tool))[:-1] + f', "{field}": {literal}}}').encode()


HUGE = "huge.json"  # 100 MiB, made once per run (tests share it read-only)


def _huge(root: Path, work: Path) -> None:
    """request.json: a link to one 100 MiB request shared by the cases of a pytest process (in its
    base temporary folder, beside each case's own)."""
    shared = root.parent / HUGE
    if not shared.is_file():
        _write_huge(shared.with_suffix(".part"))
        shared.with_suffix(".part").rename(shared)
    (work / "request.json").symlink_to(shared)


def _write_huge(path: Path) -> None:
    with open(path, "wb") as f:
        f.write(b'{"model": "')
        chunk = b"a" * MiB
        for _ in range(100):
            f.write(chunk)
        f.write(b'"}')


for tool in TOOLS:
    text = json.dumps(_base(tool)) if tool != "on-event" else None
    add(Case("request_file", "huge_100MiB", tool, ["--request", "request.json"], setup=_huge),
        Case("request_file", "binary_elf", tool, request=Path(sys.executable).resolve().read_bytes()[:4096]),
        Case("request_file", "dup_keys", tool, request=lambda w, t=tool: _dup_keys(t), expect=("bad_request",)),
        Case("request_file", "num_1e308", tool, request=lambda w, t=tool: _number(t, "1e308")),
        Case("request_file", "num_1e309", tool, request=lambda w, t=tool: _number(t, "1e309")),
        Case("request_file", "num_minus_zero", tool, request=lambda w, t=tool: _number(t, "-0")),
        Case("request_file", "num_NaN_literal", tool, request=lambda w, t=tool: _number(t, "NaN")),
        Case("request_file", "int_5000_digits", tool, request=lambda w, t=tool: _number(t, "9" * 5000)),
        Case("request_file", "nested_1e5", tool,
             request=lambda w, t=tool: (json.dumps(_base(t))[:-1] + ', "zz": ' + "[" * 100_000 + "]" * 100_000
                                        + "}").encode()),
        Case("request_file", "empty", tool, request=b""),
        Case("request_file", "top_level_list", tool, request=b"[{}]"),
        Case("request_file", "utf16_bom", tool,
             request=lambda w, t=tool: json.dumps(_base(t)).encode("utf-16")),
        Case("request_file", "utf8_bom", tool,
             request=lambda w, t=tool: b"\xef\xbb\xbf" + json.dumps(_base(t)).encode()),
        Case("request_file", "trailing_garbage", tool,
             request=lambda w, t=tool: json.dumps(_base(t)).encode() + b"\n{}"))


def _socket(root: Path, work: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(work / "sock"))   # bound and left: a socket file nobody listens on


def _unreadable(root: Path, work: Path) -> None:
    (work / "locked.json").write_text(json.dumps(BASE["plan"]))
    (work / "locked.json").chmod(0)
    (work / "locked").mkdir()
    (work / "locked" / "config.json").write_bytes((work / "in/hf/config.json").read_bytes())
    (work / "locked").chmod(0)


def _newline_name(root: Path, work: Path) -> None:
    (work / "req\nuest.json").write_text(json.dumps(BASE["plan"]))


for tool in ("plan", "train", "on-event"):
    add(Case("request_path", "socket", tool, ["--request", "sock"], setup=_socket),
        Case("request_path", "folder", tool, ["--request", "in"]),
        Case("request_path", "dev_urandom", tool, ["--request", "/dev/urandom"]),
        Case("request_path", "dev_full", tool, ["--request", "/dev/full"]),
        Case("request_path", "proc_self_mem", tool, ["--request", "/proc/self/mem"]),
        Case("request_path", "proc_kmsg_like", tool, ["--request", "/proc/self/status"]),
        Case("request_path", "chmod_000", tool, ["--request", "locked.json"], setup=_unreadable),
        Case("request_path", "dotdot_to_outside", tool, ["--request", "../outside/mine.txt"]),
        Case("request_path", "newline_in_name", tool, ["--request", "req\nuest.json"], setup=_newline_name,
             expect=("ok", "bad_request") if tool == "plan" else None),
        Case("request_path", "empty_name", tool, ["--request", ""]))

for tool in ("plan", "train", "on-event", "doctor"):
    add(Case("stdin", "empty", tool, ["--request", "-"], stdin=b"", expect=("bad_request",)),
        Case("stdin", "closed", tool, ["--request", "-"], stdin="closed", expect=("bad_request",)),
        Case("stdin", "dev_zero", tool, ["--request", "-"], stdin="/dev/zero", expect=("bad_request",)),
        Case("stdin", "huge_pipe", tool, ["--request", "-"], stdin=b" " * (70 * MiB), expect=("bad_request",)))

# Flags: given twice, with the request too, odd values.
add(Case("flags", "twice_different", "plan", ["--model", "llama3-8b", "--num-gpus", "8", "--num-gpus", "16"],
         expect=("bad_request",)),
    Case("flags", "twice_same", "plan", ["--model", "llama3-8b", "--num-gpus", "8", "--num-gpus", "8"],
         expect=("ok", "bad_request")),
    Case("flags", "request_twice", "plan", ["--request", "in/a.json", "--request", "in/b.json"],
         setup=lambda r, w: [(w / "in/a.json").write_text(json.dumps(BASE["plan"])),
                             (w / "in/b.json").write_text(json.dumps({**BASE["plan"], "num_gpus": 16}))],
         expect=("bad_request",)),
    Case("flags", "dry_run_twice", "train", ["--model", "tiny-gpt", "--backend", "cpu", "--runs-root", "runs",
                                             "--dry-run", "--dry-run"], expect=("ok", "bad_request")),
    Case("flags", "flag_overrides_request_dry_run", "prepare-data", ["--dry-run"],
         request={**BASE["prepare-data"], "dry_run": False}, expect=("ok",)),
    Case("flags", "no_dry_run_after_dry_run", "train", ["--model", "tiny-gpt", "--backend", "cpu", "--runs-root",
                                                        "runs", "--dry-run", "--no-dry-run"],
         expect=("bad_request",)),
    Case("flags", "abbreviated", "plan", ["--mod", "llama3-8b", "--num-g", "8"]),
    Case("flags", "equals_twice", "plan", ["--model=llama3-8b", "--num-gpus=8=9"], expect=("bad_request",)),
    Case("flags", "value_with_newline", "render", ["--model", "llama3.2-1b", "--num-gpus", "8", "--output-dir",
                                                   "out\nx", "--dry-run"]),
    Case("flags", "100KB_value", "plan", ["--model", "m" * 100_000, "--num-gpus", "8"], expect=("not_found",
                                                                                                "bad_request")),
    Case("flags", "unknown_flag", "logs", ["--log", "in/train.log", "--rm-rf", "/"], expect=("bad_request",)),
    Case("flags", "double_dash", "logs", ["--", "--log", "in/train.log"], expect=("bad_request",)),
    Case("flags", "json_flag_deep", "plan", ["--model", "llama3-8b", "--num-gpus", "8", "--constraints",
                                             "[" * 30_000 + "]" * 30_000], expect=("bad_request",)),
    Case("flags", "json_flag_nan", "plan", ["--model", "llama3-8b", "--num-gpus", "8", "--constraints",
                                            '{"tp": NaN}'], expect=("bad_request",)),
    Case("flags", "args_empty", "validate", ["--args"], expect=("bad_request", "ok")),
    Case("flags", "args_then_own_flag_twice", "validate", ["--num-gpus", "8", "--args", "--num-layers", "2",
                                                           "--num-gpus", "16"], expect=("bad_request",)),
    Case("flags", "lone_surrogate_arg", "plan", ["--model", "llama\udcff", "--num-gpus", "8"],
         expect=("bad_request", "not_found")))

# The environment.
NON_ASCII = {"model": "llama3-8b", "num_gpus": 8, "gpu": "h100-\u00e9\u4e2d"}  # an error that quotes text
for tool, request in (("plan", NON_ASCII), ("render", _base("render", output_dir="out/\u00e9t\u00e9")),
                      ("prepare-data", _base("prepare-data", output_prefix="data/\u00e9/x")),
                      ("logs", {"log": "in/\u00e9.log"})):
    add(Case("env", "pythonioencoding_ascii", tool, request=request, env={"PYTHONIOENCODING": "ascii"}),
        Case("env", "pythonioencoding_utf16", tool, request=request, env={"PYTHONIOENCODING": "utf-16"}),
        Case("env", "lang_c", tool, request=request, env={"LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0",
                                                          "PYTHONCOERCECLOCALE": "0"}))
for tool in ("plan", "render", "train", "validate", "prepare-data", "doctor", "import-hf"):
    request = _base(tool) if tool != "render" else _base("render", output_dir=None)
    request = {k: v for k, v in request.items() if v is not None}
    add(Case("env", "home_unset", tool, request=request, env={"HOME": None}),
        Case("env", "home_dev_null", tool, request=request, env={"HOME": "/dev/null"}),
        Case("env", "tmpdir_missing", tool, request=request, env={"TMPDIR": "{root}/no/such/tmp"}),
        Case("env", "cwd_deleted", tool, request=request, cwd="gone"),
        Case("env", "path_empty", tool, request=request, env={"PATH": ""}))
add(Case("env", "cache_is_dev_null", "validate", request=BASE["validate"], env={"MEGATRON_SKILL_CACHE": "/dev/null"}),
    Case("env", "cache_is_a_file", "render", request=_base("render"), env={"MEGATRON_SKILL_CACHE": "{root}/outside/mine.txt"}),
    Case("env", "runs_env_dev_null", "render", request=_base("render", output_dir=None),
         env={"MEGATRON_SKILL_RUNS": "/dev/null"}),
    Case("env", "secret_file_socket", "on-event", request=_base("on-event"),
         env={"MEGATRON_SKILL_EVENTS_SECRET": None, "MEGATRON_SKILL_EVENTS_SECRET_FILE": "{root}/work/sock"},
         setup=_socket, expect=("refused", "bad_request", "environment")),
    Case("env", "columns_garbage", "plan", request=BASE["plan"], env={"COLUMNS": "-5", "LINES": "x"}))


# Text a terminal acts on (escape sequences that recolour, retitle or clear it) in what the tools
# quote on stderr, and text so long that an answer quoting it would be its size.
ESC = "\x1b]0;owned\x07\x1b[2J\x1b[31m"
for tool, request, allowed in (
        ("plan", {"model": "llama" + ESC, "num_gpus": 8}, ()),
        ("plan", {"hf_config": "in/" + ESC, "num_gpus": 8}, ()),
        ("prepare-data", _base("prepare-data", dry_run=False, output_prefix="data/" + ESC + "x"), ("data",)),
        ("render", _base("render", dry_run=False, output_dir="out" + ESC), ("out" + ESC,)),
        ("validate", {"script": "in/" + ESC + ".sh"}, ()),
        ("logs", {"log": "in/train.log", "gpu": ESC}, ()),
        ("train", {**BASE["train"], "dry_run": True, "runs_root": "runs" + ESC}, ())):
    add(Case("terminal", f"escape_{len(CASES)}", tool, request=request, allowed=allowed))
for tool, field in (("plan", "model"), ("render", "model"), ("train", "model"), ("logs", "log"),
                    ("import-hf", "hf_model"), ("validate", "script")):
    add(Case("request_file", "string_50MB", tool,
             request=lambda w, t=tool, f=field: json.dumps(_base(t, **{f: "a" * (50 * MiB)})).encode(),
             after=lambda r, w, env: f"an answer of {len(json.dumps(env)):,} characters" if len(json.dumps(env)) > 50_000
             else None))

# Output folders no one may write (a read-only file system: sysfs refuses even root), and files the
# outputs would replace that are links to a user's file.
READ_ONLY = "/sys/fs"
add(Case("output", "read_only_folder", "render", request=_base("render", dry_run=False, output_dir=READ_ONLY + "/x"),
         expect=("bad_request", "not_found", "environment")),
    Case("output", "read_only_existing", "render", request=_base("render", dry_run=False, output_dir=READ_ONLY),
         expect=("bad_request", "not_found", "environment")),
    Case("output", "read_only_prefix", "prepare-data",
         request=_base("prepare-data", dry_run=False, output_prefix=READ_ONLY + "/x"),
         expect=("bad_request", "not_found", "environment")),
    Case("output", "read_only_runs_root", "train",
         request={**BASE["train"], "runs_root": READ_ONLY + "/runs", "dry_run": False},
         expect=("bad_request", "not_found", "environment")),
    Case("output", "read_only_import", "import-hf", request=_base("import-hf", dry_run=False, output=READ_ONLY + "/c"),
         expect=("bad_request", "not_found", "environment", "bad_model")),
    Case("output", "read_only_export", "export-hf", request=_base("export-hf", dry_run=False, output=READ_ONLY + "/e"),
         expect=("bad_request", "not_found", "environment", "bad_model")),
    Case("output", "chmod_000_output", "render", request=_base("render", dry_run=False, output_dir="locked/out"),
         setup=_unreadable, allowed=("locked",)),
    Case("output", "dotdot_output", "render", request=_base("render", dry_run=False, output_dir="../outside/r"),
         allowed=("../outside/r", "../cache"), expect=("ok",)),
    Case("output", "newline_output", "render", request=_base("render", dry_run=False, output_dir="o\nut"),
         allowed=("o\nut", "../cache")),
    Case("output", "prefix_bin_is_link_to_user_file", "prepare-data",
         request=_base("prepare-data", dry_run=False, overwrite=True),
         setup=lambda r, w: [(w / "data").mkdir(), (w / "data/x.bin").symlink_to(r / "outside/mine.txt"),
                             (w / "data/x.idx").symlink_to(r / "outside/mine.txt")],
         allowed=("data",)),
    Case("output", "prefix_bin_is_a_folder", "prepare-data", request=_base("prepare-data", dry_run=False),
         setup=lambda r, w: (w / "data/x.bin").mkdir(parents=True), allowed=("data",),
         expect=("bad_request", "conflict")),
    Case("output", "script_is_link_to_user_file", "render", request=_base("render", dry_run=False),
         setup=lambda r, w: [(w / "out").mkdir()] + [(w / "out" / n).symlink_to(r / "outside/mine.txt")
                                                      for n in ("launch.sh", "train.sh", "request.json",
                                                                "render.json", "plan.json")],
         allowed=("out", "../cache")),
    Case("output", "bin_is_link_to_dev_full", "prepare-data", request=_base("prepare-data", dry_run=False,
                                                                            overwrite=True),
         setup=lambda r, w: [(w / "data").mkdir(), (w / "data/x.bin").symlink_to("/dev/full")], allowed=("data",)),
    Case("output", "runs_root_socket", "train", request={**BASE["train"], "runs_root": "sock", "dry_run": True},
         setup=_socket, expect=("bad_request",)),
    Case("output", "hf_config_in_locked_folder", "plan", request={"hf_config": "locked", "num_gpus": 8},
         setup=_unreadable))

# validate's scripts: it reads them, never runs them.
BOMB = ":(){ :|:& };:\n"
MARK = "touch {root}/PWNED; echo pwned > {root}/outside/mine.txt\n"


def _script(name: str, text: bytes | Callable[[Path], bytes]):
    def setup(root: Path, work: Path) -> None:
        data = text(root) if callable(text) else text
        (work / name).write_bytes(data)
    return setup


def _not_run(root: Path, work: Path, env) -> str | None:
    if (root / "PWNED").exists() or "pwned" in (root / "outside/mine.txt").read_text():
        return "validate ran the script"
    return None


add(Case("script", "10MB_single_line", "validate", ["--script", "s.sh"],
         setup=_script("s.sh", b"torchrun pretrain_gpt.py " + b"--num-layers 2 " * 700_000 + b"\n")),
    Case("script", "10MB_no_newline_word", "validate", ["--script", "s.sh"],
         setup=_script("s.sh", b"x" * (10 * MiB))),
    Case("script", "fork_bomb", "validate", ["--script", "s.sh"],
         setup=_script("s.sh", lambda r: (MARK.format(root=r) + BOMB + "torchrun pretrain_gpt.py --num-layers 2\n")
                       .encode()), after=_not_run),
    Case("script", "fork_bomb_text", "validate", ["--script-text",
                                                  ":(){ :|:& };: ; torchrun pretrain_gpt.py --num-layers 2"]),
    Case("script", "command_substitution", "validate", ["--script", "s.sh"],
         setup=_script("s.sh", lambda r: f"torchrun pretrain_gpt.py --num-layers $(touch {r}/PWNED; echo 2) "
                       f"--save \"`touch {r}/PWNED`\"\n".encode()), after=_not_run),
    Case("script", "backslash_lines_1e5", "validate", ["--script", "s.sh"],
         setup=_script("s.sh", b"torchrun pretrain_gpt.py \\\n" + b"  --num-layers 2 \\\n" * 100_000 + b"\n")),
    Case("script", "unterminated_quote", "validate", ["--script", "s.sh"],
         setup=_script("s.sh", b"torchrun pretrain_gpt.py --save '/x\n" * 3)),
    Case("script", "utf16", "validate", ["--script", "s.sh"],
         setup=_script("s.sh", "torchrun pretrain_gpt.py --num-layers 2\n".encode("utf-16"))),
    Case("script", "nul_bytes", "validate", ["--script", "s.sh"],
         setup=_script("s.sh", b"torchrun pretrain_gpt.py --num-layers 2\x00\x00 --hidden-size 64\n")),
    Case("script", "elf_binary", "validate", ["--script", str(Path(sys.executable).resolve())]),
    Case("script", "heredoc_and_eval", "validate", ["--script", "s.sh"],
         setup=_script("s.sh", lambda r: f"eval \"touch {r}/PWNED\"\ncat <<EOF | bash\ntouch {r}/PWNED\nEOF\n"
                       "torchrun pretrain_gpt.py --num-layers 2\n".encode()), after=_not_run),
    Case("script", "script_args_hostile", "validate", ["--script", "in/launch.sh", "--script-args", "$(reboot)",
                                                       "; rm -rf /", "\n"]),
    Case("script", "render_request_wrong_types", "validate",
         request={"render_request": {"num_gpus": "x", "model": []}}, expect=("bad_request",)),
    Case("script", "args_million", "validate", request={"args": ["--num-layers", "2"] * 50_000}))


# logs: huge files.
def _log(kind: str):
    def setup(root: Path, work: Path) -> None:
        line = (" [2026-12-03 10:00:01] iteration        1/   10 | elapsed time per iteration (ms): 100.0 | "
                "global batch size:     8 | lm loss: 3.2E+00 |\n").encode()
        with open(work / "in/big.log", "wb") as f:
            if kind == "lines":
                f.write(line * 1_000_000)
            elif kind == "one_line":
                f.write(b"x" * (50 * MiB))
            elif kind == "sparse":
                f.truncate(2**30)
            elif kind == "utf16":
                f.write(line.decode().encode("utf-16") * 100)
            elif kind == "cr_only":
                f.write(line.replace(b"\n", b"\r") * 10_000)
            elif kind == "binary":
                f.write(Path(sys.executable).resolve().read_bytes()[:2 * MiB])
    return setup


for kind in ("lines", "one_line", "sparse", "utf16", "cr_only", "binary"):
    add(Case("logs", kind, "logs", request={"log": "in/big.log"}, setup=_log(kind)))
add(Case("logs", "plot_to_user_file", "logs", request={"log": "in/train.log", "plot": "../outside/mine.txt"},
         allowed=("../outside/mine.txt",)),
    Case("logs", "plot_to_dev_full", "logs", request={"log": "in/train.log", "plot": "/dev/full"}),
    Case("logs", "plot_to_read_only", "logs", request={"log": "in/train.log", "plot": READ_ONLY + "/p.png"}))


# prepare-data: hostile tokenizer folders.
def _tok(files: dict[str, bytes | None]):
    def setup(root: Path, work: Path) -> None:
        for name, data in files.items():
            path = work / "in/tok" / name
            if path.exists() or path.is_symlink():
                path.unlink()
            if data is None:
                os.mkfifo(path)
            elif data == b"<folder>":
                path.mkdir()
            elif data == b"<loop>":
                path.symlink_to(path)
            else:
                path.write_bytes(data)
    return setup


TOK = json.loads(GOOD_FILES["tokenizer.json"])
TOK_CASES = {
    "config_dup_keys": {"tokenizer_config.json": b'{"eos_token": "</s>", "eos_token": {"content": 5}}'},
    "config_nested_1e5": {"tokenizer_config.json": b'{"eos_token": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"},
    "config_1e400": {"tokenizer_config.json": b'{"eos_token": "</s>", "model_max_length": 1e400}'},
    "config_utf16": {"tokenizer_config.json": '{"eos_token": "</s>"}'.encode("utf-16")},
    "config_list": {"tokenizer_config.json": b"[]"},
    "config_eos_object_odd": {"tokenizer_config.json": b'{"eos_token": {"content": ["</s>"], "__type": 1}}'},
    "config_added_tokens_odd": {"tokenizer_config.json":
                                b'{"eos_token": "</s>", "added_tokens_decoder": {"x": 1, "-1": {"content": 7}}}'},
    "config_class_hostile": {"tokenizer_config.json": b'{"eos_token": "</s>", "tokenizer_class": "os.system", '
                             b'"auto_map": {"AutoTokenizer": ["evil.Tok", null]}}'},
    "config_fifo": {"tokenizer_config.json": None},
    "config_loop": {"tokenizer_config.json": b"<loop>"},
    "tokenizer_json_folder": {"tokenizer.json": b"<folder>"},
    "tokenizer_json_fifo": {"tokenizer.json": None},
    "tokenizer_json_nested": {"tokenizer.json": b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"},
    "tokenizer_json_wrong_model": {"tokenizer.json": json.dumps({**TOK, "model": {"type": "BPE", "vocab": [1, 2],
                                                                                 "merges": {"a": 1}}}).encode()},
    "tokenizer_json_huge_vocab": {"tokenizer.json": json.dumps(
        {**TOK, "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(300_000)}, "unk_token": "t0"}}
    ).encode()},
    "tokenizer_json_truncated": {"tokenizer.json": GOOD_FILES["tokenizer.json"][:20]},
    "special_tokens_map_fifo": {"special_tokens_map.json": None},
    "vocab_files_hostile": {"vocab.json": b"[" * 100_000, "merges.txt": b"\xff\xfe" * 1000},
    "tokenizer_py_present": {"tokenization_evil.py": b"import os\nopen('PWNED','w')\n",
                             "tokenizer_config.json": b'{"eos_token": "</s>", "auto_map": {"AutoTokenizer": '
                             b'["tokenization_evil.EvilTok", null]}}'},
}


def _no_pwned(root: Path, work: Path, env) -> str | None:
    return "code from the tokenizer folder ran" if list(root.rglob("PWNED")) else None


for name, files in TOK_CASES.items():
    add(Case("tokenizer", name, "prepare-data", request=_base("prepare-data", tokenizer="in/tok"), setup=_tok(files),
             after=_no_pwned))
add(Case("tokenizer", "folder_is_socket", "prepare-data", request=_base("prepare-data", tokenizer="sock"),
         setup=_socket, expect=("bad_request", "not_found")),
    Case("tokenizer", "real_run_hostile_config", "prepare-data",
         request=_base("prepare-data", tokenizer="in/tok", dry_run=False), setup=_tok(TOK_CASES["config_1e400"]),
         allowed=("data",)))

# Inputs of prepare-data, import-hf and export-hf given as odd paths.
for tool, field in (("prepare-data", "input"), ("import-hf", "hf_model"), ("export-hf", "checkpoint"),
                    ("plan", "hf_config"), ("logs", "log")):
    def req(value, tool=tool, field=field):
        return _base(tool, **{field: [value] if tool == "prepare-data" else value})
    add(Case("input_path", "socket", tool, request=req("sock"), setup=_socket, expect=("bad_request", "not_found")),
        Case("input_path", "dev_urandom", tool, request=req("/dev/urandom"), expect=("bad_request", "not_found")),
        Case("input_path", "proc_self_mem", tool, request=req("/proc/self/mem"),
             expect=("bad_request", "not_found") + (("ok",) if tool == "prepare-data" else ())),
        Case("input_path", "newline", tool, request=req("in\n/train.log"), expect=("bad_request", "not_found")),
        Case("input_path", "chmod_000", tool, request=req("locked" if tool != "logs" else "locked.json"),
             setup=_unreadable))


# Two identical runs at once: one runs, the other waits, finds it done or answers a conflict; the
# output is whole either way.
CONCURRENT = [("prepare-data", _base("prepare-data", dry_run=False), ("data",)),
              ("render", _base("render", dry_run=False), ("out", "../cache")),
              ("train", {**BASE["train"], "training": {"train_iters": 2}}, ("runs",))]

# SIGPIPE and closed streams.
add(Case("streams", "stdout_reader_gone", "plan", ["--model", "llama3-8b", "--num-gpus", "1024", "--pretty",
                                                   "--top", "50"], close_stdout=True),
    Case("streams", "stdout_reader_gone", "validate", ["--script", "in/launch.sh"], close_stdout=True),
    Case("streams", "stdout_reader_gone", "doctor", [], close_stdout=True),
    Case("streams", "stdout_reader_gone", "prepare-data", ["--input", "in/corpus.jsonl", "--output-prefix", "data/y"],
         close_stdout=True, allowed=("data",)),
    Case("streams", "stderr_closed", "prepare-data", ["--input", "in/corpus.jsonl", "--output-prefix", "data/y"],
         close_stderr=True, allowed=("data",), expect=("ok",)),
    Case("streams", "stderr_closed", "plan", ["--model", "llama3-8b", "--num-gpus", "8"], close_stderr=True,
         expect=("ok",)),
    Case("streams", "stderr_closed", "train", ["--model", "tiny-gpt", "--backend", "cpu", "--runs-root", "runs",
                                               "--dry-run"], close_stderr=True, expect=("ok",)))

# Dry runs with a cold parser cache: nothing written anywhere.
for tool in ("render", "bench", "train", "prepare-data", "import-hf", "export-hf", "on-event"):
    add(Case("dry_run", "cold_cache", tool, request=lambda w, t=tool: _base(t, dry_run=True)))

SLOW = {"request_file-huge_100MiB", "request_file-string_50MB", "stdin-huge_pipe", "logs-lines", "logs-one_line", "logs-sparse",
        "script-10MB_single_line", "script-10MB_no_newline_word", "tokenizer-tokenizer_json_huge_vocab"}


def _params():
    out = []
    for case in CASES:
        marks = [pytest.mark.slow] if f"{case.cls}-{case.name}" in SLOW else []
        out.append(pytest.param(case, id=case.id, marks=marks))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tool,request_,allowed", CONCURRENT, ids=[c[0] for c in CONCURRENT])
def test_the_same_request_twice_at_once(tool, request_, allowed, tmp_path):
    """Two processes given the same request at the same moment: each answers one envelope with a
    documented code, at most one does the work, nothing is written outside its paths."""
    roots = [tmp_path]
    work = _prepare(tmp_path)
    (work / "request.json").write_text(json.dumps(request_))
    env = {**os.environ, "HOME": str(tmp_path / "home"), "MEGATRON_SKILL_CACHE": str(tmp_path / "cache")}
    before = _snapshot(*roots)

    def one(_):
        proc = subprocess.run([sys.executable, LAUNCH, tool, "--request", "request.json"], capture_output=True,
                              cwd=work, env=env, timeout=120, preexec_fn=cap_memory)
        return proc.returncode, _answer(proc.stdout), proc.stderr
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, range(2)))
    after = _snapshot(*roots)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    problems = []
    for code, env_, err in results:
        if env_ is None or code != exit_code(env_) or b"Traceback" in err:
            problems.append(f"exit {code}, answer {env_}, stderr {err[-300:]!r}")
        elif not env_["ok"] and env_["error"]["code"] not in ("conflict",):
            problems.append(f"answered {env_['error']}")
    wrong = written_outside(changed, [Path(os.path.normpath(work / a)) for a in allowed])
    assert not problems and not wrong, (problems, wrong[:5])
    done = [e["result"] for _, e, _ in results if e and e["ok"]]
    statuses = sorted(str(r.get("status") or r.get("state") or "") for r in done)
    assert statuses.count("already_done") + statuses.count("done") + statuses.count("ok") <= 2, statuses
    leftovers = [p for p in changed if ".tmp" in Path(p).name or Path(p).name.endswith(".journal")]
    assert not leftovers, leftovers


def test_the_probe_counts():
    """How many cases of each class this file holds (the report's table)."""
    counts: dict[str, int] = {}
    for case in CASES:
        counts[case.cls] = counts.get(case.cls, 0) + 1
    counts["concurrent"] = len(CONCURRENT)
    print("hostile round 3:", sum(counts.values()), "cases,", counts)
    assert sum(counts.values()) >= 200



# A line of each alternative of each of logs' failure patterns: each is found, and passes the
# word filter that spares the other lines the patterns' searches (adapter/log.py FAILURE_WORDS).
FAILURE_LINES = {
    "out_of_memory": ["torch.OutOfMemoryError: CUDA out of memory. Tried", "OutOfMemoryError raised"],
    "nccl_timeout": ["[Rank 3] Watchdog caught collective operation timeout: WorkNCCL", "NCCL op Timeout after 600",
                     "ProcessGroupNCCL's watchdog timed out", "Some NCCL operations have failed or timed out",
                     "watchdog thread got stuck", "watchdog stuck", "Heartbeat monitor timed out!"],
    "nccl_error": ["NCCL error in: x.cpp", "ncclInternalError: internal", "ncclSystemError", "ncclUnhandledCudaError",
                   "ncclRemoteError", "torch.distributed.DistBackendError: x", "NCCL communicator was aborted"],
    "node_failure": ["srun: error: node7: task 3: Node failure", "slurmstepd: error: *** JOB 5 NODE_FAIL ***",
                     "CUDA error: uncorrectable ECC error encountered", "NVRM: Xid 79, GPU has fallen off the bus",
                     "GPU has fallen off the bus", "CUDA error: unspecified launch failure"],
    "killed": ["Signals.SIGKILL: 9", "died with signal 9", "exitcode  : -9 (pid: 7)", "Killed", "oom-kill:constraint",
               "CANCELLED AT 2026-12-01T10:00:00 DUE TO TIME LIMIT", "JOB 5 DUE TO TIME LIMIT"],
    "kernel_fault": ["RuntimeError: CUDA error: an illegal memory access was encountered",
                     "[rank1]: CUDA error: device-side assert triggered", "CUDA error: misaligned address",
                     "CUDA error: an illegal instruction was encountered", "CUBLAS_STATUS_EXECUTION_FAILED when calling",
                     "Loss.cu:250: nll_loss_forward: block: [0,0,0], thread: [5,0,0] Assertion `t >= 0 && t < "
                     "n_classes` failed."],
    "host_out_of_memory": ["RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 8589934592 bytes", "terminate called after "
                           "throwing an instance of 'std::bad_alloc'", "OSError: [Errno 12] Cannot allocate memory",
                           "[rank0]: MemoryError"],
    "worker_failed": ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
                      "  exitcode  : 1 (pid: 4242)",
                      "failed (exitcode: 1) local_rank: 0 (pid: 4242) of binary: /usr/bin/python"],
    "make_helpers": ["Failed to compile the C++ dataset helper functions", "make: *** [Makefile:9: helpers] Error 1"],
    "missing_fusion": ["No module named 'apex'", "No module named 'transformer_engine'", "apex is not installed",
                       "Transformer Engine >= 2.0 is required"],
}


def test_every_failure_line_passes_the_word_filter():
    from megatron_skill.adapter import log

    patterns = {code: rx for code, rx, _, _ in log.FAILURES}
    assert set(FAILURE_LINES) == set(patterns)
    for code, lines in FAILURE_LINES.items():
        for line in lines:
            assert patterns[code].search(line), (code, line)
            assert log._may_fail(line), f"{line!r} ({code}) holds none of FAILURE_WORDS"
            assert [f["code"] for f in log.parse([line])["failures"]][:1] == [code] or code == "node_failure", line


# ---- checkpoints are pickles: a forged one is refused before anything loads it --------------------
class _Runs:
    """A pickle that would run a command as it is read (what a forged checkpoint file holds)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _forged_checkpoint(root: Path, work: Path, where: str) -> None:
    import pickle

    import torch

    ck = work / "ck"
    it = ck / "iter_0000010"
    it.mkdir(parents=True)
    (ck / "latest_checkpointed_iteration.txt").write_text("10\n")
    evil = _Runs(f"touch {root}/PWNED")
    if where == "metadata":
        (it / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        (it / ".metadata").write_bytes(pickle.dumps(evil, protocol=4))
    elif where == "common":
        (it / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        (it / "common.pt").write_bytes(pickle.dumps(evil, protocol=2))
    elif where == "legacy_zip":
        torch.save({"model": {"w": torch.zeros(2)}, "args": evil}, it / "mp_rank_00.pt")
    elif where == "legacy_folder":
        (it / "mp_rank_00").mkdir()
        (it / "mp_rank_00" / "model_optim_rng.pt").write_bytes(pickle.dumps({"x": [1, evil]}, protocol=0))
    elif where == "nested_bytes":   # torch.storage._load_from_bytes loads a second pickle nobody read
        inner = pickle.dumps(evil)
        (it / "mp_rank_00.pt").write_bytes(
            b"\x80\x02ctorch.storage\n_load_from_bytes\nq\x00C" + bytes([len(inner)]) + inner + b"q\x01\x85q\x02Rq\x03.")
    elif where == "truncated":
        (it / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        (it / ".metadata").write_bytes(pickle.dumps(evil)[:7])


for where in ("metadata", "common", "legacy_zip", "legacy_folder", "nested_bytes", "truncated"):
    for tool, request in (("export-hf", {"checkpoint": "ck", "output": "exported", "model": "tiny-gpt"}),
                          ("export-hf", {"checkpoint": "ck", "output": "exported", "model": "tiny-gpt",
                                         "dry_run": True}),
                          ("train", {**BASE["train"], "dry_run": True, "training": {"pretrained": "ck"}})):
        add(Case("checkpoint", f"forged_{where}{'_dry' if request.get('dry_run') else ''}", tool, request=request,
                 setup=lambda r, w, x=where: _forged_checkpoint(r, w, x), expect=("bad_request",),
                 after=lambda r, w, env: "the checkpoint's pickle ran" if (r / "PWNED").exists() else None))


def _forged_resume(root: Path, work: Path) -> None:
    """The run folder of the request holds a checkpoint someone else put there: the resume would
    unpickle it."""
    import pickle

    from megatron_skill.contract import call

    request = {**BASE["train"], "training": {"train_iters": 2}}
    run_dir = Path(call("train", {**request, "runs_root": str(work / "runs"), "dry_run": True})["result"]["run_dir"])
    it = run_dir / "checkpoints" / "iter_0000001"
    it.mkdir(parents=True)
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1\n")
    (it / "mp_rank_00.pt").write_bytes(pickle.dumps(_Runs(f"touch {root}/PWNED")))


add(Case("checkpoint", "forged_in_the_run_folder", "train",
         request=lambda w: {**BASE["train"], "training": {"train_iters": 2}, "runs_root": str(w / "runs")},
         setup=_forged_resume, allowed=("runs",), expect=("bad_request",),
         after=lambda r, w, env: "the checkpoint's pickle ran" if (r / "PWNED").exists() else None))


# ---- Hugging Face folders whose safetensors headers are hostile (import-hf reads them in a dry run) --
def _safetensors(kind: str):
    def setup(root: Path, work: Path) -> None:
        import struct

        def header(h: bytes) -> bytes:
            return struct.pack("<Q", len(h)) + h
        one = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
        data = {"length_2_63": struct.pack("<Q", 2**63) + b"{}",
                "length_past_end": struct.pack("<Q", 10**9) + b"{}",
                "not_json": header(b"{nope"),
                "dup_keys": header(b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                                   b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}') + bytes(8),
                "unknown_dtype": header(json.dumps({"a": {**one["model.embed_tokens.weight"], "dtype": "Q99"}}).encode())
                + bytes(8),
                "shape_negative_huge": header(json.dumps({"a": {"dtype": "F32", "shape": [-2, 10**30],
                                                                "data_offsets": [0, 8]}}).encode()) + bytes(8),
                "offsets_beyond_file": header(json.dumps({"a": {"dtype": "F32", "shape": [2],
                                                                "data_offsets": [0, 10**12]}}).encode()) + bytes(8),
                "nested_1e5": header(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                "metadata_list": header(json.dumps({"__metadata__": [1], "x": 5}).encode())}.get(kind)
        if data is not None:
            (work / "in/hf/model.safetensors").write_bytes(data)
        elif kind == "index_outside":
            (work / "in/hf/model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": {"a": "../../outside/mine.txt", "b": "/dev/zero", "c": "/proc/self/mem"}}))
        elif kind == "shard_fifo":
            os.mkfifo(work / "in/hf/model.safetensors")
    return setup


for kind in ("length_2_63", "length_past_end", "not_json", "dup_keys", "unknown_dtype", "shape_negative_huge",
             "offsets_beyond_file", "nested_1e5", "metadata_list", "index_outside", "shard_fifo"):
    add(Case("safetensors", kind, "import-hf", request=_base("import-hf", dry_run=True), setup=_safetensors(kind),
             expect=("bad_model", "bad_request", "not_found")))


def test_checkpoints_torch_and_megatron_write_pass_the_pickle_scan(tmp_path):
    """What torch's distributed checkpoint and a legacy Megatron save hold is read as a checkpoint
    (the scan refuses only what no checkpoint names)."""
    import argparse
    import collections

    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_skill import pickles

    dcp.save({"w": torch.zeros(4, 2), "extra": io_bytes()}, checkpoint_id=str(tmp_path / "dist"), no_dist=True)
    legacy = tmp_path / "legacy" / "iter_0000001"
    legacy.mkdir(parents=True)
    import numpy as np
    from megatron.core.enums import ModelType

    torch.save({"model": collections.OrderedDict(w=torch.ones(2, dtype=torch.bfloat16)), "iteration": 1,
                "args": argparse.Namespace(params_dtype=torch.bfloat16, model_type=ModelType.encoder_or_decoder,
                                           seq_length=8),
                "rng_state": [{"random_rng_state": __import__("random").getstate(),
                               "np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}]},
               legacy / "mp_rank_00.pt")
    for folder in (tmp_path / "dist", legacy):
        pickles.scan_checkpoint(folder, "/checkpoint")


def io_bytes():
    import io

    return io.BytesIO(b"common state")


# Last: every case above is in CASES by now.
@pytest.mark.parametrize("case", _params())
def test_hostile(case, tmp_path):
    problems, _ = _run(case, tmp_path)
    assert not problems, f"{case.id}: " + "\n".join(problems)
