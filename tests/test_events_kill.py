"""Kills of a train job (issue: a kill of torchrun's process group left its worker training, and
a killed train tool sent no end): stopping a job stops all of its processes, and a train that
dies leaves its run failed with its end sent, by its watchdog or by the next on-event / train."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, require_modules, wait_until
from test_events import SECRET, TOKEN, Receiver, _event, _on_event

from megatron_skill import watchdog
from megatron_skill.events import event as ev
from megatron_skill.runs import RunLock

LAUNCH = [sys.executable, str(ROOT / "tools" / "launch.py")]


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(ev.SECRET_ENV, SECRET)
    return SECRET.encode()


@pytest.fixture
def receiver(monkeypatch):
    r = Receiver()
    monkeypatch.setenv(ev.URL_ENV, r.url)
    monkeypatch.setenv(ev.TOKEN_ENV, TOKEN)
    yield r
    r.close()




def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if int(p) != os.getpid()]


def _checkpoint(run_dir: Path) -> int:
    f = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    text = f.read_text().strip() if f.exists() else ""
    return int(text) if text.isdigit() else 0


def _start_train(tmp_path: Path, iters: int = 200) -> tuple[subprocess.Popen, Path]:
    runs = tmp_path / "runs"
    req = tmp_path / "train.json"
    req.write_text(json.dumps({"model": "tiny-gpt", "backend": "cpu", "seq_length": 64, "global_batch_size": 4,
                               "runs_root": str(runs),
                               "training": {"train_iters": iters, "save_interval": 5, "log_interval": 1}}))
    train = subprocess.Popen([*LAUNCH, "train", "--request", str(req)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
    run_dir = wait_until(lambda: next(iter(runs.glob("*/cpu_run.json")), None), 120, "the run folder").parent
    wait_until(lambda: _checkpoint(run_dir) >= 5, 300, "the first checkpoint")
    return train, run_dir


def _job_processes(run_dir: Path) -> list[int]:
    """The processes training this run: torchrun and its worker name the run's config."""
    return _pids(f"{run_dir}/cpu_run.json")


# ---- the job's processes ------------------------------------------------------------------------
def test_stopping_a_job_stops_a_process_that_left_its_group_and_session(tmp_path):
    """The job's mark reaches a grandchild that made a session of its own (as torchrun's workers
    do); stop() finds it by the mark and stops it with the group."""
    mark = "a" * 32
    script = ("import os, subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
              "time.sleep(600)")
    leader = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, watchdog.MARK_ENV: mark},
                              start_new_session=True)
    wait_until(lambda: len(watchdog.marked(mark)) == 2, 30, "the leader and its worker")
    worker = [p for p in watchdog.marked(mark) if p != leader.pid][0]
    assert os.getsid(worker) != os.getsid(leader.pid)
    os.killpg(leader.pid, signal.SIGKILL)  # the leader's group only, as a person's kill -9 -PGID
    leader.wait()
    assert watchdog.marked(mark) == [worker]  # left running: what the mark is for
    assert watchdog.stop(None, mark, grace_s=5)
    wait_until(lambda: not watchdog.marked(mark), 10, "the worker to be gone")
    assert not watchdog.stop(None, mark)  # nothing left


@pytest.mark.slow
def test_a_kill_of_torchruns_process_group_stops_its_worker_and_train_reports_it(tmp_path, receiver, secret):
    require_modules("torch", "megatron.core")
    train, run_dir = _start_train(tmp_path)
    torchrun = wait_until(lambda: _pids(f"torch.distributed.run.*{run_dir}"), 30, "torchrun")
    assert len(_job_processes(run_dir)) == 2  # torchrun and its worker, in a session of its own
    os.killpg(os.getpgid(torchrun[0]), signal.SIGKILL)
    answer = json.loads(train.communicate(timeout=120)[0])
    assert answer["error"]["details"]["result"]["returncode"] == -signal.SIGKILL
    assert _job_processes(run_dir) == []  # the worker was stopped with torchrun
    killed_at = _checkpoint(run_dir)
    time.sleep(3)
    assert _checkpoint(run_dir) == killed_at < 200  # and trains no more
    failed = receiver.wait_for("job.failed")
    assert failed["details"]["signal"] == "SIGKILL" and failed["job"]["job_id"] == f"{run_dir.name}.0"
    assert json.loads((run_dir / "state.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_a_killed_train_has_its_job_stopped_and_its_end_sent_by_its_watchdog(tmp_path, receiver, secret):
    require_modules("torch", "megatron.core")
    train, run_dir = _start_train(tmp_path)
    train.kill()  # the tool only: its job and its watchdog live on
    train.wait()
    failed = receiver.wait_for("job.failed", timeout=90)
    assert failed["emitter"] == "train" and failed["job"]["job_id"] == f"{run_dir.name}.0"
    assert failed["details"]["failure"] == "killed" and "exit_code" not in failed["details"]
    assert "train stopped before it recorded the job's end" in failed["details"]["message"]
    assert ev.verified(failed, secret)
    assert _job_processes(run_dir) == [] and not RunLock(run_dir).held_elsewhere()
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "failed" and state["died"]
    # on-event reads it as a kill of job .0: a resume for a person to allow.
    out = _on_event(failed, tmp_path / "runs")["result"]
    assert out["cause"] == "killed" and out["actions"][0]["kind"] == "resume" and "ended_attempt" not in out
    assert len(receiver.events("job.failed")) == 1


@pytest.mark.slow
def test_after_a_host_death_the_next_train_reports_the_dead_attempts_end_and_resumes(tmp_path, receiver, secret):
    """train, its watchdog and its job all die at once (the host went down): the run says
    "running" with nobody holding it; the same request again reports that attempt's end first."""
    require_modules("torch", "megatron.core")
    train, run_dir = _start_train(tmp_path, iters=12)
    doomed = [train.pid, *_pids(f"watchdog.py .* {run_dir}"), *_job_processes(run_dir)]
    assert len(doomed) == 4  # train, its watchdog, torchrun, the worker
    for pid in doomed:
        os.kill(pid, signal.SIGKILL)
    train.wait()
    wait_until(lambda: not _job_processes(run_dir) and not RunLock(run_dir).held_elsewhere(), 30, "the job gone")
    assert json.loads((run_dir / "state.json").read_text())["status"] == "running"
    assert not receiver.events("job.failed")
    again = subprocess.run([*LAUNCH, "train", "--request", str(tmp_path / "train.json")], capture_output=True,
                           text=True, cwd=tmp_path, timeout=600)
    result = json.loads(again.stdout)["result"]
    assert result["returncode"] == 0 and result["start"] == "resume"
    assert f"reported it (job.failed of job {run_dir.name}.0)" in again.stderr
    failed = receiver.wait_for("job.failed")
    assert failed["job"]["job_id"] == f"{run_dir.name}.0" and failed["details"]["failure"] == "killed"
    assert receiver.wait_for("job.finished")["job"]["job_id"] == f"{run_dir.name}.1"
    assert len(receiver.events("job.failed")) == 1


# ---- the next call reads a dead train's run as failed ------------------------------------------
def _running_run(tmp_path: Path, run_id: str = "r0123456789abcdef") -> Path:
    run = tmp_path / "runs" / run_id
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "train.log").write_text(" [2026-12-05 10:00:00] iteration        7/     100 | lm loss: 5.1E+00 |\n")
    (run / "state.json").write_text(json.dumps({"status": "running", "run_id": run_id, "attempts": 2,
                                                "job_id": f"{run_id}.1", "layout": {"tp": 1, "dp": 1}}))
    return run


def test_the_next_on_event_reads_a_dead_trains_run_as_failed_and_sends_its_end_once(tmp_path, receiver, secret):
    run = _running_run(tmp_path)
    # While a process holds the run's lock, its train is alive: nothing is settled.
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(600)",
                               str(run / "run.lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    stall = ev.sign(_event("training.stalled", job_id=f"{run.name}.1", iteration=7, silent_s=900), secret)
    out = _on_event(stall, tmp_path / "runs")["result"]
    assert "ended_attempt" not in out and json.loads((run / "state.json").read_text())["status"] == "running"
    holder.kill()
    holder.wait()
    # Its train is gone: the next on-event call marks the run failed and sends the job's end.
    started = ev.sign(_event("job.started", job_id=f"{run.name}.1"), secret)
    out = _on_event(started, tmp_path / "runs")["result"]
    assert out["ended_attempt"]["job_id"] == f"{run.name}.1"
    state = json.loads((run / "state.json").read_text())
    assert state["status"] == "failed" and "train stopped" in state["died"]
    failed = receiver.wait_for("job.failed")
    assert failed["event_id"] == out["ended_attempt"]["event_id"] and ev.verified(failed, secret)
    assert failed["job"]["job_id"] == f"{run.name}.1" and failed["layout"] == {"tp": 1, "dp": 1}
    recorded = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event_id"] for e in recorded] == [failed["event_id"]]
    # Once: the next call finds the run failed.
    again = _on_event(ev.sign(_event("job.started", job_id=f"{run.name}.2"), secret), tmp_path / "runs")["result"]
    assert "ended_attempt" not in again
    # on-event reads the end it sent as a kill of that job.
    end = _on_event(failed, tmp_path / "runs")["result"]
    assert end["cause"] == "killed" and end["actions"][0]["kind"] == "resume"
    time.sleep(1)
    assert len(receiver.events("job.failed")) == 1


def test_emit_event_settle_marks_the_run_and_sends_the_end_itself(tmp_path, receiver, secret):
    """What a dead train's watchdog runs: the end made and sent by the emitter, once."""
    run = _running_run(tmp_path)
    env = {**os.environ}
    for _ in range(2):
        subprocess.run([sys.executable, str(ROOT / "tools" / "emit_event.py"), "settle", "--run-dir", str(run)],
                       check=True, timeout=60, env=env, capture_output=True)
    (failed,) = receiver.events("job.failed")
    assert failed["job"]["job_id"] == f"{run.name}.1" and failed["details"]["failure"] == "killed"
    assert json.loads((run / "state.json").read_text())["status"] == "failed"


def test_a_train_of_another_host_is_not_read_as_dead_here(tmp_path, receiver, secret):
    """The run's lock records the train that holds it (pid, host). Where flock is each host's own
    (a file system that does not share it), no holder here says nothing of a train on another
    host: on-event here leaves that run running and sends no end; the same record of this host,
    with no holder, is a dead train's, settled as before."""
    run = _running_run(tmp_path)
    (run / "run.lock").write_text(json.dumps({"pid": 4321, "host": "gpu-node-17", "since": time.time()}))
    stall = ev.sign(_event("training.stalled", job_id=f"{run.name}.1", iteration=7, silent_s=900), secret)
    out = _on_event(stall, tmp_path / "runs")["result"]
    assert "ended_attempt" not in out and json.loads((run / "state.json").read_text())["status"] == "running"
    subprocess.run([sys.executable, str(ROOT / "tools" / "emit_event.py"), "settle", "--run-dir", str(run)],
                   check=True, timeout=60, capture_output=True)
    assert json.loads((run / "state.json").read_text())["status"] == "running"
    assert json.loads((run / "run.lock").read_text())["host"] == "gpu-node-17"   # its record left as it was
    time.sleep(1)
    assert not receiver.events("job.failed")
    (run / "run.lock").write_text(json.dumps({"pid": 4321, "host": socket.gethostname(), "since": time.time()}))
    out = _on_event(ev.sign(_event("job.started", job_id=f"{run.name}.2"), secret), tmp_path / "runs")["result"]
    assert out["ended_attempt"]["job_id"] == f"{run.name}.1"
    assert json.loads((run / "state.json").read_text())["status"] == "failed"
    assert receiver.wait_for("job.failed")["job"]["job_id"] == f"{run.name}.1"
