"""Hostile input, races and kills: one JSON answer with a user error code (never an internal
error, a hang or a traceback), no lost file, no second holder of a lock."""
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_cli

from megatron_skill.contract import call

LAUNCH = [sys.executable, str(ROOT / "tools" / "launch.py")]


def _strict(text: str):
    """Parse stdout as strict JSON: NaN / Infinity are not JSON (Node's JSON.parse refuses them)."""
    def refuse(name):
        raise ValueError(f"{name} in output")
    return json.loads(text, parse_constant=refuse)


def _cli_text(tool: str, request_text: str, timeout: int = 60):
    proc = subprocess.run([*LAUNCH, tool, "--request", "-"], input=request_text, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    return proc.returncode, _strict(proc.stdout)


# ---- hostile values reach no code untyped -----------------------------------------------
TINY = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "vocab_size": 256}
BAD_REQUESTS = [
    ("plan", {"model": {**TINY, "max_position_embeddings": "x"}, "num_gpus": 8}, "/model"),
    ("plan", {"model": {**TINY, "moe_router_topk": "2", "num_experts": 4}, "num_gpus": 8}, "/model"),
    ("plan", {"model": {**TINY, "max_position_embeddings": -5}, "num_gpus": 8}, "/model"),
    ("plan", {"model": {**TINY, "num_layers": 10**30}, "num_gpus": 8}, "/model"),
    ("plan", {"model": {**TINY, "rotary_base": [1]}, "num_gpus": 8}, "/model"),
    ("plan", {"model": "llama3-8b", "num_gpus": 8.0}, "/num_gpus"),
    ("plan", {"model": "llama3-8b", "num_gpus": 8, "top": 1.0}, "/top"),
    ("plan", {"model": "llama3-8b", "num_gpus": 10**20}, "/num_gpus"),
    ("plan", {"model": "llama3-8b", "nodes": 10**9}, "/nodes"),
    ("plan", {"model": "llama3-8b", "num_gpus": 8, "global_batch_size": 10**30}, "/global_batch_size"),
    ("plan", {"model": "llama3-8b", "num_gpus": 8, "constraints": {"tp": [2, 10**9]}}, "/constraints/tp"),
    ("render", {"model": "llama3-8b", "num_gpus": 8, "layout": {"tp": 2, "pipline": 4}, "dry_run": True}, "/layout"),
    ("render", {"model": "llama3-8b", "num_gpus": 8, "env": {"X": "\ud800"}, "dry_run": True}, "/env/X"),
    ("render", {"model": "llama3-8b", "num_gpus": 8, "env": {"A;B": "1"}, "dry_run": True}, "/env"),
    ("train", {"model": "tiny-gpt", "backend": "cpu", "training": {"lr": float("nan")}, "dry_run": True},
     "/training/lr"),
    ("logs", {"log": "runs/x\x00y.log"}, "/log"),
    ("prepare-data", {"input": ["a.jsonl"], "output_prefix": "x", "workers": 10**30}, "/workers"),
]


@pytest.mark.parametrize("tool,request_,where", BAD_REQUESTS, ids=[f"{t}-{w}-{i}" for i, (t, _, w) in
                                                                    enumerate(BAD_REQUESTS)])
def test_hostile_values_are_bad_requests_that_say_where(tool, request_, where):
    env = call(tool, request_)
    assert not env["ok"] and env["error"]["code"] in ("bad_request", "bad_model"), env
    assert env["error"]["where"].startswith(where) and env["error"]["fix"]


def test_nan_and_infinity_in_request_text_are_refused(tmp_path):
    rc, out = _cli_text("plan", '{"model": "llama3-8b", "num_gpus": 8, "headroom_gib": NaN}')
    assert rc == 2 and out["error"]["code"] == "bad_request" and "NaN" in out["error"]["message"]
    rc, out = _cli_text("plan", '{"model": "llama3-8b", "num_gpus": Infinity}')
    assert rc == 2 and "Infinity" in out["error"]["message"]
    rc, out, _ = run_cli("plan", "--model", "llama3-8b", "--num-gpus", "8", "--headroom-gib", "nan")
    assert rc == 2 and out["error"]["where"] == "/headroom_gib"


def test_deep_nesting_is_a_bad_request_not_a_recursion_error():
    rc, out = _cli_text("plan", '{"model": "llama3-8b", "num_gpus": 8, "constraints": ' + "[" * 100_000
                        + "]" * 100_000 + "}")
    assert rc == 2 and out["error"]["code"] == "bad_request" and "deep" in out["error"]["message"]
    nested: dict = {}
    for _ in range(200):
        nested = {"x": nested}
    env = call("plan", {"model": "llama3-8b", "num_gpus": 8, "constraints": nested})
    assert not env["ok"] and env["error"]["code"] == "bad_request"


def test_a_huge_gpu_count_is_refused_at_once():
    started = time.monotonic()
    rc, out, _ = run_cli("plan", "--model", "llama3-8b", "--num-gpus", "100000000000000000000", timeout=30)
    assert rc == 2 and out["error"]["where"] == "/num_gpus" and time.monotonic() - started < 30


def test_internal_errors_have_their_own_code_and_exit_status(monkeypatch):
    from megatron_skill import contract, errors

    def broken(req, ctx):
        raise ZeroDivisionError("a bug")
    from megatron_skill.tools import TOOLS
    monkeypatch.setitem(TOOLS, "doctor", contract.Tool("doctor", "x", broken))
    env = call("doctor", {})
    assert env["error"]["code"] == "internal" and contract.exit_code(env) == errors.EXIT_CODES["internal"] == 9


# ---- output is strict JSON -------------------------------------------------------------
def test_a_nan_loss_log_answers_strict_json(tmp_path):
    log = tmp_path / "nan.log"
    lines = [f" [2026-12-03 10:00:0{i}] iteration {i}/ 10 | elapsed time per iteration (ms): 100.0 | "
             f"global batch size: 8 | lm loss: {'NAN' if i == 4 else '3.2E+00'} | number of nan iterations: "
             f"{int(i >= 4)} |" for i in range(1, 7)]
    log.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([*LAUNCH, "logs", "--log", str(log)], capture_output=True, text=True, timeout=60)
    out = _strict(proc.stdout)
    assert out["ok"] and any(a["kind"] == "nan" for a in out["result"]["anomalies"])
    assert [4, None] in out["result"]["loss_curve"]
    assert {"where": "/result/loss_curve/3/1", "value": "nan"} in out["non_finite"]


# ---- no hang ---------------------------------------------------------------------------
def test_logs_refuses_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero"), tmp_path):
        rc, out, _ = run_cli("logs", "--log", str(path), timeout=30)
        assert rc == 2 and "not a regular file" in out["error"]["message"], out


def test_validate_reads_a_long_array_in_linear_time_and_refuses_binaries(tmp_path):
    script = tmp_path / "long.sh"
    script.write_text("ARGS=(\n" + "".join(f"  --lr 0.{i}\n" for i in range(40_000)) + ")\n"
                      "torchrun pretrain_gpt.py \"${ARGS[@]}\"\n")
    rc, out, _ = run_cli("validate", "--script", str(script), timeout=120)  # quadratic took > 300 s
    assert rc == 2 and "80,000 arguments" in out["error"]["message"]
    binary = tmp_path / "blob.sh"
    binary.write_bytes(os.urandom(4096) + b"\0" * 16)
    rc, out, _ = run_cli("validate", "--script", str(binary), timeout=30)
    assert rc == 2 and "binary" in out["error"]["message"]
    big = tmp_path / "big.sh"
    big.write_bytes(b"# filler\n" * 200_000)
    rc, out, _ = run_cli("validate", "--script", str(big), timeout=30)
    assert rc == 2 and "bytes" in out["error"]["message"]


# ---- the run lock ------------------------------------------------------------------------
def _race(lock_path: str, barrier, results) -> None:
    from megatron_skill.locks import Busy, FileLock

    lock = FileLock(Path(lock_path), record_owner=True)
    barrier.wait()
    try:
        lock.acquire()
    except Busy:
        results.put(0)
        return
    results.put(1)
    time.sleep(0.3)  # hold it while the others try
    lock.release()


def test_eight_processes_racing_for_a_dead_owners_lock_give_one_holder(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for trial in range(10):
        lock = tmp_path / f"run{trial}.lock"
        lock.write_text(json.dumps({"pid": 999999, "host": os.uname().nodename, "since": 0}))  # a dead owner
        barrier, results = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_race, args=(str(lock), barrier, results)) for _ in range(8)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        assert sum(results.get(timeout=5) for _ in procs) == 1, f"trial {trial}"


def test_the_lock_dies_with_its_holder(tmp_path):
    from megatron_skill.locks import FileLock

    lock = FileLock(tmp_path / "x.lock", record_owner=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]);"
                               "from megatron_skill.locks import FileLock; from pathlib import Path;"
                               "FileLock(Path(sys.argv[2]), record_owner=True).acquire(); print('held', flush=True);"
                               "time.sleep(60)", str(ROOT / "tools"), str(lock.path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert lock.held_elsewhere() and lock.owner()["pid"] == holder.pid
    holder.kill()
    holder.wait()
    assert not lock.held_elsewhere()
    with lock:
        assert lock.owner()["pid"] == os.getpid()


@pytest.mark.slow
def test_killing_only_the_tool_stops_the_trainer_it_started(tmp_path):
    """SIGKILL to launch.py alone (not its process group): the CPU trainer it started is stopped
    too, and the run lock is free afterwards, so the same request can continue."""
    runs = tmp_path / "runs"
    args = [*LAUNCH, "train", "--model", "tiny-gpt", "--seq-length", "64", "--global-batch-size", "4",
            "--runs-root", str(runs), "--training", '{"train_iters": 100000, "log_interval": 1, "save_interval": 1000}']
    tool = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    logs = []
    while time.time() < deadline and not any("iteration" in p.read_text() for p in logs):
        time.sleep(0.5)
        logs = list(runs.glob("*/logs/train.log"))
    assert logs, "the run never logged an iteration"
    run_dir = logs[0].parent.parent
    tool.kill()  # the tool only
    tool.wait()

    def trainers():
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and str(run_dir).encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
        return found
    from megatron_skill.runs import RunLock

    # A dying process gives up its command line before its files: wait for both.
    deadline = time.time() + 60
    while (trainers() or RunLock(run_dir).held_elsewhere()) and time.time() < deadline:
        time.sleep(0.5)
    assert trainers() == []
    assert not RunLock(run_dir).held_elsewhere()


# ---- files that are not ours ---------------------------------------------------------------
def test_render_never_overwrites_a_script_it_did_not_write(tmp_path):
    theirs = tmp_path / "launch.sh"
    theirs.write_text("#!/bin/bash\necho my own launcher\n")
    env = call("render", {"model": "llama3.2-1b", "num_gpus": 8, "output_dir": str(tmp_path)})
    assert env["error"]["code"] == "conflict" and theirs.read_text().endswith("my own launcher\n")
    mine = tmp_path / "mine"
    first = call("render", {"model": "llama3.2-1b", "num_gpus": 8, "output_dir": str(mine)})
    again = call("render", {"model": "llama3.2-1b", "num_gpus": 8, "output_dir": str(mine)})
    assert first["ok"] and again["ok"] and sorted(p.name for p in mine.iterdir()) == ["launch.sh"]


def test_render_warns_of_datasets_it_cannot_see_and_train_refuses_them(tmp_path):
    training = {"data_path": [str(tmp_path / "absent")], "train_iters": 10}
    env = call("render", {"model": "tiny-gpt", "num_gpus": 1, "gpu": "h100-sxm", "output_dir": str(tmp_path / "o"),
                          "training": training, "dry_run": True})
    assert env["ok"] and "absent" in env["result"]["warnings"][0]
    env = call("train", {"model": "tiny-gpt", "backend": "cpu", "training": training, "dry_run": True,
                         "runs_root": str(tmp_path / "runs")})
    assert env["error"]["code"] == "not_found" and env["error"]["where"] == "/training/data_path/0"


def test_a_runs_root_that_is_a_file_is_a_bad_request(tmp_path):
    (tmp_path / "f").write_text("x")
    env = call("train", {"model": "tiny-gpt", "backend": "cpu", "runs_root": str(tmp_path / "f"), "dry_run": True})
    assert env["error"]["code"] == "bad_request" and env["error"]["where"] == "/runs_root"
