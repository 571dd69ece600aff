"""Training events end to end: emitters (the train tool, the log watcher, a rendered script's
exit trap), a real HTTP receiver on this machine, and on-event's checks, deduplication and
intended actions, up to a resumed run whose loss carries on."""
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, require_modules, wait_until

from megatron_skill import contract
from megatron_skill.events import emit as emitter
from megatron_skill.events import event as ev
from megatron_skill.events.ledger import Ledger

SECRET = "a-shared-secret-for-tests"
TOKEN = "gateway-token"
EMIT = [sys.executable, str(ROOT / "tools" / "emit_event.py")]


class Receiver:
    """A webhook receiver on 127.0.0.1, as OpenClaw's Gateway would be: it records each POSTed
    body with its Authorization header and answers 202."""

    def __init__(self, delay_s: float = 0.0, port: int = 0, token: str | None = None):
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.keys: list[str | None] = []
        self.refused: list[str | None] = []  # the Authorization of each POST answered 401 (token given)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                    outer.refused.append(self.headers.get("Authorization"))
                    self.send_response(401)   # as the Gateway answers a wrong hooks token
                    self.end_headers()
                    return
                time.sleep(delay_s)  # a Gateway admitting the hook (it starts an agent turn first)
                outer.bodies.append(json.loads(data))
                outer.auth.append(self.headers.get("Authorization"))
                outer.keys.append(self.headers.get("Idempotency-Key"))
                self.send_response(202)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/megatron"

    def events(self, kind: str | None = None) -> list[dict]:
        return [b["event"] for b in list(self.bodies) if kind is None or b["event"]["type"] == kind]

    def wait_for(self, kind: str, timeout: float = 60) -> dict:
        end = time.time() + timeout
        while time.time() < end:
            found = self.events(kind)
            if found:
                return found[-1]
            time.sleep(0.2)
        raise AssertionError(f"no {kind} event arrived; got {[e['type'] for e in self.events()]}")

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(ev.SECRET_ENV, SECRET)
    return SECRET.encode()


def _on_event(event: dict, runs_root: Path, **fields) -> dict:
    return contract.call("on-event", {"event": event, "runs_root": str(runs_root), **fields})


def _run_dir(tmp_path: Path, run_id: str = "r0123456789abcdef") -> Path:
    run = tmp_path / "runs" / run_id
    (run / "logs").mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"status": "failed"}))
    return run


def _event(kind: str, run_id: str = "r0123456789abcdef", job_id: str = "4242", **details) -> dict:
    return ev.new(kind, run_id, {"job_id": job_id, "scheduler": "slurm", "host": "node7"}, "job",
                  details=details or None)


# ---- the event: signature, checks --------------------------------------------------------
def test_a_signature_survives_a_javascript_receiver_rewriting_whole_floats(secret):
    signed = ev.sign(_event("loss.anomaly", loss=3.0, before=2.0, iteration=12), secret)
    # JSON.stringify writes 3.0 as 3: the canonical form is the same, so the signature holds.
    rewritten = json.loads(json.dumps(signed))
    rewritten["details"].update(loss=3, before=2)  # (a text replace could hit the timestamp's digits)
    assert ev.verified(rewritten, secret)
    rewritten["details"]["iteration"] = 13
    assert not ev.verified(rewritten, secret)


def test_forged_unsigned_stale_and_future_events_are_refused_and_nothing_is_recorded(tmp_path, secret):
    run = _run_dir(tmp_path)
    good = ev.sign(_event("job.failed", exit_code=137, signal="SIGKILL"), secret)
    forged = json.loads(json.dumps(good))
    forged["details"]["exit_code"] = 1
    unsigned = {k: v for k, v in good.items() if k != "signature"}
    stale = ev.sign({**_event("job.failed"), "time": "2026-01-01T00:00:00Z"}, secret)
    future = ev.sign({**_event("job.failed"), "time": "2099-01-01T00:00:00Z"}, secret)
    other_key = ev.sign(_event("job.failed"), b"another secret")
    for bad, where in ((forged, "/event/signature"), (unsigned, "/event/signature"), (other_key, "/event/signature"),
                       (stale, "/event/time"), (future, "/event/time")):
        out = _on_event(bad, tmp_path / "runs")
        assert not out["ok"] and out["error"]["code"] == "refused", out
        assert out["error"]["where"] == where and out["error"]["fix"]
    assert not (tmp_path / "runs" / ".events").exists()  # nothing recorded, nothing done
    assert contract.exit_code(_on_event(forged, tmp_path / "runs")) == 10
    # A stale event is handled when the policy allows its age.
    assert _on_event(stale, tmp_path / "runs", policy={"max_age_s": 31536000}, dry_run=True)["ok"]
    assert run.exists()


def test_malformed_events_and_unknown_runs_are_clear_errors(tmp_path, secret, cli):
    _run_dir(tmp_path)
    event = ev.sign(_event("job.failed"), secret)
    out = _on_event({**event, "extra": 1}, tmp_path / "runs")
    assert out["error"]["code"] == "bad_request" and out["error"]["where"] == "/event"
    out = _on_event(ev.sign({**event, "run_id": "no-such-run"}, secret), tmp_path / "runs")
    assert out["error"]["code"] == "not_found" and out["error"]["where"] == "/event/run_id"
    big = tmp_path / "big.json"
    big.write_text(json.dumps({**event, "details": {"message": "x" * 100_000}}))
    code, out, _ = cli("on-event", "--event-file", str(big), "--runs-root", str(tmp_path / "runs"))
    assert code == 2 and "larger than" in out["error"]["message"]
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"source": "megatron-skill", "event": {**event, "type": "job.exploded"}}))
    code, out, _ = cli("on-event", "--event-file", str(wrong), "--runs-root", str(tmp_path / "runs"))
    assert code == 2 and out["error"]["where"] == "/event_file:/type"
    monkey_env = {ev.SECRET_ENV: ""}
    code, out, _ = cli("on-event", "--event-file", str(wrong), "--runs-root", str(tmp_path / "runs"), env=monkey_env)
    assert code == 2  # the form is checked first; a missing secret is an environment error:
    ok_file = tmp_path / "ok.json"
    ok_file.write_text(json.dumps(ev.body(event)))
    code, out, _ = cli("on-event", "--event-file", str(ok_file), "--runs-root", str(tmp_path / "runs"), env=monkey_env)
    assert code == 5 and ev.SECRET_ENV in out["error"]["fix"]


# ---- deduplication ------------------------------------------------------------------------
def _marked_run(tmp_path: Path, run_id: str = "r0123456789abcdef") -> tuple[Path, Path]:
    """A run launched from a script that, run again, appends a line to a marker file: how many
    times on-event really started it."""
    run = _run_dir(tmp_path, run_id)
    marker = run / "starts"
    (run / "launch.sh").write_text(f"#!/bin/bash\necho started >> {marker}\n")
    return run, marker


def _starts(marker: Path, expected: int) -> int:
    """The marker's lines once the started processes had time to write them."""
    if expected:
        wait_until(lambda: marker.exists() and len(marker.read_text().splitlines()) >= expected, 30, "the resume")
    time.sleep(0.5)  # a second start would have written by now
    return len(marker.read_text().splitlines()) if marker.exists() else 0


def test_the_same_event_and_the_same_incident_from_another_emitter_act_once(tmp_path, secret):
    run = _run_dir(tmp_path)
    (run / "launch.sbatch").write_text("#!/bin/bash\n")
    first = ev.sign(_event("job.failed", exit_code=143, signal="SIGTERM", failure="nccl_timeout"), secret)
    a = _on_event(first, tmp_path / "runs")["result"]
    assert a["verdict"] == "handled" and [x["kind"] for x in a["actions"]] == ["resume"]
    assert a["actions"][0]["commands"] == [f"sbatch --chdir={run} --no-requeue {run / 'launch.sbatch'}"]
    assert a["actions"][0]["allowed"] and not a["actions"][0]["needs_person"]
    # Answered, not started: the same event again answers the same action, still to start.
    again = _on_event(first, tmp_path / "runs")["result"]
    assert again["verdict"] == "pending" and again["actions"] == a["actions"]
    # The scheduler reports the same job's end, saying less: the same incident, the same action.
    scheduler = ev.sign({**_event("job.failed", exit_code=1), "emitter": "scheduler"}, secret)
    third = _on_event(scheduler, tmp_path / "runs")["result"]
    assert third["verdict"] == "pending" and third["incident"] == a["incident"] and third["cause"] == "nccl_timeout"
    # The next job of the run is a new incident.
    nxt = _on_event(ev.sign(_event("job.failed", job_id="4243", failure="node_failure"), secret), tmp_path / "runs")
    assert nxt["result"]["verdict"] == "handled" and nxt["result"]["incident"] != a["incident"]


def test_an_action_answered_without_apply_starts_later_and_once(tmp_path, secret):
    """The documented flow: on-event answers, the user says yes, on-event --apply starts it."""
    run, marker = _marked_run(tmp_path)
    failed = ev.sign(_event("job.failed", exit_code=1, failure="nccl_timeout"), secret)
    told = _on_event(failed, tmp_path / "runs")["result"]
    (action,) = told["actions"]
    assert told["verdict"] == "handled" and action["allowed"] and "applied" not in action
    assert _starts(marker, 0) == 0
    started = _on_event(failed, tmp_path / "runs", apply=True)["result"]
    assert started["verdict"] == "handled" and started["actions"][0]["applied"]["pid"]
    assert _starts(marker, 1) == 1
    # The event again, and another report of the same end: nothing more starts.
    assert _on_event(failed, tmp_path / "runs", apply=True)["result"]["verdict"] == "duplicate"
    trap = ev.sign({**_event("job.failed", exit_code=1), "emitter": "scheduler"}, secret)
    late = _on_event(trap, tmp_path / "runs", apply=True)["result"]
    assert late["verdict"] == "duplicate" and late["duplicate_of"] == failed["event_id"]
    assert late["facts"]["applied"]["resume"]["pid"] == started["actions"][0]["applied"]["pid"]
    assert _starts(marker, 1) == 1


def test_a_kill_waits_for_a_person_with_the_command_and_starts_once_approved(tmp_path, secret):
    run, marker = _marked_run(tmp_path)
    killed = ev.sign(_event("job.failed", exit_code=137, signal="SIGKILL"), secret)
    out = _on_event(killed, tmp_path / "runs", apply=True)["result"]
    (action,) = out["actions"]
    assert out["cause"] == "killed" and action["kind"] == "resume"
    assert action["needs_person"] is True and action["allowed"] is False and "applied" not in action
    assert action["commands"] == [f"bash {run / 'launch.sh'} > {run / 'logs' / 'resume.out'} 2>&1"]
    assert "--approve resume" in action["why"]
    assert _starts(marker, 0) == 0
    # The user says yes: the same event with the approval starts it; any later report does not.
    yes = _on_event(killed, tmp_path / "runs", apply=True, approve=["resume"])["result"]
    assert yes["verdict"] == "handled" and yes["actions"][0]["applied"]["approved"] is True
    other = ev.sign({**_event("job.failed", exit_code=137, signal="SIGKILL"), "emitter": "scheduler"}, secret)
    assert _on_event(other, tmp_path / "runs", apply=True, approve=["resume"])["result"]["verdict"] == "duplicate"
    assert _starts(marker, 1) == 1


def test_a_later_node_failure_report_upgrades_a_kill_and_resumes_without_the_jobs_nodes(tmp_path, secret):
    """The trap saw SIGKILL (exit 137, no failure); Slurm's trigger then reports the same job
    as NODE_FAIL: one incident, now a node failure, whose resume the default policy starts."""
    run, marker = _marked_run(tmp_path)
    trap = ev.sign(_event("job.failed", exit_code=137, signal="SIGKILL"), secret)
    first = _on_event(trap, tmp_path / "runs", apply=True)["result"]
    assert first["cause"] == "killed" and first["actions"][0]["needs_person"] and _starts(marker, 0) == 0
    trigger = ev.sign({**ev.new("job.failed", run.name, {"job_id": "4242", "scheduler": "slurm", "host": "ctl",
                                                        "nodes": ["gpu[03-04]"]}, "scheduler",
                                details={"exit_code": 1, "failure": "node_failure"})}, secret)
    second = _on_event(trigger, tmp_path / "runs", apply=True)["result"]
    assert second["verdict"] == "handled" and second["incident"] == first["incident"]
    assert second["cause"] == "node_failure" and second["actions"][0]["applied"]["pid"]
    assert _starts(marker, 1) == 1
    assert _on_event(trap, tmp_path / "runs", apply=True)["result"]["verdict"] == "duplicate"
    # Under Slurm, the resume leaves out the failed job's nodes, not the host the trigger ran on.
    sb = _run_dir(tmp_path, "sb0123456789abcdef")
    (sb / "launch.sbatch").write_text("#!/bin/bash\n")
    for event in (trap, trigger):
        moved = ev.sign({**{k: v for k, v in event.items() if k != "signature"}, "run_id": sb.name,
                         "event_id": "x" + event["event_id"]}, secret)
        out = _on_event(moved, tmp_path / "runs")["result"]
    assert out["actions"][0]["commands"] == [f"sbatch --chdir={sb} '--exclude=gpu[03-04]' --no-requeue {sb / 'launch.sbatch'}"]


def test_the_watchers_nccl_report_gives_the_jobs_bare_end_its_cause(tmp_path, secret):
    """The watcher saw the NCCL timeout while the job ran; the trap then reports a bare exit 1:
    one incident, whose cause is the watcher's."""
    run, marker = _marked_run(tmp_path)
    assert _on_event(ev.sign(_event("job.started"), secret), tmp_path / "runs")["result"]["verdict"] == "noted"
    seen = {**_event("node.failure", failure="nccl_timeout", message="collective timed out"), "emitter": "watcher"}
    wait = _on_event(ev.sign(seen, secret), tmp_path / "runs")["result"]
    assert wait["verdict"] == "noted" and wait["actions"][0]["kind"] == "wait"
    end = _on_event(ev.sign(_event("job.failed", exit_code=1), secret), tmp_path / "runs", apply=True)["result"]
    assert end["cause"] == "nccl_timeout" and end["incident"] == wait["incident"]
    assert end["actions"][0]["kind"] == "resume" and end["actions"][0]["applied"]["pid"]
    assert _starts(marker, 1) == 1


def test_one_job_run_is_one_incident_whatever_reports_it():
    """Guards the incident key: every report of one job's end (trap, trigger, train, watcher)
    shares it, whatever its type; another job, or a stall, is another incident."""
    job = {"job_id": "77", "scheduler": "slurm"}
    ends = [ev.new(kind, "r1", job, emitter) for kind, emitter in
            (("job.failed", "job"), ("job.failed", "scheduler"), ("job.finished", "train"), ("node.failure", "watcher"))]
    assert len({ev.incident(e) for e in ends}) == 1
    assert ev.incident(ends[0]) not in {e["type"] for e in ends} and ends[0]["type"] not in ev.incident(ends[0])
    other_job = ev.new("job.failed", "r1", {"job_id": "78"}, "job")
    stall = ev.new("training.stalled", "r1", job, "watcher")
    assert len({ev.incident(ends[0]), ev.incident(other_job), ev.incident(stall)}) == 3
    assert ev.incident(ev.new("job.failed", "r2", job, "job")) != ev.incident(ends[0])


def test_two_handlers_at_once_start_one_resume(tmp_path, secret):
    run, marker = _marked_run(tmp_path)
    path = tmp_path / "event.json"
    path.write_text(json.dumps(ev.body(ev.sign(_event("job.failed", failure="nccl_timeout"), secret))))
    cmd = [sys.executable, str(ROOT / "tools" / "launch.py"), "on-event", "--event-file", str(path),
           "--runs-root", str(tmp_path / "runs"), "--apply"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(4)]
    verdicts = sorted(json.loads(p.communicate(timeout=120)[0])["result"]["verdict"] for p in procs)
    assert verdicts == ["duplicate"] * 3 + ["handled"]
    record = json.loads((tmp_path / "runs" / ".events" / run.name / "ledger.json").read_text())
    assert len(record["incidents"]) == 1 and len(record["relaunches"]) == 1
    assert _starts(marker, 1) == 1


def test_relaunches_are_limited_and_backed_off(tmp_path):
    ledger = Ledger(tmp_path, "r1")
    now = 1_000_000.0
    assert ledger.relaunch_allowed(now, 3, 3600, 60)[0]
    ledger.count_relaunch(now)
    ok, why, not_before = ledger.relaunch_allowed(now + 30, 3, 3600, 60)
    assert not ok and "back-off" in why and not_before == now + 60
    ledger.count_relaunch(now + 60)
    assert not ledger.relaunch_allowed(now + 150, 3, 3600, 60)[0]  # the second waits 120 s after the first
    ledger.count_relaunch(now + 200)
    ok, why, not_before = ledger.relaunch_allowed(now + 300, 3, 3600, 0)
    assert not ok and "limit" in why and not_before == now + 3600
    assert ledger.relaunch_allowed(now + 3601, 3, 3600, 0)[0]  # the first has left the window


def test_a_storm_of_failures_relaunches_at_most_the_policy_allows(tmp_path, secret):
    run = _run_dir(tmp_path)
    (run / "launch.sh").write_text("#!/bin/bash\nexit 0\n")
    applied = []
    for job in range(5):
        out = _on_event(ev.sign(_event("job.failed", job_id=f"j{job}", failure="killed"), secret), tmp_path / "runs",
                        apply=True, policy={"max_relaunches": 2, "backoff_s": 0, "allow": {"killed": ["resume"]}})["result"]
        applied.append(bool(out["actions"][0].get("applied")))
    assert applied == [True, True, False, False, False]
    last = out["actions"][0]
    assert last["needs_person"] and "limit" in last["why"] and last["not_before"]


# ---- the watcher ---------------------------------------------------------------------------
def _iteration(i: int, loss: str, ms: float = 5.0) -> str:
    return (f" [2026-12-05 10:00:00] iteration {i:8d}/ 1000 | consumed samples: {i * 8} | elapsed time per "
            f"iteration (ms): {ms} | learning rate: 1.0E-04 | global batch size: 8 | lm loss: {loss} |")


def test_a_stopped_watcher_reports_what_the_log_says_before_it_goes(tmp_path, receiver, secret):
    """The job's launcher stops the watcher (SIGTERM) as soon as the job ends: a checkpoint the
    job wrote just before (here on a last line without its newline) must still be reported."""
    run, log = tmp_path / "run", tmp_path / "train.log"
    run.mkdir()
    log.write_text("")
    alive = subprocess.Popen(["sleep", "120"])   # the launcher: alive all along, the watcher is stopped
    env = {**os.environ, ev.URL_ENV: receiver.url, ev.TOKEN_ENV: TOKEN}
    watch = subprocess.Popen(EMIT + ["watch", "--pid", str(alive.pid), "--run-id", "r1", "--run-dir", str(run),
                                     "--log", str(log), "--poll-s", "30"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        # The watcher handles SIGTERM (its start can take seconds on a loaded machine), has read the
        # (empty) log and sleeps its poll.
        wait_until(lambda: int(re.search(r"SigCgt:\s*([0-9a-f]+)", Path(f"/proc/{watch.pid}/status").read_text())
                          .group(1), 16) & (1 << (signal.SIGTERM - 1)), 60, "the watcher's SIGTERM handler")
        time.sleep(1)
        with open(log, "a") as f:
            f.write(" iteration       10/      80 | lm loss: 5.1E+00 |\n"
                    "  successfully saved checkpoint from iteration      10 to runs/x/checkpoints")
        watch.send_signal(signal.SIGTERM)
        assert watch.wait(timeout=60) == 0
    finally:
        alive.kill()
    saved = receiver.wait_for("checkpoint.saved", timeout=10)
    assert saved["details"]["checkpoint_iteration"] == 10


def test_the_watcher_says_each_thing_once_an_episode():
    w = emitter.Watcher(stall_s=0.2)
    kinds = []
    for i in range(1, 10):
        kinds += [k for k, _ in w.line(_iteration(i, "3.0E+00"))]
    assert kinds == []
    saved = w.line("  [2026-12-05 10:00:01] successfully saved checkpoint from iteration      10 to /ckpt [ t 1/1 ]")
    assert saved == [("checkpoint.saved", {"checkpoint_iteration": 10, "loss": 3.0})]
    spike = [k for i in (10, 11) for k, _ in w.line(_iteration(i, "9.0E+00"))]
    assert spike == ["loss.anomaly"]
    nan = [d for i in (12, 13) for k, d in w.line(_iteration(i, "nan"))]
    assert len(nan) == 1 and nan[0]["loss"] == "nan" and nan[0]["iteration"] == 12
    slow = [k for i in range(14, 20) for k, _ in w.line(_iteration(i, "3.0E+00", ms=20.0))]
    assert slow == ["throughput.drop"]
    nccl = [k for _ in range(2) for k, _ in w.line("[rank3]: Watchdog caught collective operation timeout: ...")]
    assert nccl == ["node.failure"]
    time.sleep(0.25)
    assert [k for k, _ in w.idle()] == ["training.stalled"] and w.idle() == []


# ---- emitters: a receiver that is down ------------------------------------------------------
def _black_hole() -> socket.socket:
    """A receiver that accepts connections and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def test_a_receiver_that_is_down_or_silent_costs_at_most_the_deadline(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}/hooks"
    closed.close()
    hole = _black_hole()
    silent_url = f"http://127.0.0.1:{hole.getsockname()[1]}/hooks"
    for url, deadline in ((dead_url, 10.0), (silent_url, 1.5)):
        t0 = time.monotonic()
        proc = subprocess.run(EMIT + ["send", "--type", "job.started", "--run-id", "r1", "--run-dir", str(run),
                                      "--deadline-s", str(deadline)],
                              env={**os.environ, ev.URL_ENV: url, emitter.MAX_AGE_ENV: "5"},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "emit: job.started" in proc.stderr
        assert time.monotonic() - t0 < deadline + 5
    hole.close()
    recorded = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in recorded] == ["job.started", "job.started"]
    # Bad arguments never fail the job that calls it.
    assert subprocess.run(EMIT + ["send", "--no-such-flag"], capture_output=True, timeout=60).returncode == 0


# ---- a rendered script's exit trap ------------------------------------------------------------
def test_a_rendered_script_reports_its_start_and_its_failure(tmp_path, receiver, secret):
    out = contract.call("render", {"model": "tiny-gpt", "gpu": "h100-sxm", "num_gpus": 1, "dry_run": True,
                                   "output_dir": str(tmp_path), "skill_home": str(ROOT),
                                   "training": {"mock_data": True}})["result"]
    script = tmp_path / "launch.sh"
    script.write_text(out["files"][0]["content"])
    run_dir = tmp_path / "run"
    # The job really runs: here, without a GPU, Megatron's pretrain stops at start-up, and what is
    # checked is the script's own trap: its start, and its end with the job's exit status.
    env = {**os.environ, "RUN_DIR": str(run_dir), "PYTHON": sys.executable, ev.URL_ENV: receiver.url,
           ev.TOKEN_ENV: TOKEN, "MEGATRON_SKILL_JOB_ID": "job-77"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0  # the trap keeps the job's exit status
    failed = receiver.wait_for("job.failed")
    started = receiver.wait_for("job.started")
    assert failed["details"]["exit_code"] == proc.returncode and failed["emitter"] == "job"
    assert failed["details"]["log_tail"]  # the end of the job's log, for whoever handles it
    assert failed["job"]["job_id"] == started["job"]["job_id"] == "job-77"
    assert failed["layout"]["num_gpus"] == 1 and failed["run_id"] == out["run_id"]
    assert ev.verified(failed, secret) and set(receiver.auth) == {f"Bearer {TOKEN}"}
    recorded = [json.loads(x)["type"] for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert recorded == ["job.started", "job.failed"]
    assert SECRET not in script.read_text() and TOKEN not in script.read_text()


# ---- out of memory: a layout plan says fits, rendered and validated ----------------------------
OOM_TAIL = """\
[rank5]: Traceback (most recent call last):
[rank5]:   File "pretrain_gpt.py", line 300, in <module>
[rank5]:     pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder)
[rank5]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 5 has a total capacity of \
79.11 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.07 GiB memory in use.
"""


def test_an_out_of_memory_failure_yields_a_layout_plan_says_fits_rendered_and_validated(tmp_path, secret):
    request = {"model": "llama3-8b", "gpu": "h100-sxm", "num_gpus": 8, "seq_length": 8192, "global_batch_size": 64}
    best = contract.call("plan", {**request, "top": 1})["result"]["plans"][0]
    layout = {k: v for k, v in best["layout"].items() if k not in ("world_size", "expert_dp", "num_microbatches")}
    train_request = {**request, "layout": layout, "runs_root": str(tmp_path / "runs"), "training": {"mock_data": True}}
    run = _run_dir(tmp_path, "oom0123456789abcd")
    (run / "request.json").write_text(json.dumps(train_request))
    (run / "state.json").write_text(json.dumps({"status": "failed", "gpu": "h100-sxm", "cwd": str(tmp_path)}))
    (run / "logs" / "train.log").write_text("\n".join(_iteration(i, "7.0E+00", 4000.0) for i in range(1, 4)) + "\n"
                                            + OOM_TAIL)
    event = ev.sign(_event("job.failed", run_id=run.name, exit_code=1, failure="out_of_memory"), secret)
    out = _on_event(event, tmp_path / "runs")
    assert out["ok"], out
    (action,) = out["result"]["actions"]
    assert action["kind"] == "relayout" and action["validation"]["valid"] is True
    old, new = action["layout"]["from"], action["layout"]["to"]
    assert old != new and action["diff"].startswith("--- before")
    # plan, asked on its own about the new layout, says it fits, below what failed.
    constraints = {k: new[k] for k in ("tp", "pp", "cp", "mbs")}
    check = contract.call("plan", {**request, "top": 1, "constraints": {**constraints, "recompute": [new["recompute"]]}})
    fitted = check["result"]["plans"][0]
    assert fitted["memory"]["peak_gib"] < best["memory"]["peak_gib"] <= 80
    # The proposal is the same request with the new layout, continuing from the run's checkpoints.
    proposal = json.loads(Path(action["files"][0]["path"]).read_text())
    assert proposal["layout"]["mbs"] == new["mbs"] and proposal["training"]["save"] == str(run / "checkpoints")
    assert contract.call("train", {**proposal, "dry_run": True})["ok"]
    assert action["allowed"] is False  # relayout is not in the default policy: a person decides


# ---- NaN and stalls: a person decides, with the facts --------------------------------------------
def _cpu_run(tmp_path: Path, losses: list[str]) -> Path:
    request = {"model": "tiny-gpt", "backend": "cpu", "runs_root": str(tmp_path / "runs"),
               "training": {"train_iters": 40, "save_interval": 5, "log_interval": 1, "lr": 4e-4}}
    run = _run_dir(tmp_path, "nan0123456789abcd")
    (run / "request.json").write_text(json.dumps(request))
    (run / "state.json").write_text(json.dumps({"status": "running", "cwd": str(tmp_path),
                                                "layout": {"gbs": 8, "seq_length": 256}}))
    for it in (5, 10, 15):
        (run / "checkpoints" / f"iter_{it:07d}").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("15")
    (run / "logs" / "train.log").write_text("\n".join(_iteration(i + 1, x) for i, x in enumerate(losses)) + "\n")
    return run


def test_a_nan_loss_answers_a_rollback_to_the_checkpoint_before_it_with_a_lower_learning_rate(tmp_path, secret):
    run = _cpu_run(tmp_path, ["5.0E+00"] * 12 + ["nan"] * 4)
    event = ev.sign(_event("loss.anomaly", run_id=run.name, job_id=f"{run.name}.0", iteration=13, loss="nan"), secret)
    out = _on_event(event, tmp_path / "runs", apply=True)["result"]
    (action,) = out["actions"]
    assert action["kind"] == "rollback" and action["needs_person"] and not action.get("applied")
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert f"echo 10 > {tracker}" in action["commands"][-2]  # 15 came after the NaN at 13
    proposal = action["request"]["training"]
    assert proposal["lr"] == 2e-4 and proposal["override_scheduler"] and proposal["save"] == str(run / "checkpoints")
    assert tracker.read_text() == "15"  # nothing was changed: the rollback is a person's call
    assert contract.call("train", {**action["request"], "dry_run": True})["ok"]


def test_a_stall_answers_a_diagnosis_once(tmp_path, secret):
    run = _cpu_run(tmp_path, ["5.0E+00"] * 12)
    stall = ev.sign(_event("training.stalled", run_id=run.name, iteration=12, silent_s=1800), secret)
    (action,) = _on_event(stall, tmp_path / "runs")["result"]["actions"]
    assert action["kind"] == "diagnose" and action["needs_person"] and "1800" in action["why"]
    assert action["log_tail"][-1].startswith(" [2026-12-05 10:00:00] iteration       12")
    assert any("py-spy dump" in c for c in action["commands"])
    again = ev.sign(_event("training.stalled", run_id=run.name, iteration=12, silent_s=2400), secret)
    assert _on_event(again, tmp_path / "runs")["result"]["verdict"] == "duplicate"


# ---- end to end: a killed CPU run, one resume, the loss carries on ------------------------------


def _checkpoint(run_root: Path) -> int:
    for f in run_root.glob("*/checkpoints/latest_checkpointed_iteration.txt"):
        text = f.read_text().strip()
        if text.isdigit():
            return int(text)
    return 0


def _losses(log: Path) -> list[tuple[int, float]]:
    from megatron_skill.adapter.log import parse_iteration

    out = []
    for line in log.read_text().splitlines():
        rec = parse_iteration(line) if "iteration" in line else None
        if rec and "loss" in rec:
            out.append((rec["iteration"], rec["loss"]))
    return out


@pytest.mark.slow
def test_a_killed_run_emits_job_failed_and_resumes_once_with_its_loss_carrying_on(tmp_path, receiver, secret,
                                                                                   monkeypatch):
    require_modules("torch", "megatron.core")
    monkeypatch.setenv(ev.URL_ENV, receiver.url)
    monkeypatch.setenv(ev.TOKEN_ENV, TOKEN)
    runs = tmp_path / "runs"
    request = {"model": "tiny-gpt", "backend": "cpu", "runs_root": str(runs),
               "training": {"train_iters": 80, "save_interval": 5, "log_interval": 1}}
    req_file = tmp_path / "train.json"
    req_file.write_text(json.dumps(request))
    train = subprocess.Popen([sys.executable, str(ROOT / "tools" / "launch.py"), "train", "--request", str(req_file)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
    wait_until(lambda: _checkpoint(runs) >= 10, 240, "a checkpoint at iteration 10")
    trainer = wait_until(lambda: subprocess.run(["pgrep", "-f", f"cpu_loop.py {runs}"], capture_output=True,
                                           text=True).stdout.split(), 30, "the trainer")
    for pid in trainer:  # the job dies as on a failed node: torchrun and its worker (a session of its own)
        os.kill(int(pid), signal.SIGKILL)
    answer = json.loads(train.communicate(timeout=120)[0])
    assert not answer["ok"] and answer["error"]["details"]["result"]["returncode"] == -signal.SIGKILL
    failed = receiver.wait_for("job.failed")
    assert failed["details"]["signal"] == "SIGKILL" and failed["emitter"] == "train"
    assert receiver.events("checkpoint.saved") and receiver.events("job.started")
    run_dir = runs / failed["run_id"]
    killed_at = _checkpoint(runs)
    before = dict(_losses(run_dir / "logs" / "train.log"))

    # A plain SIGKILL: the tool answers resume with the exact command, for a person to allow.
    out = _on_event(failed, runs, apply=True, policy={"backoff_s": 0})["result"]
    (action,) = out["actions"]
    assert action["kind"] == "resume" and action["needs_person"] and not action.get("applied")
    assert action["commands"] == [f"cd {tmp_path} && {sys.executable} {ROOT / 'tools' / 'launch.py'} train "
                                  f"--request {run_dir / 'request.json'}"]
    # The user allows it: the same event with the approval starts it.
    out = _on_event(failed, runs, apply=True, approve=["resume"], policy={"backoff_s": 0})["result"]
    assert out["verdict"] == "handled" and out["actions"][0]["applied"]["pid"]
    # The same event again, and the same end reported by a second emitter: no second resume.
    assert _on_event(failed, runs, apply=True, approve=["resume"])["result"]["verdict"] == "duplicate"
    subprocess.run(EMIT + ["send", "--end", "--exit-code", "137", "--emitter", "scheduler", "--run-id", failed["run_id"],
                           "--job-id", failed["job"]["job_id"], "--run-dir", str(run_dir)], check=True, timeout=60)
    second = [e for e in receiver.events("job.failed") if e["emitter"] == "scheduler"][0]
    assert _on_event(second, runs, apply=True, approve=["resume"])["result"]["verdict"] == "duplicate"

    state = wait_until(lambda: (json.loads((run_dir / "state.json").read_text()).get("status") == "finished"
                           and json.loads((run_dir / "state.json").read_text())), 300, "the resumed run to finish")
    assert state["attempts"] == 2 and state["result"]["resumed_from"] == killed_at
    log = (run_dir / "logs" / "train.log").read_text()
    assert log.count(f"loaded checkpoint from iteration {killed_at}") == 1
    resumed = _losses(run_dir / "logs" / "train.log")[len(before):]
    assert resumed[0][0] == killed_at + 1 and resumed[-1][0] == 80
    # The loss carries on where it was: the resumed iteration repeats the first run's to within noise.
    if killed_at + 1 in before:
        assert abs(resumed[0][1] - before[killed_at + 1]) < 0.05
    assert resumed[0][1] < before[1] - 0.5
    assert len(receiver.events("job.started")) == 2  # the killed job and the one resume
    assert receiver.wait_for("job.finished")["job"]["job_id"] == f"{failed['run_id']}.1"


@pytest.mark.slow
def test_a_training_run_with_a_silent_receiver_finishes_as_without_one(tmp_path, monkeypatch):
    require_modules("torch", "megatron.core")
    hole = _black_hole()
    monkeypatch.setenv(ev.URL_ENV, f"http://127.0.0.1:{hole.getsockname()[1]}/hooks/megatron")
    monkeypatch.setenv(emitter.MAX_AGE_ENV, "60")  # the senders left trying stop a minute on
    out = contract.call("train", {"model": "tiny-gpt", "backend": "cpu", "runs_root": str(tmp_path / "runs"),
                                  "training": {"train_iters": 10, "save_interval": 5, "log_interval": 1}},
                        contract.Context(progress=lambda m: None))
    hole.close()
    assert out["ok"] and out["result"]["returncode"] == 0 and out["result"]["checkpoint_iteration"] == 10
    run_dir = Path(out["result"]["run_dir"])
    recorded = wait_until(lambda: [json.loads(x)["type"] for x in (run_dir / "events.jsonl").read_text().splitlines()
                              if "job.finished" in (run_dir / "events.jsonl").read_text()], 30, "the end event")
    assert recorded[0] == "job.started" and recorded[-1] == "job.finished" and "checkpoint.saved" in recorded


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_a_slurm_job_and_slurms_own_trigger_report_one_end(tmp_path, slurm):
    """The rendered sbatch under a real Slurm: its trap reports the start and the failure (the
    real entry stops at start-up without a GPU); tools/slurm_job_end.sh, set as the job's
    strigger --fini program, reports the same end from the controller: one incident."""
    run_dir = tmp_path / "run"
    out = contract.call("render", {"model": "tiny-gpt", "gpu": "h100-sxm", "num_gpus": 1, "launcher": "slurm",
                                   "output_dir": str(tmp_path), "run_dir": str(run_dir), "python": sys.executable,
                                   "skill_home": str(ROOT), "training": {"mock_data": True},
                                   "slurm": {"gpus": False, "exclusive": False, "time": "00:05:00"}})["result"]
    submit = subprocess.run(["sbatch", "--parsable", "--hold", f"--chdir={tmp_path}", out["files"][0]["path"]],
                            capture_output=True, text=True, timeout=60, check=True)
    job = submit.stdout.strip().split(";")[0]
    subprocess.run(["strigger", "--set", f"--jobid={job}", "--fini", f"--program={ROOT / 'tools' / 'slurm_job_end.sh'}"],
                   check=True, timeout=60)
    subprocess.run(["scontrol", "release", job], check=True, timeout=60)

    def ends():
        path = run_dir / "events.jsonl"
        found = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        failed = [e for e in found if e["type"] == "job.failed"]
        return (found, failed) if len(failed) == 2 else None

    found, failed = wait_until(ends, 180, "the job's and the trigger's reports")
    assert found[0]["type"] == "job.started" and found[0]["job"]["job_id"] == job
    trap, trigger = sorted(failed, key=lambda e: e["emitter"])
    assert (trap["emitter"], trigger["emitter"]) == ("job", "scheduler")
    assert trap["job"] == {**trap["job"], "job_id": job, "scheduler": "slurm"}
    assert trap["details"]["exit_code"] == trigger["details"]["exit_code"] != 0
    assert "FAILED" in trigger["details"]["message"]
    assert ev.incident(trap) == ev.incident(trigger)


def test_a_monitor_can_send_any_type_and_a_failure_stays_a_failure(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for argv, kind, code in ((["--type", "job.failed"], "job.failed", 1), (["--end", "--exit-code", "0"], "job.finished", 0),
                             (["--end", "--exit-code", "137"], "job.failed", 137)):
        proc = subprocess.run(EMIT + ["send", *argv, "--run-id", "r1", "--run-dir", str(run), "--emitter", "monitor",
                                     "--print"], capture_output=True, text=True, timeout=60, env=os.environ)
        event = json.loads(proc.stdout)["event"]
        assert (event["type"], event["details"]["exit_code"], event["emitter"]) == (kind, code, "monitor")
    assert event["details"]["signal"] == "SIGKILL"
