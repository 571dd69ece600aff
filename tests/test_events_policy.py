"""on-event's policy by cause and action, what it reads from files others could have put there
(a damaged record, numbers out of range, FIFOs), and noise that must not ask a person."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_events import SECRET, _cpu_run, _event, _iteration, _marked_run, _on_event, _run_dir, _starts

from megatron_skill import contract
from megatron_skill.events import event as ev

LAUNCH = [sys.executable, str(ROOT / "tools" / "launch.py")]


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(ev.SECRET_ENV, SECRET)
    return SECRET.encode()


# ---- the policy, by cause and by action --------------------------------------------------------
def test_resume_only_after_a_node_failure_is_a_policy(tmp_path, secret):
    run, marker = _marked_run(tmp_path)
    only_nodes = {"allow": {"node_failure": ["resume"]}}
    nccl = ev.sign(_event("job.failed", exit_code=1, failure="nccl_timeout"), secret)
    out = _on_event(nccl, tmp_path / "runs", apply=True, policy=only_nodes)["result"]
    (action,) = out["actions"]
    assert out["cause"] == "nccl_timeout" and action["needs_person"] and not action["allowed"]
    assert action["commands"] and "does not start a resume after nccl_timeout" in action["why"]
    node = ev.sign(_event("job.failed", job_id="4243", exit_code=1, failure="node_failure"), secret)
    out = _on_event(node, tmp_path / "runs", apply=True, policy=only_nodes)["result"]
    assert out["actions"][0]["allowed"] and out["actions"][0]["applied"]["pid"]
    assert _starts(marker, 1) == 1


def test_the_default_policy_resumes_a_node_failure_but_not_a_plain_kill(tmp_path, secret):
    _run_dir(tmp_path)
    (tmp_path / "runs" / "r0123456789abcdef" / "launch.sh").write_text("#!/bin/bash\n")
    kill = _on_event(ev.sign(_event("job.failed", exit_code=137, signal="SIGKILL"), secret), tmp_path / "runs",
                     dry_run=True, apply=True)["result"]
    assert kill["cause"] == "killed" and kill["actions"][0]["needs_person"] and "applied" not in kill["actions"][0]
    node = _on_event(ev.sign(_event("job.failed", failure="node_failure"), secret), tmp_path / "runs", dry_run=True,
                     apply=True)["result"]
    assert node["actions"][0]["allowed"] and node["actions"][0]["applied"]["dry_run"]


def test_a_policy_allowing_an_action_its_cause_never_gets_is_refused(tmp_path, secret):
    _run_dir(tmp_path)
    event = ev.sign(_event("training.stalled", iteration=3, silent_s=900), secret)
    out = _on_event(event, tmp_path / "runs", policy={"allow": {"stalled": ["resume"]}})
    assert out["error"]["code"] == "bad_request" and out["error"]["where"] == "/policy/allow/stalled/0"
    out = _on_event(event, tmp_path / "runs", policy={"allow": {"out_of_memory": ["resume"]}})
    assert out["error"]["where"] == "/policy/allow/out_of_memory/0" and "relayout" in out["error"]["fix"]
    out = _on_event(event, tmp_path / "runs", policy={"allow": {"sunspots": ["resume"]}})
    assert out["error"]["code"] == "bad_request"


# ---- hostile files ---------------------------------------------------------------------------------
def _ledger(tmp_path: Path, run: Path) -> Path:
    path = tmp_path / "runs" / ".events" / run.name / "ledger.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_a_damaged_event_record_is_a_clear_error(tmp_path, secret, cli):
    run = _run_dir(tmp_path)
    event_file = tmp_path / "event.json"
    event_file.write_text(json.dumps(ev.sign(_event("job.failed", failure="node_failure"), secret)))
    ledger = _ledger(tmp_path, run)
    for text in ("[]", '{"events": []}', '{"incidents": {"x": {"event_id": 1, "actions": [], "applied": {}}}}',
                 '{"relaunches": ["soon"]}', '{"relaunches": [1e400]}', '{"events": {"e": NaN}}', "{"):
        ledger.write_text(text)
        code, out, err = cli("on-event", "--event-file", str(event_file), "--runs-root", str(tmp_path / "runs"),
                             env={ev.SECRET_ENV: "a-shared-secret-for-tests"})
        assert code == 8 and out["error"]["code"] == "runtime", (text, out)
        assert "damaged" in out["error"]["message"] and out["error"]["fix"] and "Traceback" not in err


def test_numbers_out_of_range_and_lone_surrogates_in_an_event_file_are_bad_requests(tmp_path, secret, cli):
    _run_dir(tmp_path)
    signed = ev.sign(_event("loss.anomaly", iteration=3, loss=2.5), secret)
    text = json.dumps(ev.body(signed))
    huge = tmp_path / "huge.json"
    huge.write_text(text.replace('"loss": 2.5', '"loss": 1e400'))
    lone = tmp_path / "lone.json"
    lone.write_text(text.replace('"loss": 2.5', '"loss": 2.5, "message": "bad \\ud800 text"'))
    for path, where in ((huge, "/event_file:/details/loss"), (lone, "/event_file:/details/message")):
        code, out, err = cli("on-event", "--event-file", str(path), "--runs-root", str(tmp_path / "runs"))
        assert code == 2 and out["error"]["code"] == "bad_request" and out["error"]["where"] == where, out
        assert "Traceback" not in err


def test_a_fifo_given_as_the_event_or_the_secret_file_is_refused_at_once(tmp_path, secret):
    run = _run_dir(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    event_file = tmp_path / "event.json"
    event_file.write_text(json.dumps(ev.sign(_event("job.failed"), secret)))
    env = {k: v for k, v in os.environ.items() if k != ev.SECRET_ENV}
    for argv, extra, code, where in ((["--event-file", str(fifo)], {}, 2, "/event_file"),
                                     (["--event-file", str(event_file)], {ev.SECRET_FILE_ENV: str(fifo)}, 5,
                                      ev.SECRET_FILE_ENV)):
        t0 = time.monotonic()
        proc = subprocess.run(LAUNCH + ["on-event", *argv, "--runs-root", str(tmp_path / "runs")],
                              env={**env, **extra}, capture_output=True, text=True, timeout=120)
        out = json.loads(proc.stdout)
        assert proc.returncode == code and out["error"]["where"] == where, out
        assert "not a regular file" in out["error"]["message"] and time.monotonic() - t0 < 60
    assert not (tmp_path / "runs" / ".events" / run.name / "ledger.json").exists()


# ---- noise ------------------------------------------------------------------------------------------
def test_a_throughput_drop_after_the_job_finished_asks_no_one(tmp_path, secret):
    run = _cpu_run(tmp_path, ["5.0E+00"] * 12)
    job = f"{run.name}.0"
    finished = ev.sign(_event("job.finished", run_id=run.name, job_id=job, exit_code=0), secret)
    assert _on_event(finished, tmp_path / "runs")["result"]["actions"][0]["kind"] == "summary"
    drop = ev.sign(_event("throughput.drop", run_id=run.name, job_id=job, iteration=12, iter_ms=90.0, before=5.0),
                   secret)
    out = _on_event(drop, tmp_path / "runs")["result"]
    assert out["verdict"] == "noted" and not any(a["needs_person"] for a in out["actions"])
    assert "after the job had ended" in out["actions"][0]["why"]
    # While the job runs, the same drop is a diagnosis for a person.
    live = ev.sign(_event("throughput.drop", run_id=run.name, job_id=f"{run.name}.1", iteration=12, iter_ms=90.0,
                          before=5.0), secret)
    (action,) = _on_event(live, tmp_path / "runs")["result"]["actions"]
    assert action["kind"] == "diagnose" and action["needs_person"]


def test_a_signed_nan_event_says_whether_the_log_shows_it(tmp_path, secret):
    run = _cpu_run(tmp_path, ["5.0E+00"] * 12)   # the log shows no NaN
    claim = ev.sign(_event("loss.anomaly", run_id=run.name, iteration=11, loss="nan"), secret)
    (action,) = _on_event(claim, tmp_path / "runs")["result"]["actions"]
    assert action["kind"] == "rollback" and action["needs_person"]
    assert action["evidence"]["source"] == "event only" and "rests on the event alone" in action["why"]
    with open(run / "logs" / "train.log", "a") as f:
        f.write(_iteration(13, "nan") + "\n")
    seen = ev.sign(_event("loss.anomaly", run_id=run.name, job_id="4243", iteration=13, loss="nan"), secret)
    (action,) = _on_event(seen, tmp_path / "runs")["result"]["actions"]
    assert action["evidence"]["source"] == "log" and "event alone" not in action["why"]
    assert contract.call("on-event", {"event": seen, "runs_root": str(tmp_path / "runs")})["ok"]


def test_a_cpu_runs_diagnosis_points_at_its_own_ranks_and_no_gpu_tool(tmp_path, secret):
    run = _cpu_run(tmp_path, ["5.0E+00"] * 12)
    state = json.loads((run / "state.json").read_text())
    (run / "state.json").write_text(json.dumps({**state, "backend": "cpu"}))
    stall = ev.sign(_event("training.stalled", run_id=run.name, job_id=f"{run.name}.0", iteration=12,
                           silent_s=900), secret)
    (action,) = _on_event(stall, tmp_path / "runs")["result"]["actions"]
    text = "\n".join(action["commands"])
    assert action["kind"] == "diagnose" and "pretrain_gpt.py" not in text and "nvidia-smi" not in text
    assert f"py-spy dump --pid $(pgrep -n -f 'cpu_loop.py {run / 'cpu_run.json'}')" in text
    # A GPU run's diagnosis keeps them.
    (run / "state.json").write_text(json.dumps({**state, "backend": "gpu"}))
    gpu = ev.sign(_event("training.stalled", run_id=run.name, job_id=f"{run.name}.1", iteration=12,
                         silent_s=900), secret)
    text = "\n".join(_on_event(gpu, tmp_path / "runs")["result"]["actions"][0]["commands"])
    assert "pretrain_gpt.py" in text and "nvidia-smi" in text


# ---- the user's policy, recorded in the runs root ----------------------------------------------
def _launch(*argv: str) -> tuple[int, dict]:
    proc = subprocess.run(LAUNCH + ["on-event", *argv], capture_output=True, text=True, timeout=180)
    return proc.returncode, json.loads(proc.stdout)


def test_the_users_policy_is_recorded_and_judges_every_later_call_that_gives_none(tmp_path, secret):
    """The user says "resume a plain kill by itself, never a node failure": the agent records it
    once (--save-policy, no event needed). An agent woken later in a new session runs on-event
    without --policy: the kill of job 4242 resumes by itself, the node failure of job 4243 waits
    for a person, each answer naming the recorded policy; a call that gives a policy is judged
    under that one, and leaves the record as it is."""
    run, marker = _marked_run(tmp_path)
    runs = tmp_path / "runs"
    chosen = {"allow": {"killed": ["resume"]}, "backoff_s": 0}
    code, out = _launch("--runs-root", str(runs), "--policy", json.dumps(chosen), "--save-policy")
    assert code == 0 and out["result"]["policy"]["saved"] and out["result"]["policy"]["allow"] == chosen["allow"]
    stored = runs / ".events" / "policy.json"
    assert json.loads(stored.read_text())["allow"] == chosen["allow"]
    path = tmp_path / "event.json"
    path.write_text(json.dumps(ev.sign(_event("job.failed", exit_code=137, signal="SIGKILL"), secret)))
    code, out = _launch("--event-file", str(path), "--runs-root", str(runs), "--apply")
    assert code == 0 and out["result"]["cause"] == "killed", out
    assert out["result"]["policy"]["source"] == "stored" and out["result"]["policy"]["file"] == str(stored)
    assert out["result"]["actions"][0]["applied"]["pid"] and _starts(marker, 1) == 1
    path.write_text(json.dumps(ev.sign(_event("job.failed", job_id="4243", failure="node_failure"), secret)))
    code, out = _launch("--event-file", str(path), "--runs-root", str(runs), "--apply")
    (action,) = out["result"]["actions"]
    assert out["result"]["cause"] == "node_failure" and action["needs_person"] and "applied" not in action
    assert "does not start a resume after node_failure" in action["why"] and _starts(marker, 1) == 1
    # Given with the call, a policy judges that call only.
    code, out = _launch("--event-file", str(path), "--runs-root", str(runs), "--apply", "--policy",
                        json.dumps({"allow": {"node_failure": ["resume"]}, "backoff_s": 0}))
    assert out["result"]["policy"]["source"] == "request" and out["result"]["actions"][0]["applied"]["pid"]
    assert _starts(marker, 2) == 2 and json.loads(stored.read_text())["allow"] == chosen["allow"]


def test_a_recorded_policy_that_is_not_one_is_a_clear_error_and_nothing_starts(tmp_path, secret):
    run, marker = _marked_run(tmp_path)
    runs = tmp_path / "runs"
    (runs / ".events").mkdir()
    stored = runs / ".events" / "policy.json"
    path = tmp_path / "event.json"
    path.write_text(json.dumps(ev.sign(_event("job.failed", failure="node_failure"), secret)))
    elsewhere = tmp_path / "permissive.json"
    elsewhere.write_text(json.dumps({"allow": {"killed": ["resume"]}}))
    for bad in ("{", "[]", '{"allow": {"stalled": ["resume"]}}', '{"max_relaunches": -1}', '{"sunspots": 1}', "link"):
        if stored.is_symlink() or stored.exists():
            stored.unlink()
        if bad == "link":
            stored.symlink_to(elsewhere)
        else:
            stored.write_text(bad)
        code, out = _launch("--event-file", str(path), "--runs-root", str(runs), "--apply")
        assert code == 8 and out["error"]["code"] == "runtime" and out["error"]["where"] == str(stored), (bad, out)
        assert "--save-policy" in out["error"]["fix"]
    assert _starts(marker, 0) == 0
    # Recording asks for a policy, and a runs root that is there.
    code, out = _launch("--runs-root", str(runs), "--save-policy")
    assert code == 2
    code, out = _launch("--event-file", str(path), "--runs-root", str(runs), "--save-policy")
    assert code == 2 and out["error"]["where"] == "/policy"
    code, out = _launch("--runs-root", str(tmp_path / "nowhere"), "--policy", "{}", "--save-policy")
    assert code == 3 and out["error"]["where"] == "/runs_root"
    assert elsewhere.read_text() == json.dumps({"allow": {"killed": ["resume"]}})
