"""Hostile requests made from each tool's request schema and from the files it reads: wrong types
at every depth, numbers out of range, text no path can hold, deep nesting, paths that are FIFOs,
devices, loops or below a file, damaged input files, and valid-looking requests near the bounds.

Every request must get one JSON envelope, ok or an error code from errors.EXIT_CODES other than
internal, within TIME_LIMIT_S, and write nothing (dry runs) or only below the paths it names.

The generator is a random.Random with a fixed seed (the same requests every run, as CI wants);
MEGATRON_SKILL_FUZZ_SEED picks other ones and MEGATRON_SKILL_FUZZ_PER_TOOL makes more a tool.
A failure prints the seed, the tool, the request number and the request.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from megatron_skill.contract import call, tools
from megatron_skill.errors import EXIT_CODES

SEED = int(os.environ.get("MEGATRON_SKILL_FUZZ_SEED", "41"))
PER_TOOL = int(os.environ.get("MEGATRON_SKILL_FUZZ_PER_TOOL", "32"))  # 11 tools: 352 schema requests
FILE_CASES = int(os.environ.get("MEGATRON_SKILL_FUZZ_FILE_CASES", "6"))  # per file a tool reads
TIME_LIMIT_S = 10
SCHEMAS = ROOT / "schemas"
# These would start work or write files: they are always asked for a dry run (never mutated to a real one).
ACTING = {"train", "bench", "prepare-data", "render", "on-event", "import-hf", "export-hf"}
SECRET = "fuzz-secret"
# The memory a tool may take while the probe asks it something, set by the probe itself (not by a
# ulimit around pytest): a tool that reads /dev/zero, a sparse 70 MiB file or a 10^30-layer model
# into memory stops at this cap with a MemoryError (an internal error the probe reports) instead of
# taking the machine. The limit is RLIMIT_DATA (the heap and private writable mappings, what such a
# read grows), not RLIMIT_AS: importing torch reserves address space it never fills, OpenBLAS a
# buffer per core and CUDA far more (measured on a 2-core machine: render, validate, bench and doctor
# die in torch's import under RLIMIT_AS 3 GiB, a CPU train under 4 GiB), so an address-space cap
# fails the real tools on a bigger machine. Measured under RLIMIT_DATA: every tool's request at
# 1 GiB, a real 2-iteration CPU train and prepare-data at 2 GiB; the cap is twice that.
MEMORY_CAP_BYTES = 4 << 30

# A valid request of each tool (paths relative to the sandbox folder the tools run in).
BASE = {
    "plan": {"model": "llama3-8b", "num_gpus": 8},
    "render": {"model": "llama3.2-1b", "num_gpus": 8, "output_dir": "out"},
    "train": {"model": "tiny-gpt", "backend": "cpu", "runs_root": "runs"},
    "bench": {"model": "llama3.2-1b", "runs_root": "runs"},
    "validate": {"args": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]},
    "logs": {"log": "in/train.log"},
    "prepare-data": {"input": ["in/corpus.jsonl"], "output_prefix": "data/x"},
    "doctor": {},
    "import-hf": {"hf_model": "in/hf", "output": "converted"},
    "export-hf": {"checkpoint": "in/ckpt", "output": "exported", "model": "tiny-gpt"},
    "on-event": {"event": {"version": 1, "event_id": "e0123456789", "type": "job.failed",
                           "time": "2026-12-05T10:00:00Z", "run_id": "r0123456789", "emitter": "job",
                           "job": {"job_id": "7"}}, "runs_root": "runs"},
}


# ---- the sandbox: a folder to run in, a HOME, and the hostile things a path can name ---------
def _sandbox(root: Path) -> Path:
    work = root / "work"
    (work / "in" / "hf").mkdir(parents=True)
    (work / "in" / "ckpt").mkdir()
    (work / "in" / "train.log").write_bytes((ROOT / "tests/fixtures/logs/h200-kill-resume.log").read_bytes())
    (work / "in" / "corpus.jsonl").write_bytes((ROOT / "data/sample/corpus.jsonl").read_bytes())
    (work / "in" / "hf" / "config.json").write_bytes((ROOT / "tests/fixtures/hf/llama3.2-1b/config.json").read_bytes())
    (work / "in" / "ckpt" / "latest_checkpointed_iteration.txt").write_text("10\n")
    (work / "in" / "launch.sh").write_bytes((ROOT / "tests/fixtures/scripts/good_torchrun.sh").read_bytes())
    run = work / "runs" / BASE["on-event"]["event"]["run_id"]   # the run the base event is of
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "train.log").write_bytes((work / "in" / "train.log").read_bytes())
    (run / "state.json").write_text(json.dumps({"status": "failed", "gpu": "h100-sxm"}))
    hostile = work / "hostile"
    hostile.mkdir()
    os.mkfifo(hostile / "fifo")
    (hostile / "loop_a").symlink_to(hostile / "loop_b")
    (hostile / "loop_b").symlink_to(hostile / "loop_a")
    (hostile / "file").write_text("x")
    (hostile / "folder").mkdir()
    (hostile / "dangling").symlink_to(hostile / "nowhere")
    (root / "home").mkdir()
    return work


HOSTILE_PATHS = ["hostile/fifo", "/dev/zero", "hostile/loop_a", "hostile/loop_a/x", "hostile/file/below",
                 "hostile/folder", "hostile/dangling", "n" * 300, "hostile/" + "d/" * 600, ".", "-", "--help",
                 "in/../in/train.log", "hostile/file", "~", "$HOME/x", "in/train.log\n", " in/train.log"]


def _snapshot(*roots: Path) -> dict[str, tuple]:
    """Every entry below roots: its kind and, for what is no folder, its size and modification time
    (links not followed). A folder's own time is left out: a file made below an allowed path
    changes the time of the folders above it."""
    seen: dict[str, tuple] = {}
    for top in roots:
        for folder, dirs, names in os.walk(top):
            for name in dirs + names:
                path = os.path.join(folder, name)
                st = os.lstat(path)
                seen[path] = (st.st_mode,) if name in dirs and not os.path.islink(path) else (
                    st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


# ---- the schema, walked -----------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _load(name: str) -> dict:
    """A schema file, its local references ("#/$defs/x") made to name it ("plan.request.json#/$defs/x")."""
    def absolute(node):
        if isinstance(node, dict):
            return {k: (name + v if k == "$ref" and v.startswith("#") else absolute(v)) for k, v in node.items()}
        return [absolute(v) for v in node] if isinstance(node, list) else node
    return absolute(json.loads((SCHEMAS / name).read_text()))


def _resolve(schema: dict) -> dict:
    """A schema with its $ref (common.json#/$defs/x, event.json, ...) followed."""
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        doc, _, pointer = ref.partition("#")
        target = _load(doc)
        for part in [p for p in pointer.split("/") if p]:
            target = target[part]
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _locations(schema: dict, where: tuple = (), depth: int = 0) -> list[tuple[tuple, dict]]:
    """Every place a value can go (a path of keys and list indexes) with its schema, 5 levels deep."""
    schema = _resolve(schema)
    out = [(where, schema)] if where else []
    if depth >= 5:
        return out
    for alt in schema.get("oneOf", []) + schema.get("anyOf", []):
        out += _locations(alt, where, depth + 1)[0 if not where else 1:]
    for key, sub in schema.get("properties", {}).items():
        out += _locations(sub, where + (key,), depth + 1)
    if isinstance(schema.get("additionalProperties"), dict):
        out += _locations(schema["additionalProperties"], where + ("FUZZ_VAR",), depth + 1)
    if isinstance(schema.get("items"), dict):
        out += _locations(schema["items"], where + (0,), depth + 1)
    return out


def _kinds(schema: dict) -> set[str]:
    schema = _resolve(schema)
    kinds = schema.get("type", [])
    kinds = set([kinds] if isinstance(kinds, str) else kinds)
    for alt in schema.get("oneOf", []) + schema.get("anyOf", []):
        kinds |= _kinds(alt)
    if "enum" in schema:
        kinds.add("enum")
    return kinds


def _put(request: dict, where: tuple, value) -> dict:
    """request with value at where: the objects and lists on the way copied (made, or replacing what
    is not one), the rest shared (a value nested 2,000 deep cannot be deep-copied)."""
    def put(node, path):
        key, rest = path[0], path[1:]
        if isinstance(key, int):
            items = list(node) if isinstance(node, list) else []
            child = items[key] if key < len(items) else None
            return items[:key] + [put(child, rest) if rest else value] + items[key + 1:]
        obj = dict(node) if isinstance(node, dict) else {}
        obj[key] = put(obj.get(key), rest) if rest else value
        return obj
    return put(request, where)


# ---- hostile values ---------------------------------------------------------------------------
HUGE_NUMBERS = [1e308, -1e308, -1, 0, 2**63, 2**63 - 1, -(2**63), 2**64 + 1, 10**30, 1e-308, 0.5, -0.0, 8.0]
TYPES = [None, True, False, 0, -7, 1.5, "", "x", [], [1], {}, {"a": 1}]
STRINGS = ["\ud800", "a\udfffb", "x\x00y", "", " ", "\n", "a" * 5000, "é" * 3000, "$(touch pwned)", "`id`",
           "--foo", "-", "a b", "'\"", "\u202e\u200b", "%s%n", "{}", "null", "NaN", "1e308", "../" * 50]


def _deep(rng: random.Random, levels: int):
    value: object = rng.choice([1, "x", None])
    for _ in range(levels):
        value = [value] if rng.random() < 0.5 else {"k": value}
    return value


def _number_near_bounds(rng: random.Random, schema: dict):
    bounds = [schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema]
    edges = [b + d for b in bounds for d in (-1, 0, 1)]
    return rng.choice(edges + HUGE_NUMBERS)


def _valid_looking(rng: random.Random, schema: dict):
    """A value of the right type near its bounds (the tool must answer it, not the schema refuse it)."""
    schema = _resolve(schema)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "oneOf" in schema:
        return _valid_looking(rng, rng.choice(schema["oneOf"]))
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum", 0), schema.get("maximum", 2**31)
        return rng.choice([low, high, low + 1, high - 1, (low + high) // 2, min(max(2**20, low), high),
                           min(max(rng.choice([3, 7, 96, 1000, 4097]), low), high)])
    if kind == "number":
        low, high = schema.get("minimum", schema.get("exclusiveMinimum", 0)), schema.get("maximum", 1e6)
        return rng.choice([high, low + 1e-9, (low + high) / 2, 1e-12 + low])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        return rng.choice(["x", "a" * min(schema.get("maxLength", 64), 4096), "llama3-8b", "h100-sxm", "1"])
    if kind == "array":
        return [_valid_looking(rng, schema.get("items", {})) for _ in range(rng.choice([0, 1, 3]))]
    if kind == "object":
        props = list(schema.get("properties", {}).items())
        return {k: _valid_looking(rng, v) for k, v in rng.sample(props, min(len(props), rng.randint(0, 4)))}
    return rng.choice(TYPES)


def _hostile(rng: random.Random, schema: dict, tool: str):
    """One hostile value for a place of this schema, and what kind of hostility it is."""
    kinds = _kinds(schema)
    choices = ["wrong_type", "deep", "valid_looking", "valid_looking"]
    if kinds & {"integer", "number"}:
        choices += ["bounds"] * 3
    if "string" in kinds:
        choices += ["string", "string", "path", "path"]
    if "object" in kinds:
        choices += ["unknown_key"]
    if "enum" in kinds:
        choices += ["near_enum"]
    kind = rng.choice(choices)
    if kind == "wrong_type":
        return kind, rng.choice(TYPES)
    if kind == "deep":
        return kind, _deep(rng, rng.choice([31, 33, 40, 2000]))
    if kind == "bounds":
        return kind, _number_near_bounds(rng, _resolve(schema))
    if kind == "string":
        return kind, rng.choice(STRINGS)
    if kind == "path":
        return kind, rng.choice(HOSTILE_PATHS)
    if kind == "unknown_key":
        value = _valid_looking(rng, schema)
        value = value if isinstance(value, dict) else {}
        return kind, {**value, rng.choice(["zz_unknown", "", "\ud800", "a" * 300]): rng.choice(TYPES)}
    if kind == "near_enum":
        word = str(rng.choice(_resolve(schema).get("enum") or ["x"]))
        return kind, rng.choice([word.upper(), word + " ", " " + word, word[:-1], word + "\x00"])
    return kind, _valid_looking(rng, schema)


LAYOUT_KEYS = ["tp", "pp", "vp", "cp", "ep", "etp", "mbs"]


def _broken_layout(rng: random.Random) -> dict:
    """A layout of valid numbers that breaks one of the rules (divisibility, product, sizes)."""
    return {k: rng.choice([1, 2, 3, 5, 7, 8, 16, 64, 1024, 1048576]) for k in rng.sample(LAYOUT_KEYS, rng.randint(1, 5))}


def schema_requests(tool: str, rng: random.Random, count: int) -> list[tuple[str, dict]]:
    """count requests: the tool's base request with up to three valid-looking values near their
    bounds (so that most reach past the schema into the tool's code) and, mostly, one hostile one."""
    schema = _load(f"{tool}.request.json")
    places = [(w, s) for w, s in _locations(schema) if not (tool in ACTING and w[0] == "dry_run")]
    out = []
    for _ in range(count):
        request, labels = dict(BASE[tool]), []
        for _ in range(rng.choice([0, 1, 2, 3]) if places else 0):
            where, sub = rng.choice(places)
            request = _put(request, where, _valid_looking(rng, sub))
            labels.append(f"near@/{'/'.join(map(str, where))}")
        roll = rng.random()
        if roll < 0.08 and "layout" in schema["properties"]:
            request, label = _put(request, ("layout",), _broken_layout(rng)), "layout"
        elif roll < 0.14 or not places:
            request, label = _put(request, (rng.choice(["zz_unknown", "Model", "dry-run", "\ud800", ""]),), 1), "key"
        elif roll < 0.75:
            where, sub = rng.choice(places)
            label, value = _hostile(rng, sub, tool)
            request, label = _put(request, where, value), f"{label}@/{'/'.join(map(str, where))}"
        else:
            label = "valid-looking"
        out.append((" ".join(labels + [label]), request))
    return out


# ---- hostile files the tools read ----------------------------------------------------------------
def _damaged(rng: random.Random, good: bytes) -> bytes:
    """good, damaged one way: cut, bytes flipped, numbers made huge or NaN, or replaced outright."""
    kind = rng.randrange(9)
    if kind == 0:
        return good[: rng.randrange(len(good) + 1)]
    if kind == 1:
        data = bytearray(good)
        for _ in range(rng.randint(1, 20)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 2:
        text = good.decode("utf-8", "replace")
        words = [rng.choice(["1e308", "-1", "0", "NaN", "Infinity", str(2**63), "1" * 400, "-0", "1e-400"])
                 if w.strip(",:;|\"").isdigit() and rng.random() < 0.5 else w for w in text.split(" ")]
        return " ".join(words).encode()
    if kind == 3:
        return rng.choice([b"", b"\x00" * 4096, bytes(rng.randrange(256) for _ in range(3000)), b"\xff\xfe" + good,
                           b"\xef\xbb\xbf" + good, good.replace(b"\n", b"\r\n")])
    if kind == 4:
        return b"[" * 100_000 + b"]" * 100_000
    if kind == 5:
        return json.dumps(_deep(rng, 40)).encode()
    if kind == 6:
        return rng.choice([b"null", b"[]", b"1", b'"x"', b'{"a": NaN}', b'{"a": 1e999}', b'{"\\ud800": 1}',
                           b'{"model_type": "\\ud800", "hidden_size": 1e308}'])
    if kind == 7:
        return good * rng.choice([2, 20])
    return good.replace(b"\n", b"\n" + b"x" * 100_000 + b"\n", 1)


def _reshaped_json(rng: random.Random, good: bytes) -> bytes:
    """A JSON file of the right form with one field of the wrong type or out of range."""
    doc = json.loads(good)
    if not isinstance(doc, dict) or not doc:
        return good
    key = rng.choice(sorted(doc))
    doc[key] = rng.choice(TYPES + HUGE_NUMBERS + [_deep(rng, 40), "\ud800"])
    return json.dumps(doc).encode("utf-8", "surrogatepass")


# tool: (the file in the sandbox it reads, the request that makes it read that file)
FILE_TARGETS = {
    "logs": [("in/train.log", {"log": "in/train.log"})],
    "validate": [("in/launch.sh", {"script": "in/launch.sh"})],
    "prepare-data": [("in/corpus.jsonl", {}), ("in/tok/tokenizer_config.json", {"tokenizer": "in/tok"}),
                     ("in/tok/tokenizer.json", {"tokenizer": "in/tok"})],
    "import-hf": [("in/hf/config.json", {})],
    "plan": [("in/hf/config.json", {"model": None, "hf_config": "in/hf/config.json"})],
    "render": [("in/hf/config.json", {"model": None, "hf_config": "in/hf"})],
    "train": [("in/hf/config.json", {"model": None, "hf_config": "in/hf/config.json"})],
    "export-hf": [("in/ckpt/latest_checkpointed_iteration.txt", {}), ("in/ckpt/conversion.json", {}),
                  ("in/request.json", {})],
    "on-event": [("in/event.json", {"event": None, "event_file": "in/event.json"})],
}
GOOD_FILES = {"tokenizer_config.json": b'{"eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}',
              "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}',
              "conversion.json": b'{"tool": "import-hf", "request_id": "0000000000000000", "request": {}, "result": {}}',
              "request.json": json.dumps(BASE["train"]).encode(),
              "event.json": json.dumps(BASE["on-event"]["event"]).encode()}


def file_requests(tool: str, rng: random.Random, work: Path, count: int) -> list[tuple[str, dict, str, bytes]]:
    out = []
    for name, change in FILE_TARGETS.get(tool, []):
        path = work / name
        good = GOOD_FILES.get(path.name) or path.read_bytes()
        for _ in range(count):
            data = _reshaped_json(rng, good) if name.endswith(".json") and rng.random() < 0.4 else _damaged(rng, good)
            request = {k: v for k, v in {**BASE[tool], **change}.items() if v is not None}
            out.append((f"file:{name}", request, name, data))
    return out


# ---- asking, and checking the answer ----------------------------------------------------------
class _TooSlow(BaseException):  # not an Exception: no tool's except clause may swallow it
    pass


def cap_memory() -> None:
    """preexec_fn of every tool process the probes start: the child runs under MEMORY_CAP_BYTES
    (its own children inherit it)."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = MEMORY_CAP_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_CAP_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))


def _data_in_use() -> int:
    """This process's data segment now (VmData), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def memory_capped():
    """An in-process call (contract.call) under MEMORY_CAP_BYTES more than pytest holds already:
    the soft limit is lowered for the call, and what the call starts inherits it, then raised back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = _data_in_use() + MEMORY_CAP_BYTES
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _alarm(*_):
    raise _TooSlow()


def _prepared(tool: str, request: dict) -> dict:
    if tool in ACTING:
        request = {**request, "dry_run": True}
    if tool == "on-event" and isinstance(request.get("event"), dict):
        from megatron_skill.events.event import now_text, sign

        event = request["event"]
        if event.get("time") == BASE["on-event"]["event"]["time"]:   # fresh: past the age check, into the run
            event = {**event, "time": now_text()}
        try:
            request = {**request, "event": sign(event, SECRET.encode())}
        except (TypeError, ValueError, RecursionError):
            pass  # unsignable: sent as it is
    return request


def _ask(tool: str, request: dict) -> tuple[dict, float]:
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_LIMIT_S)
    started = time.monotonic()
    try:
        with memory_capped():
            return call(tool, request), time.monotonic() - started
    except _TooSlow:
        return {"ok": False, "tool": tool, "error": {"code": "HANG"}}, TIME_LIMIT_S
    finally:
        signal.alarm(0)


def _written_paths(request, work: Path) -> list[Path]:
    """The paths a request names (any string at any depth), as the tools would read them."""
    found = []
    stack = [request]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and value and "\x00" not in value:
            found.append(Path(os.path.normpath(work / value)))
    return found


def answer_problem(tool: str, env: dict, seconds: float, changed: list[str], dry: bool) -> str | None:
    """What is wrong with one answer, whatever the request: not one strict-JSON envelope of the
    tool, an internal or unknown error code, an error without message or fix, too slow, or a dry
    run that wrote (shared by the run-folder probe, tests/test_fuzz_runs.py)."""
    try:
        json.dumps(env, allow_nan=False)
    except (TypeError, ValueError) as e:
        return f"not strict JSON: {e}"
    if not isinstance(env, dict) or env.get("tool") != tool or not isinstance(env.get("ok"), bool):
        return "not an envelope"
    code = None if env["ok"] else env.get("error", {}).get("code")
    if code == "HANG":
        return f"no answer within {TIME_LIMIT_S} s"
    if code is not None and (code not in EXIT_CODES or code == "internal"):
        return f"error code {code}: {env['error'].get('message')}"
    if code is not None and not (env["error"].get("message") and env["error"].get("fix")):
        return "an error without message or fix"
    if seconds > TIME_LIMIT_S:
        return f"answered after {seconds:.1f} s"
    if dry and changed:
        return f"a dry run wrote {changed[:5]}"
    return None


def written_outside(changed: list[str], allowed: list[Path]) -> list[str]:
    """The changed paths that are none of the allowed ones and lie below none of them."""
    return [c for c in changed if not any(Path(c) == a or a in Path(c).parents for a in allowed)]


def _problem(tool: str, request: dict, env: dict, seconds: float, changed: list[str], work: Path) -> str | None:
    problem = answer_problem(tool, env, seconds, changed, request.get("dry_run") is True)
    if problem:
        return problem
    wrong = written_outside(changed, _written_paths(request, work))
    return f"wrote outside the request's paths: {wrong[:5]}" if wrong else None


def _shown(request) -> str:
    try:
        return json.dumps(request, default=repr)[:600]
    except RecursionError:
        return "(nested too deep to show: run the seed and look at the label)"


def _outcome(env: dict) -> str:
    return "ok" if env.get("ok") else env.get("error", {}).get("code", "?")


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    work = _sandbox(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    # Megatron's parser keeps its verdicts in a cache (adapter/parser.py): the one write allowed,
    # kept outside the snapshots.
    monkeypatch.setenv("MEGATRON_SKILL_CACHE", str(tmp_path / "parser-cache"))
    monkeypatch.setenv("MEGATRON_SKILL_EVENTS_SECRET", SECRET)
    monkeypatch.chdir(work)
    return tmp_path, work


def _run_all(tool: str, cases, tmp_path: Path, work: Path) -> tuple[collections.Counter, list[str]]:
    outcomes: collections.Counter = collections.Counter()
    failures = []
    for i, case in enumerate(cases):
        label, request = case[0], _prepared(tool, case[1])
        if len(case) > 2:  # a damaged file, written before the snapshot
            good = (work / case[2]).read_bytes()
            (work / case[2]).write_bytes(case[3])
        before = _snapshot(tmp_path / "home", work)
        env, seconds = _ask(tool, request)
        after = _snapshot(tmp_path / "home", work)
        changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
        outcomes[_outcome(env)] += 1
        problem = _problem(tool, request, env, seconds, changed, work)
        if problem:
            shown = _shown(request)
            failures.append(f"seed {SEED} {tool} #{i} [{label}]: {problem}\n    request: {shown}")
        if len(case) > 2:
            (work / case[2]).write_bytes(good)
    return outcomes, failures


TOTALS: collections.Counter = collections.Counter()


@pytest.mark.parametrize("tool", sorted(tools()))
def test_hostile_requests_from_the_schema_and_files(tool, sandbox):
    tmp_path, work = sandbox
    rng = random.Random(f"{SEED}/{tool}")
    cases = schema_requests(tool, rng, PER_TOOL) + file_requests(tool, rng, work, FILE_CASES)
    for name, _ in FILE_TARGETS.get(tool, []):  # the files' good forms, for the schema requests
        if not (work / name).exists():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_bytes(GOOD_FILES[Path(name).name])
    call(tool, _prepared(tool, BASE[tool]))  # untimed and unbroken: the first call imports torch (seconds)
    outcomes, failures = _run_all(tool, cases, tmp_path, work)
    TOTALS.update({f"{tool}:{k}": v for k, v in outcomes.items()})
    print(f"fuzz {tool}: {sum(outcomes.values())} requests, {dict(outcomes)}")
    assert not failures, f"{len(failures)} of {len(cases)} requests went wrong:\n" + "\n".join(failures[:15])


# ---- what the fuzz found, kept: each was an internal error -----------------------------------
LLAMA = json.loads((ROOT / "tests/fixtures/hf/llama3.2-1b/config.json").read_text())
LOG_LINE = (" [2026-12-03 10:00:01] iteration 1/ 10 | elapsed time per iteration (ms): 100.0 | global batch size: 8 "
            "| lm loss: 3.2E+00 | number of nan iterations: 1e999 |\n")
FOUND = [  # (tool, request, file to write first, its contents, the answer's code)
    ("logs", {"log": "in/bad.log"}, "in/bad.log", LOG_LINE * 3, "ok"),  # OverflowError
    ("prepare-data", {"input": ["in/corpus.jsonl"], "output_prefix": "a" * 5000}, None, None, "bad_request"),  # ENAMETOOLONG
    ("prepare-data", {"input": ["in/corpus.jsonl"], "output_prefix": "hostile/loop_a"}, None, None, "bad_request"),  # loop
    ("render", {"hf_config": "in/hf", "num_gpus": 8, "output_dir": "out"}, "in/hf/config.json",
     {**LLAMA, "rope_theta": [1]}, "bad_model"),  # TypeError in int()
    ("render", {"hf_config": "in/hf", "num_gpus": 8, "output_dir": "out"}, "in/hf/config.json",
     {**LLAMA, "max_position_embeddings": -0.0}, "bad_model"),  # ZeroDivisionError
    ("plan", {"hf_config": "in/hf", "num_gpus": 8}, "in/hf/config.json", {**LLAMA, "model_type": {}}, "bad_model"),
    ("plan", {"hf_config": "in/hf", "num_gpus": 8}, "in/hf/config.json", {**LLAMA, "num_hidden_layers": 10**30},
     "bad_model"),
    ("render", {"hf_config": "in/hf", "num_gpus": 8, "output_dir": "out"}, "in/hf/config.json",
     {**LLAMA, "max_position_embeddings": None}, "ok"),  # None < int
]


@pytest.mark.parametrize("tool,request_,name,content,code", FOUND, ids=[f"{c[0]}-{i}" for i, c in enumerate(FOUND)])
def test_what_the_fuzz_found(tool, request_, name, content, code, sandbox):
    tmp_path, work = sandbox
    if name:
        (work / name).write_text(content if isinstance(content, str) else json.dumps(content))
    env, _ = _ask(tool, _prepared(tool, request_))
    assert _outcome(env) == code, env
    assert env["ok"] or (env["error"].get("where") and env["error"].get("fix")), env


# ---- a sample through the command line: NaN and Infinity in the text, stdout one JSON object ---
CLI_TEXTS = [
    ("plan", '{"model": "llama3-8b", "num_gpus": NaN}'),
    ("plan", '{"model": "llama3-8b", "num_gpus": 8, "headroom_gib": -Infinity}'),
    ("render", '{"model": "llama3.2-1b", "num_gpus": 1e308, "dry_run": true, "output_dir": "out"}'),
    ("validate", '{"args": ["--num-layers", "\\ud800"]}'),
    ("logs", '{"log": "hostile/fifo"}'),
    ("train", '{"model": "tiny-gpt", "backend": "cpu", "dry_run": true, "runs_root": "runs", "seq_length": '
              + str(2**20) + '}'),
    ("doctor", '{"zz": ' + "[" * 5000 + "]" * 5000 + '}'),
    ("prepare-data", '{"input": ["/dev/zero"], "output_prefix": "data/x", "dry_run": true}'),
    ("on-event", '{"event_file": "hostile/loop_a", "dry_run": true, "runs_root": "runs"}'),
    ("plan", b'\xff{"model": "llama3-8b"'),
]


def test_a_sample_through_the_command_line(sandbox):
    tmp_path, work = sandbox
    failures = []
    for tool, text in CLI_TEXTS:
        before = _snapshot(tmp_path / "home", work)
        started = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), tool, "--request", "-"],
                                  input=text if isinstance(text, bytes) else text.encode(), capture_output=True,
                                  timeout=TIME_LIMIT_S + 20, cwd=work,  # + the interpreter's start
                                  preexec_fn=cap_memory)
        except subprocess.TimeoutExpired:
            failures.append(f"{tool} {text[:80]!r}: no answer")
            continue
        try:
            env = json.loads(proc.stdout, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
        except ValueError as e:
            failures.append(f"{tool} {text[:80]!r}: stdout is not one JSON object ({e}): {proc.stdout[:200]!r}, "
                            f"exit {proc.returncode}, stderr {proc.stderr[-400:]!r}")
            continue
        after = _snapshot(tmp_path / "home", work)
        changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
        seconds = time.monotonic() - started - 10  # less the interpreter's start
        problem = _problem(tool, {"dry_run": True}, env, seconds, changed, work)
        if problem or proc.returncode != (0 if env["ok"] else EXIT_CODES[env["error"]["code"]]):
            failures.append(f"{tool} {text[:80]!r}: {problem or f'exit {proc.returncode}'}")
    assert not failures, "\n".join(failures)
