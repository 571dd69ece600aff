"""Hostile run directories for on-event: what a run folder and the event record beside it can hold
when a person, a crash or an attacker has been at them, and hostile event and secret files.

A good run (a state, a train request, a log, checkpoints, a launch script, the lock, the outbox and
the ledger on-event keeps) is made once and copied for each request; then one to three of its files
or folders are damaged: cut, bytes flipped, forged (JSON of another shape, a run left "running"),
a value at any depth made the wrong type, huge, NaN, a lone surrogate or nested 2,000 deep, the
file replaced by a FIFO, a folder, a sparse file past every size limit, or a symbolic link (to a
file of the user's outside the runs, to a folder outside, to /dev/zero, to nowhere, to itself).
The event is signed and fresh, of every type on-event answers differently, sometimes with its own
hostile paths (log, run_dir), sometimes in an event file that is damaged itself.

Each request must get one JSON envelope (ok, or an error code of errors.EXIT_CODES other than
internal, with a message and a fix) within TIME_LIMIT_S, and write nothing outside runs_root (a
dry run: nothing at all), also later, from the processes on-event starts in the background.
MEGATRON_SKILL_FUZZ_SEED and MEGATRON_SKILL_FUZZ_RUN_CASES pick other and more requests.
"""
from __future__ import annotations

import collections
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_fuzz_schema import (
    HUGE_NUMBERS,
    TIME_LIMIT_S,
    TYPES,
    _ask,
    _damaged,
    _deep,
    _outcome,
    _snapshot,
    answer_problem,
    cap_memory,
    written_outside,
)

from megatron_skill.contract import call
from megatron_skill.errors import EXIT_CODES
from megatron_skill.events import event as ev

SEED = int(os.environ.get("MEGATRON_SKILL_FUZZ_SEED", "41"))
CASES = int(os.environ.get("MEGATRON_SKILL_FUZZ_RUN_CASES", "160"))
SECRET = "fuzz-runs-secret"
RUN = "fuzzrun0001"
JOB = f"{RUN}.0"

# The files of a run, relative to runs_root (on-event reads each of them for some event).
FILES = [f"{RUN}/state.json", f"{RUN}/request.json", f"{RUN}/run.lock", f".events/{RUN}/ledger.json",
         f"{RUN}/logs/train.log", f"{RUN}/checkpoints/latest_checkpointed_iteration.txt", f"{RUN}/events.jsonl",
         f"{RUN}/events.outbox.jsonl", f"{RUN}/launch.sh", f".events/{RUN}/ledger.lock", f"{RUN}/cpu_run.json"]
JSON_FILES = [f for f in FILES if f.endswith((".json", ".lock"))]
FOLDERS = [RUN, f"{RUN}/logs", f"{RUN}/checkpoints", f"{RUN}/checkpoints/iter_0000010", ".events",
           f".events/{RUN}", f".events/{RUN}/proposals"]

# What each kind of event makes on-event do (its facts, its cause, its actions).
EVENTS = [
    ("job.failed", {"exit_code": 137, "signal": "SIGKILL"}),              # killed: resume
    ("job.failed", {"exit_code": 1, "failure": "out_of_memory"}),         # relayout: plan, render, validate
    ("job.failed", {"exit_code": 1, "failure": "node_failure"}),          # resume without the nodes
    ("job.failed", {"exit_code": 1}),                                     # other failure: diagnose
    ("loss.anomaly", {"loss": "nan", "iteration": 12}),                   # rollback, with the log's evidence
    ("loss.anomaly", {"loss": 9.5, "before": 3.0, "iteration": 12}),      # a spike: rollback
    ("job.finished", {"exit_code": 0}),                                   # summary
    ("training.stalled", {"iteration": 5, "silent_s": 900.0}),            # diagnose
    ("throughput.drop", {"iteration": 20, "iter_ms": 900.0, "before": 300.0}),
    ("node.failure", {"failure": "nccl_timeout", "message": "Watchdog caught collective operation timeout"}),
    ("checkpoint.saved", {"checkpoint_iteration": 10, "loss": 3.1}),      # noted
    ("job.started", None),
]


# ---- the good run, made once ------------------------------------------------------------------
def _good_runs(root: Path) -> Path:
    """runs_root with one run as train leaves it after a failed attempt, and the record on-event
    kept of an earlier event of it."""
    runs = root / "runs"
    run = runs / RUN
    (run / "logs").mkdir(parents=True)
    (run / "checkpoints" / "iter_0000010").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("10\n")
    (run / "logs" / "train.log").write_bytes((ROOT / "tests/fixtures/logs/h200-kill-resume.log").read_bytes())
    (run / "launch.sh").write_bytes((ROOT / "tests/fixtures/scripts/good_torchrun.sh").read_bytes())
    request = {"model": "llama3.2-1b", "gpu": "h100-sxm", "num_gpus": 8, "runs_root": str(runs),
               "training": {"train_iters": 100, "lr": 3e-4, "min_lr": 3e-5, "save": str(run / "checkpoints")}}
    (run / "request.json").write_text(json.dumps(request, indent=1))
    layout = {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "mbs": 1, "gbs": 8, "seq_length": 2048}
    state = {"status": "failed", "run_id": RUN, "attempts": 1, "job_id": JOB, "cwd": str(root / "work"),
             "gpu": "h100-sxm", "backend": "gpu", "layout": layout, "returncode": -9, "updated": time.time(),
             "request": {**request, "num_gpus": 8, "nodes": 1, "gpus_per_node": 8},
             "result": {"layout": layout, "returncode": -9}}
    (run / "state.json").write_text(json.dumps(state, indent=1))
    (run / "cpu_run.json").write_text(json.dumps({"model": "tiny-gpt", "train_iters": 10}))
    (run / "run.lock").write_text("")
    # An earlier event of the run, handled for real: the ledger, its lock and its proposals as
    # on-event writes them.
    first = _event("job.failed", {"exit_code": 1, "failure": "out_of_memory"}, event_id="earlier-oom-0001")
    env = call("on-event", {"event": first, "runs_root": str(runs)})
    assert env["ok"] and env["result"]["verdict"] == "handled", env
    for name in ("events.jsonl", "events.outbox.jsonl"):
        (run / name).write_text(json.dumps({"event": first}) + "\n" + json.dumps({"done": first["event_id"],
                                                                               "outcome": "delivered"}) + "\n")
    assert (runs / ".events" / RUN / "ledger.json").is_file() and list((runs / ".events" / RUN / "proposals").iterdir())
    return runs


def _event(kind: str, details: dict | None, event_id: str | None = None, **fields) -> dict:
    event = ev.new(kind, RUN, {"job_id": JOB, "scheduler": "local", "host": "node7"}, "train", details=details,
                   request_id=RUN, **fields)
    if event_id:
        event["event_id"] = event_id
    return ev.sign(event, SECRET.encode())


# ---- hostile values and files -----------------------------------------------------------------------
RAW_VALUES = ["1e400", "-1e400", "1" * 5000, "NaN", "Infinity", '"\\ud800"', '"a\\udfffb"', '"\\u0000"']


def _places(doc, where=()):
    """Every place in a JSON document: a path of keys and indexes."""
    out = [where] if where else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _places(v, where + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:5]):
            out += _places(v, where + (i,))
    return out


def _set(doc, where, value):
    node = doc
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value


MARK = "FUZZ-RAW-VALUE-7f3a"


def _reshaped(rng: random.Random, good: bytes) -> bytes:
    """The JSON record with one value, at any depth, of the wrong type, out of range, not JSON
    (1e400, NaN), a lone surrogate, or nested deeply; or a key added that no reader expects."""
    try:
        doc = json.loads(good)
    except (ValueError, RecursionError):
        return _damaged(rng, good)
    places = _places(doc)
    if not places or rng.random() < 0.1:
        return json.dumps(rng.choice([[doc], {"zz": doc}, "x", 1, None, []])).encode()
    where = rng.choice(places)
    roll = rng.random()
    if roll < 0.3:
        _set(doc, where, MARK)
        return json.dumps(doc).replace(json.dumps(MARK), rng.choice(RAW_VALUES)).encode()
    if roll < 0.4:   # nested deeply: written as text (json.dumps cannot go 2,000 deep)
        _set(doc, where, MARK)
        depth = rng.choice([40, 2000])
        return json.dumps(doc).replace(json.dumps(MARK), "[" * depth + "]" * depth).encode()
    _set(doc, where, rng.choice(TYPES + HUGE_NUMBERS + [-1, 10**30, "running", "../../outside", "/dev/zero",
                                                      "a" * 5000, {"pid": 1}, [[]]]))
    return json.dumps(doc).encode()


def _forged_state(rng: random.Random, good: bytes) -> bytes:
    """A state a train that died would leave (running, its lock free: on-event settles it), with
    its other fields of any shape."""
    doc = json.loads(good)
    doc["status"] = "running"
    for key in rng.sample(["run_id", "attempts", "job_id", "layout", "request", "cwd", "gpu", "backend", "result"],
                          rng.randint(0, 3)):
        doc[key] = rng.choice(TYPES + HUGE_NUMBERS + ["\ud800", "../../outside", "x" * 300, _deep(rng, 40),
                                                      {"launcher": "slurm"}, {"layout": [1]}])
    return json.dumps(doc).encode("utf-8", "surrogatepass")


def _forged_ledger(rng: random.Random, good: bytes) -> bytes:
    """The ledger with an entry of its own shape but wrong content: an incident whose actions are
    not actions, an event of another job, relaunches that are not times."""
    doc = json.loads(good)
    incident = next(iter(doc["incidents"].values()), None)
    choice = rng.randrange(6)
    if choice == 0 and incident:
        incident["actions"] = rng.choice([[{}], [{"kind": 5}], [{"kind": "resume", "argv": "rm -rf /"}], ["resume"],
                                          [{"kind": "resume", "argv": ["/bin/true"], "needs_person": "no"}]])
    elif choice == 1 and incident:
        incident["applied"] = rng.choice([{"resume": {}}, {"resume": {"output": 5}}, {"x": {"pid": "abc"}}])
    elif choice == 2 and incident:
        incident["reports"] = rng.choice([[], [{"event_id": "x"}], [{"event_id": "x", "cause": "no_such_cause"}],
                                          [{"event_id": "x", "nodes": ["a" * 300]}]])
    elif choice == 3:
        doc["relaunches"] = rng.choice([[1e308], [-1e308, 0], [time.time() + 1e9] * 50])
    elif choice == 4:
        doc["events"] = {f"e{i}": {"type": "job.started", "seen": i, "job_id": JOB} for i in range(3000)}
    else:
        for value in doc["incidents"].values():
            value["cause"] = rng.choice(["", "killed", "no_such_cause", "x" * 5000])
    return json.dumps(doc).encode()


def _content(rng: random.Random, name: str, good: bytes) -> bytes:
    try:
        record = isinstance(json.loads(good), dict)
    except (ValueError, RecursionError):
        record = False
    if not record:   # (broken before, in this case)
        return _damaged(rng, good)
    if name.endswith("state.json") and rng.random() < 0.35:
        return _forged_state(rng, good)
    if name.endswith("ledger.json") and rng.random() < 0.35:
        return _forged_ledger(rng, good)
    if name in JSON_FILES and good.strip() and rng.random() < 0.6:
        return _reshaped(rng, good)
    return _damaged(rng, good)


FILE_KINDS = ["content"] * 8 + ["fifo", "folder", "huge", "empty", "link_victim", "link_outside_folder", "link_zero",
                                "link_nowhere", "link_loop", "missing"]
FOLDER_KINDS = ["file", "link_outside", "link_loop", "fifo", "missing", "link_nowhere"]


def _replace(path: Path) -> None:
    if path.is_symlink() or path.is_file() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _break_file(rng: random.Random, runs: Path, outside: Path, name: str) -> str:
    path = runs / name
    kind = rng.choice(FILE_KINDS)
    good = path.read_bytes() if path.is_file() else b""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind != "content" or path.is_symlink() or (os.path.lexists(path) and not path.is_file()):
        _replace(path)   # (content is written to a regular file only: a FIFO a break before made would block)
    if kind == "content":
        path.write_bytes(_content(rng, name, good))
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
        (path / "x").write_text("{}")
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(70 * 2**20)   # sparse: past every reader's limit, no disk used
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "link_victim":
        path.symlink_to(outside / "victim.json")
    elif kind == "link_outside_folder":
        path.symlink_to(outside / "folder", target_is_directory=True)
    elif kind == "link_zero":
        path.symlink_to("/dev/zero")
    elif kind == "link_nowhere":
        path.symlink_to(outside / "nowhere")
    elif kind == "link_loop":
        path.symlink_to(path)
    return f"{kind}@{name}"


def _copy_regular(source: str, target: str) -> None:
    """copytree's copy, of regular files only (a FIFO a break before made would block the copy)."""
    if os.path.isfile(source):
        shutil.copy2(source, target)


def _break_folder(rng: random.Random, runs: Path, outside: Path, name: str) -> str:
    path = runs / name
    kind = rng.choice(FOLDER_KINDS)
    if not (path.exists() or path.is_symlink()):
        path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link_outside":
        # the folder moved outside the runs and a link left in its place: writes must not follow it
        target = outside.parent / "elsewhere" / f"moved-{rng.randrange(10**9)}"
        target.parent.mkdir(exist_ok=True)
        if path.is_dir() and not path.is_symlink():
            shutil.copytree(path, target, symlinks=True, copy_function=_copy_regular)
        else:
            target.mkdir()
        _replace(path)
        path.symlink_to(target, target_is_directory=True)
        return f"{kind}@{name}/"
    _replace(path)
    if kind == "file":
        path.write_text("not a folder\n")
    elif kind == "link_loop":
        path.symlink_to(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link_nowhere":
        path.symlink_to(outside / "nowhere-folder")
    return f"{kind}@{name}/"


def _hostile_event(rng: random.Random, outside: Path, work: Path) -> tuple[dict, str]:
    kind, details = rng.choice(EVENTS)
    fields: dict = {}
    label = kind
    if rng.random() < 0.25:
        which = rng.choice(["log", "run_dir"])
        fields[which] = rng.choice([str(work / "hostile" / "fifo"), "/dev/zero", str(work / "hostile" / "loop"),
                                    str(work / "hostile" / "folder"), "x" * 300, "/" + "d/" * 1500,
                                    str(outside / "victim.json"), str(outside / "folder"),
                                    str(work / "runs" / RUN / "logs" / "train.log"), "runs/../../outside"])
        label += f" {which}={fields[which][:30]!r}"
    if rng.random() < 0.1:
        return _event(kind, details, event_id="earlier-oom-0001", **fields), label + " (an id seen before)"
    return _event(kind, details, **fields), label


def _event_file(rng: random.Random, event: dict, work: Path) -> tuple[dict, str]:
    """The event given as a file, that file hostile sometimes."""
    path = work / "in" / "event.json"
    _replace(path)
    text = json.dumps(rng.choice([event, ev.body(event)]))
    roll = rng.randrange(10)
    label = "event_file"
    if roll == 0:
        path.write_bytes(text.replace('"details": {', '"details": {"zz": 1e400, ', 1).encode())
        label += ":1e400"
    elif roll == 1:
        path.write_bytes(text.replace('"host": "node7"', '"host": "\\ud800"').encode())
        label += ":lone-surrogate"
    elif roll == 2:
        path.write_bytes(text.encode().replace(b"node7", b"node\xed\xa0\x80"))
        label += ":not-utf8"
    elif roll == 3:
        path.write_bytes(_damaged(rng, text.encode()))
        label += ":damaged"
    elif roll == 4:
        os.mkfifo(path)
        label += ":fifo"
    elif roll == 5:
        path.symlink_to(path)
        label += ":loop"
    elif roll == 6:
        path.write_bytes(b'{"source": "megatron-skill", "event": ' + b"[" * 3000 + b"]" * 3000 + b"}")
        label += ":deep"
    else:
        path.write_text(text)
    return {"event_file": str(path)}, label


SECRET_FILES = {"fifo": lambda p: os.mkfifo(p), "folder": lambda p: p.mkdir(), "zero": lambda p: p.symlink_to("/dev/zero"),
                "huge": lambda p: open(p, "wb").truncate(2**20), "binary": lambda p: p.write_bytes(b"\xff\xfe\x00" * 9),
                "empty": lambda p: p.write_bytes(b"\n\n"), "loop": lambda p: p.symlink_to(p)}


def cases(rng: random.Random, count: int) -> list[dict]:
    """count cases: which of the run's files and folders to break and how, the event, dry or not."""
    out = []
    for _ in range(count):
        breaks = [("file", rng.choice(FILES)) if rng.random() < 0.75 else ("folder", rng.choice(FOLDERS))
                  for _ in range(rng.choice([1, 1, 2, 3]))]
        out.append({"breaks": breaks, "running": rng.random() < 0.3, "event_seed": rng.randrange(2**32),
                    "as_file": rng.random() < 0.25,
                    "dry_run": rng.random() < 0.25, "secret": rng.choice(list(SECRET_FILES)) if rng.random() < 0.05
                    else None, "seed": rng.randrange(2**32)})
    return out


# ---- asking, and checking ---------------------------------------------------------------------------
def _problem(env: dict, seconds: float, changed: list[str], allowed: list[Path], dry: bool) -> str | None:
    problem = answer_problem("on-event", env, seconds, changed, dry)
    if problem:
        return problem
    wrong = written_outside(changed, allowed)
    return f"wrote outside runs_root: {wrong[:5]}" if wrong else None


def _outside(outside: Path) -> Path:
    if outside.exists():
        shutil.rmtree(outside)
    (outside / "folder").mkdir(parents=True)
    (outside / "victim.json").write_text('{"mine": "a file of the user\'s"}\n')
    (outside / "folder" / "mine.txt").write_text("mine\n")
    return outside


@pytest.fixture
def place(tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "in").mkdir(parents=True)
    hostile = work / "hostile"
    hostile.mkdir()
    os.mkfifo(hostile / "fifo")
    (hostile / "loop").symlink_to(hostile / "loop")
    (hostile / "folder").mkdir()
    outside = _outside(tmp_path / "outside")   # the user's files next to the runs: never to be touched
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("MEGATRON_SKILL_CACHE", str(tmp_path / "parser-cache"))
    for name in (ev.URL_ENV, ev.TOKEN_ENV, ev.SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ev.SECRET_ENV, SECRET)
    monkeypatch.chdir(work)
    template = _good_runs(tmp_path / "template")
    return tmp_path, work, outside, template


def _prepare(case: dict, work: Path, outside: Path, template: Path, tmp_path: Path, monkeypatch) -> tuple[dict, str]:
    runs = work / "runs"
    if runs.exists() or runs.is_symlink():
        _replace(runs)
    shutil.copytree(template, runs, symlinks=True)
    # the template's absolute paths (state's request, save) name the template: the copy's own instead
    for name in (f"{RUN}/state.json", f"{RUN}/request.json"):
        (runs / name).write_text((runs / name).read_text().replace(str(template), str(runs)))
    rng = random.Random(case["seed"])
    if case["running"]:   # a train that died mid-attempt: on-event settles the run before the event
        state = json.loads((runs / RUN / "state.json").read_text())
        (runs / RUN / "state.json").write_text(json.dumps({**state, "status": "running"}))
    labels = ["running"] if case["running"] else []
    for what, name in case["breaks"]:
        try:
            labels.append((_break_file if what == "file" else _break_folder)(rng, runs, outside, name))
        except OSError:   # a folder above it was broken first
            labels.append(f"(not {name}: a folder above is broken)")
    event, label = _hostile_event(random.Random(case["event_seed"]), outside, work)
    request: dict = {"event": event, "runs_root": "runs"}
    if case["as_file"]:
        given, file_label = _event_file(rng, event, work)
        request = {**given, "runs_root": "runs"}
        label += f" {file_label}"
    if case["dry_run"]:
        request["dry_run"] = True
    monkeypatch.setenv(ev.SECRET_ENV, SECRET)
    monkeypatch.delenv(ev.SECRET_FILE_ENV, raising=False)
    if case["secret"]:
        secret = tmp_path / "secret"
        if secret.exists() or secret.is_symlink():
            _replace(secret)
        SECRET_FILES[case["secret"]](secret)
        monkeypatch.delenv(ev.SECRET_ENV)
        monkeypatch.setenv(ev.SECRET_FILE_ENV, str(secret))
        label += f" secret:{case['secret']}"
    return request, " ".join(labels + [label])


def _background_done(timeout: float = 30) -> None:
    """Wait for the processes on-event started (the end of a dead attempt, sent by emit_event.py)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = subprocess.run(["pgrep", "-f", f"emit_event.py settle --run-dir .*{RUN}"], capture_output=True,
                               text=True).stdout.split()
        if not found:
            return
        time.sleep(0.2)


TOTAL: collections.Counter = collections.Counter()


def test_hostile_run_records_ledgers_and_event_files(place, monkeypatch):
    tmp_path, work, outside, template = place
    (tmp_path / "elsewhere").mkdir()   # where folders of the run that became links point
    everything = [tmp_path / "home", work, outside, tmp_path / "elsewhere"]
    untouched = _snapshot(outside)
    outcomes: collections.Counter = collections.Counter()
    failures = []
    for i, case in enumerate(cases(random.Random(f"{SEED}/runs"), CASES)):
        request, label = _prepare(case, work, outside, template, tmp_path, monkeypatch)
        before = _snapshot(*everything)
        env, seconds = _ask("on-event", request)
        _background_done()
        after = _snapshot(*everything)
        changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
        allowed = [work / "runs"] + ([Path(request["event_file"])] if "event_file" in request else [])
        outcomes[_outcome(env)] += 1
        problem = _problem(env, seconds, changed, allowed, bool(request.get("dry_run")))
        if problem:
            failures.append(f"seed {SEED} case #{i} [{label}] dry={bool(request.get('dry_run'))}: {problem}\n"
                            f"    answer: {json.dumps(env, default=repr)[:400]}")
        if _snapshot(outside) != untouched:
            failures.append(f"seed {SEED} case #{i} [{label}]: the user's files outside the runs changed")
            _outside(outside)
            untouched = _snapshot(outside)
    TOTAL.update(outcomes)
    print(f"fuzz on-event run records: {sum(outcomes.values())} requests, {dict(outcomes)}")
    assert not failures, f"{len(failures)} of {CASES} requests went wrong:\n" + "\n".join(failures[:20])


# ---- a sample through the command line: stdout one JSON object, the exit code the documented one ---
def test_a_sample_of_hostile_runs_through_the_command_line(place, monkeypatch):
    tmp_path, work, outside, template = place
    failures = []
    for i, case in enumerate(cases(random.Random(f"{SEED}/runs-cli"), 8)):
        request, label = _prepare(case, work, outside, template, tmp_path, monkeypatch)
        started = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), "on-event", "--request", "-"],
                                  input=json.dumps(request).encode(), capture_output=True, cwd=work,
                                  timeout=TIME_LIMIT_S + 30, env=os.environ.copy(), preexec_fn=cap_memory)
        except subprocess.TimeoutExpired:
            failures.append(f"#{i} [{label}]: no answer")
            continue
        try:
            env = json.loads(proc.stdout)
        except ValueError as e:
            failures.append(f"#{i} [{label}]: stdout is not one JSON object ({e}): {proc.stdout[:200]!r}")
            continue
        code = 0 if env.get("ok") else EXIT_CODES.get(env.get("error", {}).get("code"), -1)
        if proc.returncode != code or code == EXIT_CODES["internal"] or b"Traceback" in proc.stderr:
            failures.append(f"#{i} [{label}]: exit {proc.returncode}, answer {json.dumps(env)[:300]}")
        assert time.monotonic() - started < TIME_LIMIT_S + 30
    _background_done()
    assert not failures, "\n".join(failures)
