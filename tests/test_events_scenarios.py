"""The four scenarios of a job's end (a node failure, a kill, a NaN loss, a finished run), each
answered with its intended action and started at most once: by the policy or by the user's
approval, whichever comes first (a dry answer then --apply, --apply first), the same event
delivered twice (one after the other, or to two handlers at once), and one job reported by two
reporters in either order (the job's trap saw SIGKILL, exit -9; Slurm's trigger saw the node fail).

Every call is a real on-event call (the tool's Python API, or launch.py on-event); the run is a
real folder whose launch script, run again, appends a line to a marker file: how many times a
resume really started."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_events import SECRET, _marked_run, _on_event, _starts

from megatron_skill.events import emit as emitter
from megatron_skill.events import event as ev

JOB = "4242"
NODES = ["gpu[03-04]"]
# The policy of each way an action gets its yes: the policy's own (the default allows a resume
# after a node failure; a kill's needs allowing), or none at all and the user's --approve.
POLICY = {("node_failure", "policy"): {}, ("node_failure", "user"): {"allow": {}},
          ("killed", "policy"): {"allow": {"killed": ["resume"]}}, ("killed", "user"): {}}


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(ev.SECRET_ENV, SECRET)
    return SECRET.encode()


def _iteration(i: int, loss: str, of: int = 1000) -> str:
    return (f" [2026-12-05 10:00:00] iteration {i:8d}/ {of:4d} | consumed samples: {i * 8} | elapsed time per "
            f"iteration (ms): 5.0 | learning rate: 1.0E-04 | global batch size: 8 | lm loss: {loss} |")


def _run(tmp_path: Path, losses: list[str] | None = None, of: int = 1000) -> tuple[Path, Path]:
    """A failed run launched from a script (the marker counts its starts), with its log and its
    checkpoints at 5, 10 and 15."""
    run, marker = _marked_run(tmp_path)
    lines = [_iteration(i + 1, x, of) for i, x in enumerate(losses or ["5.0E+00"] * 12)]
    (run / "logs" / "train.log").write_text("\n".join(lines) + "\n")
    for it in (5, 10, 15):
        (run / "checkpoints" / f"iter_{it:07d}").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("15")
    return run, marker


def _signed(run: Path, kind: str, emitter_name: str, details: dict, host: str = "gpu03",
            attempt: int | None = None) -> dict:
    job = {"job_id": JOB, "scheduler": "slurm", "host": host, "nodes": NODES, "attempt": attempt}
    return ev.sign(ev.new(kind, run.name, job, emitter_name, details=details, run_dir=str(run),
                          log=str(run / "logs" / "train.log")), SECRET.encode())


def trap_kill(run: Path) -> dict:
    """The job's trap: its job died of SIGKILL (exit -9), as the emitter reads such an end."""
    return _signed(run, "job.failed", "job", emitter.ending(-9, run / "logs" / "train.log"))


def trap_term(run: Path) -> dict:
    """The job's trap after a person stopped the job (exit 143, SIGTERM)."""
    return _signed(run, "job.failed", "job", emitter.ending(143, run / "logs" / "train.log"))


def trigger(run: Path, state: str) -> dict:
    """Slurm's trigger, on the controller, for the same job (as tools/slurm_job_end.sh sends it)."""
    failure = {"NODE_FAIL": "node_failure", "CANCELLED": "killed"}.get(state)
    code = 0 if state == "COMPLETED" else 1
    return _signed(run, "job.finished" if code == 0 else "job.failed", "scheduler",
                   {"exit_code": code, "message": f"Slurm job {JOB}: {state}", **({"failure": failure} if failure else {})},
                   host="slurmctl")


def nan_report(run: Path) -> dict:
    return _signed(run, "loss.anomaly", "watcher", {"iteration": 13, "loss": "nan", "message": "the loss is not a number"})


def trap_finished(run: Path) -> dict:
    return _signed(run, "job.finished", "job", emitter.ending(0, run / "logs" / "train.log"))


def _call(event: dict, runs: Path, policy: dict, apply: bool = False, approve: bool = False) -> dict:
    fields = {"policy": policy, "apply": apply}
    if approve:
        fields["approve"] = ["resume"]
    out = _on_event(event, runs, **fields)
    assert out["ok"], out
    return out["result"]


def _ledger(run: Path) -> dict:
    return json.loads((run.parent / ".events" / run.name / "ledger.json").read_text())


def _only_resume(result: dict) -> dict:
    (action,) = result["actions"]
    assert action["kind"] == "resume" and action["argv"][0] == "bash", action
    return action


# ---- one report: the policy or the user, a dry answer first or --apply first, the event twice ----------
@pytest.mark.parametrize("cause", ["node_failure", "killed"])
@pytest.mark.parametrize("who", ["policy", "user"])
@pytest.mark.parametrize("order", ["dry_then_apply", "apply_first", "apply_before_the_yes"])
def test_a_relaunch_starts_once_by_policy_or_approval_in_either_order(tmp_path, secret, cause, who, order):
    if order == "apply_before_the_yes" and who == "policy":
        pytest.skip("the policy's yes is there from the start: the same as apply_first")
    run, marker = _run(tmp_path)
    runs = tmp_path / "runs"
    event = trigger(run, "NODE_FAIL") if cause == "node_failure" else trap_kill(run)
    policy = POLICY[(cause, who)]
    yes = who == "user"
    if order == "dry_then_apply":
        told = _call(event, runs, policy)
        action = _only_resume(told)
        assert told["verdict"] == "handled" and told["cause"] == cause and "applied" not in action
        assert action["allowed"] is (who == "policy") and action["needs_person"] is (who == "user")
        if who == "user":
            assert "--approve resume" in action["why"]
        again = _call(event, runs, policy)   # the same event again: the same answer, still to start
        assert again["verdict"] == "pending" and again["actions"] == told["actions"]
        assert _starts(marker, 0) == 0
    elif order == "apply_before_the_yes":
        asked = _call(event, runs, policy, apply=True)   # --apply, but no one said yes yet
        action = _only_resume(asked)
        assert action["needs_person"] and not action["allowed"] and "applied" not in action
        assert _starts(marker, 0) == 0
    started = _call(event, runs, policy, apply=True, approve=yes)
    action = _only_resume(started)
    assert started["verdict"] == "handled" and started["cause"] == cause
    assert action["applied"]["pid"] and action["applied"]["approved"] is yes
    assert _starts(marker, 1) == 1
    # Delivered again, with or without --apply and the yes: the same incident, nothing more starts.
    for repeat in ({"apply": True, "approve": yes}, {"apply": False}, {"apply": True, "approve": True}):
        dup = _call(event, runs, policy, **repeat)
        assert dup["verdict"] == "duplicate" and dup["actions"] == [] and dup["incident"] == started["incident"]
        assert dup["facts"]["applied"]["resume"]["pid"] == action["applied"]["pid"]
    assert _starts(marker, 1) == 1 and len(_ledger(run)["relaunches"]) == 1


@pytest.mark.parametrize("cause,who", [("node_failure", "policy"), ("killed", "user")])
def test_the_same_event_to_two_handlers_at_once_starts_one_resume(tmp_path, secret, cause, who):
    """The Gateway (or two agents) hands the same event to two on-event processes at once."""
    run, marker = _run(tmp_path)
    event = trigger(run, "NODE_FAIL") if cause == "node_failure" else trap_kill(run)
    path = tmp_path / "event.json"
    path.write_text(json.dumps(ev.body(event)))
    cmd = [sys.executable, str(ROOT / "tools" / "launch.py"), "on-event", "--event-file", str(path), "--runs-root",
           str(tmp_path / "runs"), "--apply", "--policy", json.dumps(POLICY[(cause, who)])]
    if who == "user":
        cmd += ["--approve", "resume"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    answers = [json.loads(p.communicate(timeout=180)[0]) for p in procs]
    assert sorted(a["result"]["verdict"] for a in answers) == ["duplicate", "handled"], answers
    assert _starts(marker, 1) == 1 and len(_ledger(run)["relaunches"]) == 1


# ---- two reporters of one job's end: the trap's SIGKILL and Slurm's node failure ---------------------
@pytest.mark.parametrize("first", ["trap", "trigger"])
@pytest.mark.parametrize("who", ["policy", "user"])
@pytest.mark.parametrize("when", ["apply_each", "dry_both_then_apply_the_first", "dry_both_then_apply_the_second"])
def test_a_kill_and_a_node_failure_of_one_job_are_one_incident_resumed_once(tmp_path, secret, first, who, when):
    run, marker = _run(tmp_path)
    runs = tmp_path / "runs"
    reports = {"trap": trap_kill(run), "trigger": trigger(run, "NODE_FAIL")}
    order = [first, "trigger" if first == "trap" else "trap"]
    policy, yes = POLICY[("node_failure", who)], who == "user"
    answers = {}
    for name in order:
        answers[name] = _call(reports[name], runs, policy, apply=when == "apply_each", approve=yes)
    assert answers["trap"]["incident"] == answers["trigger"]["incident"]
    # The trigger's node failure is the incident's cause from its report on: a later trap's SIGKILL
    # does not make it a kill again.
    assert answers["trigger"]["cause"] == answers[order[1]]["cause"] == "node_failure"
    if first == "trap":
        assert answers["trap"]["cause"] == "killed"
    if when == "apply_each":
        pids = [a["actions"][0]["applied"]["pid"] for a in answers.values() if a["verdict"] == "handled"
                and a["actions"][0].get("applied", {}).get("pid")]
        # The first report starts it where the yes covers it (the policy's covers a node failure,
        # the user's any resume); the trap's kill alone waits under the policy.
        starter = "trigger" if (who == "policy" and first == "trap") else first
        assert len(set(pids)) == 1 and answers[starter]["actions"][0]["applied"]["pid"] == pids[0]
        if starter == "trigger" and first == "trap":
            assert answers["trap"]["actions"][0]["needs_person"]
        if starter == first and first == "trap":   # the user's yes for the kill, then the node failure
            assert answers["trigger"]["verdict"] == "handled"
            assert answers["trigger"]["actions"][0]["applied"]["pid"] == pids[0]
        elif starter == first:
            assert answers[order[1]]["verdict"] == "duplicate"
    else:
        assert _starts(marker, 0) == 0
        for a in answers.values():
            assert "applied" not in a["actions"][0]
        late = order[0] if when == "dry_both_then_apply_the_first" else order[1]
        started = _call(reports[late], runs, policy, apply=True, approve=yes)
        assert started["verdict"] == "handled" and started["cause"] == "node_failure"
        assert started["actions"][0]["applied"]["pid"]
        assert started["actions"][0]["argv"] == ["bash", str(run / "launch.sh")]
    assert _starts(marker, 1) == 1
    for name in order:   # either report again, with every yes: nothing more
        dup = _call(reports[name], runs, policy, apply=True, approve=True)
        assert dup["verdict"] == "duplicate" and dup["facts"]["applied"]["resume"]
    assert _starts(marker, 1) == 1 and len(_ledger(run)["relaunches"]) == 1
    record = _ledger(run)["incidents"][answers["trap"]["incident"]]
    assert record["cause"] == "node_failure" and [r["cause"] for r in record["reports"]] == [
        "killed" if n == "trap" else "node_failure" for n in order]


@pytest.mark.parametrize("first", ["trap", "trigger"])
@pytest.mark.parametrize("who", ["policy", "user"])
def test_a_kill_reported_by_the_trap_and_by_slurm_is_resumed_once(tmp_path, secret, first, who):
    run, marker = _run(tmp_path)
    runs = tmp_path / "runs"
    reports = {"trap": trap_kill(run), "trigger": trigger(run, "CANCELLED")}
    order = [first, "trigger" if first == "trap" else "trap"]
    policy, yes = POLICY[("killed", who)], who == "user"
    told = _call(reports[order[0]], runs, policy)   # a dry answer first
    assert told["cause"] == "killed" and _only_resume(told)["needs_person"] is yes
    started = _call(reports[order[1]], runs, policy, apply=True, approve=yes)   # the other report applies it
    assert started["incident"] == told["incident"] and started["cause"] == "killed"
    assert started["verdict"] == "handled" and started["actions"][0]["applied"]["pid"]
    for name in order:
        assert _call(reports[name], runs, policy, apply=True, approve=True)["verdict"] == "duplicate"
    assert _starts(marker, 1) == 1 and len(_ledger(run)["relaunches"]) == 1


# ---- NaN: a rollback, for a person; nothing resumes the job that went NaN ---------------------------------
@pytest.mark.parametrize("log_shows_it", [True, False])
@pytest.mark.parametrize("order", ["nan_report_first", "ends_first"])
def test_a_nan_is_one_rollback_for_a_person_and_its_jobs_end_resumes_nothing(tmp_path, secret, log_shows_it, order):
    """The watcher reports the NaN at iteration 13; a person stops the job (the trap's SIGTERM, then
    Slurm's CANCELLED). Under a policy that resumes kills, and with the user's yes for a resume,
    nothing starts: the NaN and the job's end are each answered with the rollback to checkpoint 10,
    for a person, also where this host's log does not show the NaN, and also where the end's reports
    were answered (dry) before the NaN's report arrived."""
    losses = ["5.0E+00"] * 12 + (["nan"] * 3 if log_shows_it else [])
    run, marker = _run(tmp_path, losses)
    runs = tmp_path / "runs"
    policy = POLICY[("killed", "policy")]
    nan, trap, slurm = nan_report(run), trap_term(run), trigger(run, "CANCELLED")
    if order == "ends_first":   # answered before the NaN's report came: no one has said yes yet
        early = [_call(e, runs, policy) for e in (trap, slurm)]
        assert early[0]["incident"] == early[1]["incident"]
        assert early[1]["verdict"] == ("duplicate" if log_shows_it else "pending")   # a resume still to start
        assert early[0]["cause"] == ("nan" if log_shows_it else "killed")
    sequence = [nan, trap, slurm] if order == "nan_report_first" else [nan]
    answers = [_call(e, runs, policy, apply=True, approve=True) for e in sequence]
    for a in answers:
        if a["verdict"] == "duplicate":
            assert a["facts"]["incident_actions"] == ["rollback"] and a["facts"]["applied"] == {}
            continue
        (action,) = a["actions"]
        assert a["cause"] == "nan" and action["kind"] == "rollback" and action["needs_person"], a
        assert not action.get("applied") and f"echo 10 > {run / 'checkpoints'}" in " ".join(action["commands"])
    assert answers[0]["verdict"] == "handled"
    if order == "nan_report_first":
        assert answers[1]["incident"] == answers[2]["incident"] != answers[0]["incident"]
        assert [a["verdict"] for a in answers[1:]] == ["handled", "duplicate"]
    for e in (nan, trap, slurm):   # each again, with every yes: the rollback, and nothing starts
        again = _call(e, runs, policy, apply=True, approve=True)
        assert again["verdict"] == "duplicate" and again["facts"]["incident_actions"] == ["rollback"], again
    assert _starts(marker, 0) == 0 and _ledger(run)["relaunches"] == []
    end = _ledger(run)["incidents"][f"{run.name}/{JOB}/end"]
    assert end["cause"] == "nan" and [a["kind"] for a in end["actions"]] == ["rollback"]
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "15"


# ---- finished: a summary, nothing started ----------------------------------------------------------
@pytest.mark.parametrize("first", ["trap", "trigger"])
def test_a_finished_job_reported_twice_is_one_summary_and_starts_nothing(tmp_path, secret, first):
    run, marker = _run(tmp_path, ["5.0E+00"] * 20, of=20)
    runs = tmp_path / "runs"
    reports = {"trap": trap_finished(run), "trigger": trigger(run, "COMPLETED")}
    order = [first, "trigger" if first == "trap" else "trap"]
    policy = {"allow": {"killed": ["resume"], "node_failure": ["resume"]}}
    told = _call(reports[order[0]], runs, policy)
    (summary,) = told["actions"]
    assert told["verdict"] == "handled" and told["cause"] == "finished" and summary["kind"] == "summary"
    assert not summary["needs_person"] and summary["numbers"]["iterations"] == 20
    for name in (order[0], order[1], order[0]):
        again = _call(reports[name], runs, policy, apply=True, approve=True)
        assert again["verdict"] == "duplicate" and again["incident"] == told["incident"]
        assert again["facts"]["incident_actions"] == ["summary"] and again["facts"]["applied"] == {}
    assert _starts(marker, 0) == 0 and _ledger(run)["relaunches"] == []


def _saved(run: Path, iteration: int) -> None:
    """The run's last checkpoint is now at this iteration (its folder and Megatron's tracker)."""
    (run / "checkpoints" / f"iter_{iteration:07d}").mkdir(exist_ok=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(iteration))


@pytest.mark.parametrize("first", ["kill", "finished"])
def test_a_kill_after_the_last_iteration_is_a_finished_run_not_a_resume(tmp_path, secret, first):
    """torchrun was killed (SIGKILL, exit -9) once its worker had run every iteration and saved the
    last one (the issue's 60 of 60): its report and the trap's exit 0 are one finished run, whose
    summary starts nothing; a resume would train 0 iterations and spend a relaunch."""
    run, marker = _run(tmp_path, ["5.0E+00"] * 20, of=20)
    _saved(run, 20)
    with open(run / "logs" / "train.log", "a") as f:
        f.write("torch.distributed.elastic.multiprocessing.api: failed (exitcode: -9) Signals.SIGKILL\n")
    runs = tmp_path / "runs"
    kill = trap_kill(run)
    reports = [kill, trap_finished(run)] if first == "kill" else [trap_finished(run), kill]
    policy = {"allow": {"killed": ["resume"]}}
    answers = [_call(e, runs, policy, apply=True, approve=True) for e in reports]
    assert answers[0]["cause"] == "finished" and answers[0]["actions"][0]["kind"] == "summary"
    assert answers[1]["verdict"] == "duplicate" and answers[1]["facts"]["incident_actions"] == ["summary"]
    assert _starts(marker, 0) == 0 and _ledger(run)["relaunches"] == []
    assert answers[0]["facts"]["left_to_train"] == 0
    if first == "kill":
        assert "its last checkpoint (20) is at train_iters" in answers[0]["actions"][0]["why"]


@pytest.mark.parametrize("cli_call", [False, True])
def test_a_kill_after_the_last_iteration_but_before_the_final_save_is_resumed(tmp_path, secret, cli_call):
    """Every iteration is in the log (20 of 20) but the last checkpoint is 10: the kill came before
    the final save, and a resume from checkpoint 10 still has 10 iterations to train. The user's
    yes starts it (by the tool's API, or by launch.py on-event as the agent calls it)."""
    run, marker = _run(tmp_path, ["5.0E+00"] * 20, of=20)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("10")
    runs = tmp_path / "runs"
    kill = trap_kill(run)
    if cli_call:
        path = tmp_path / "event.json"
        path.write_text(json.dumps(ev.body(kill)))
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), "on-event", "--event-file", str(path),
                               "--runs-root", str(runs), "--apply", "--approve", "resume"], capture_output=True,
                              text=True, timeout=180)
        out = json.loads(proc.stdout)
        assert proc.returncode == 0 and out["ok"], out
        result = out["result"]
    else:
        result = _call(kill, runs, {}, apply=True, approve=True)
    assert result["cause"] == "killed" and result["facts"]["checkpoint_iteration"] == 10
    assert result["facts"]["left_to_train"] == 10 and result["facts"]["last_iteration"] == 20
    action = _only_resume(result)
    assert action["applied"]["pid"] and action["applied"]["approved"]
    assert _starts(marker, 1) == 1 and len(_ledger(run)["relaunches"]) == 1


@pytest.mark.parametrize("first", ["trap", "trigger"])
def test_a_node_failure_report_of_a_trained_out_run_resumes_nothing(tmp_path, secret, first):
    """The trap saw exit 0 (20 of 20, checkpoint 20 saved); Slurm's trigger then (or first) reports
    NODE_FAIL for the same job: a node failure says more about why a job ended than a finish, but
    nothing is left to train: one finished incident, under the default policy (which resumes a
    node failure by itself) and with the user's yes, nothing starts."""
    run, marker = _run(tmp_path, ["5.0E+00"] * 20, of=20)
    _saved(run, 20)
    runs = tmp_path / "runs"
    reports = {"trap": trap_finished(run), "trigger": trigger(run, "NODE_FAIL")}
    order = [first, "trigger" if first == "trap" else "trap"]
    answers = [_call(reports[name], runs, {}, apply=True) for name in order]
    assert [a["cause"] for a in answers] == ["finished", "finished"] and answers[0]["verdict"] == "handled"
    assert answers[0]["actions"][0]["kind"] == "summary" and answers[1]["verdict"] == "duplicate"
    for name in order:
        again = _call(reports[name], runs, {}, apply=True, approve=True)
        assert again["verdict"] == "duplicate" and again["facts"]["incident_actions"] == ["summary"]
    assert _starts(marker, 0) == 0 and _ledger(run)["relaunches"] == []


def test_an_nccl_timeout_after_the_final_save_is_a_finished_run(tmp_path, secret):
    """A collective timed out in the job's shutdown (the watchdog's line after iteration 20 of 20,
    checkpoint 20 saved; the trap saw exit 1): a finished run, its summary, nothing resumed, under
    a policy that resumes NCCL timeouts by itself."""
    run, marker = _run(tmp_path, ["5.0E+00"] * 20, of=20)
    _saved(run, 20)
    with open(run / "logs" / "train.log", "a") as f:
        f.write("[rank3]: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran "
                "for 600000 milliseconds before timing out.\n")
    policy = {"allow": {"nccl_timeout": ["resume"]}}
    failed = _signed(run, "job.failed", "job", emitter.ending(1, run / "logs" / "train.log"))
    result = _call(failed, tmp_path / "runs", policy, apply=True)
    assert result["cause"] == "finished" and [a["kind"] for a in result["actions"]] == ["summary"], result
    assert _starts(marker, 0) == 0 and _ledger(run)["relaunches"] == []
    # The same log with the last checkpoint at 15: 5 iterations to train, and the policy resumes it.
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("15")
    again = _signed(run, "job.failed", "job", emitter.ending(1, run / "logs" / "train.log"))
    again["job"]["job_id"] = "4243"
    again = ev.sign({k: v for k, v in again.items() if k != "signature"}, SECRET.encode())
    result = _call(again, tmp_path / "runs", policy, apply=True)
    assert result["cause"] == "nccl_timeout" and _only_resume(result)["applied"]["pid"]
    assert _starts(marker, 1) == 1


# ---- the user's yes comes late ------------------------------------------------------------------
def test_a_yes_given_after_the_event_went_stale_still_starts_its_decided_resume(tmp_path, secret):
    """The kill is answered (no --apply) while the event is fresh, just under the policy's hour;
    the user's yes comes once the event is past the hour. The run's record took the event when it
    was fresh: the same event with --apply --approve resume starts the decided resume (exit 0, not
    10). An event the record never took is still refused when that old."""
    run, marker = _run(tmp_path)
    runs = tmp_path / "runs"
    started_at = time.time() - 3590
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started_at)) + f".{int(started_at % 1 * 1e6):06d}Z"
    kill = ev.sign({**trap_kill(run), "time": stamp}, SECRET.encode())
    told = _call(kill, runs, {})
    assert told["verdict"] == "handled" and _only_resume(told)["needs_person"]
    while time.time() - started_at < 3602:   # the event is now past the policy's hour
        time.sleep(0.5)
    path = tmp_path / "event.json"
    path.write_text(json.dumps(ev.body(kill)))
    cli = [sys.executable, str(ROOT / "tools" / "launch.py"), "on-event", "--event-file", str(path), "--runs-root",
           str(runs)]
    # That late, a policy that resumes kills starts nothing by itself: the run may have changed since.
    proc = subprocess.run(cli + ["--apply", "--policy", json.dumps(POLICY[("killed", "policy")])], capture_output=True,
                          text=True, timeout=180)
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["result"]["verdict"] == "pending", out
    assert _only_resume(out["result"])["needs_person"] and "minutes old" in out["result"]["actions"][0]["why"]
    assert _starts(marker, 0) == 0
    proc = subprocess.run(cli + ["--apply", "--approve", "resume"], capture_output=True, text=True, timeout=180)
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["ok"], out
    assert out["result"]["verdict"] == "handled" and out["result"]["actions"][0]["applied"]["pid"]
    assert _starts(marker, 1) == 1
    # Another report of the same job, as old, that the record never took: a replay, refused.
    other = ev.sign({**trap_term(run), "time": stamp}, SECRET.encode())
    path.write_text(json.dumps(ev.body(other)))
    proc = subprocess.run(cli + ["--apply", "--approve", "resume"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 10 and json.loads(proc.stdout)["error"]["where"] == "/event_file/time"
    assert _starts(marker, 1) == 1 and len(_ledger(run)["relaunches"]) == 1


# ---- a job Slurm requeued: each attempt's end is an incident of its own, and a requeue is Slurm's resume ----
def _attempt(event: dict, attempt: int) -> dict:
    """The same report from the job's attempt-th restart (SLURM_RESTART_COUNT in the job)."""
    body = {k: v for k, v in event.items() if k != "signature"}
    return ev.sign(ev.new(body["type"], body["run_id"], {**body["job"], "attempt": attempt}, body["emitter"],
                          details=body.get("details"), run_dir=body.get("run_dir"), log=body.get("log")),
                   SECRET.encode())


def test_each_attempt_of_a_requeued_job_ends_in_an_incident_of_its_own(tmp_path, secret):
    """Job 4242's first attempt is killed and the user's yes resumes it; its second attempt (a
    restart: SLURM_RESTART_COUNT 1) is killed too: a new incident, whose resume the user's yes
    starts, not a duplicate of the first. Slurm's trigger, which knows no attempt, reports the
    second attempt's node failure: it joins the second attempt's incident (the last the record
    knows), not the first one's."""
    run, marker = _run(tmp_path)
    runs = tmp_path / "runs"
    first = _call(trap_kill(run), runs, {}, apply=True, approve=True)
    assert first["incident"] == f"{run.name}/{JOB}/end" and _only_resume(first)["applied"]["pid"]
    assert _starts(marker, 1) == 1
    second = _call(_attempt(trap_kill(run), 1), runs, {"allow": {}}, apply=True)
    assert second["verdict"] == "handled" and second["incident"] == f"{run.name}/{JOB}~1/end"
    assert second["cause"] == "killed" and _only_resume(second)["needs_person"]
    node = _call(trigger(run, "NODE_FAIL"), runs, {})   # no attempt: the last one's
    assert node["incident"] == second["incident"] and node["cause"] == "node_failure"
    # The policy would start it, but not 300 s after the last relaunch (its back-off): the user's yes.
    assert node["verdict"] == "handled" and "back-off" in _only_resume(node)["why"]
    node = _call(trigger(run, "NODE_FAIL"), runs, {}, apply=True, approve=True)
    assert node["incident"] == second["incident"] and _only_resume(node)["applied"]["approved"]
    assert _starts(marker, 2) == 2 and len(_ledger(run)["relaunches"]) == 2
    for event in (trap_kill(run), _attempt(trap_kill(run), 1)):
        assert _call(event, runs, {}, apply=True, approve=True)["verdict"] == "duplicate"
    assert _starts(marker, 2) == 2


@pytest.mark.parametrize("order", ["end_first", "requeue_first"])
def test_a_job_slurm_requeued_is_not_resumed_beside_its_requeued_attempt(tmp_path, secret, order):
    """Slurm's trigger reports the node failure of job 4242 and Slurm requeues the job (the
    cluster's JobRequeue, a script without --no-requeue): its attempt 1 starts (job.started,
    SLURM_RESTART_COUNT 1). The requeued job resumes from the last checkpoint itself: the first
    attempt's resume is not started, with the default policy's yes or the user's, in either order
    of the reports; the second attempt's end is its own incident."""
    run, marker = _run(tmp_path)
    runs = tmp_path / "runs"
    started = _attempt(_signed(run, "job.started", "job", {}), 1)
    if order == "end_first":
        told = _call(trigger(run, "NODE_FAIL"), runs, {})   # answered, not applied yet
        assert _only_resume(told)["allowed"]
        requeue = _call(started, runs, {})
        assert requeue["verdict"] == "handled" and [a["kind"] for a in requeue["actions"]] == ["record"]
        assert "Slurm requeued job 4242" in requeue["actions"][0]["why"]
    else:
        assert _call(started, runs, {})["verdict"] == "noted"
    end = _call(_attempt(trap_kill(run), 0), runs, {}, apply=True, approve=True)
    assert end["incident"] == f"{run.name}/{JOB}/end"
    assert [a["kind"] for a in end["actions"]] in ([], ["record"]) and _starts(marker, 0) == 0, end
    again = _call(_attempt(trigger(run, "NODE_FAIL"), 0), runs, {}, apply=True, approve=True)   # --attempt 0
    assert not any(a.get("applied") for a in again["actions"]) and _starts(marker, 0) == 0
    assert _ledger(run)["relaunches"] == []
    later = _call(_attempt(trap_kill(run), 1), runs, {}, apply=True, approve=True)
    assert later["incident"] == f"{run.name}/{JOB}~1/end" and _only_resume(later)["applied"]["pid"]
    assert _starts(marker, 1) == 1


def test_a_requeue_after_the_skill_already_resumed_asks_a_person_to_stop_one(tmp_path, secret):
    run, marker = _run(tmp_path)
    runs = tmp_path / "runs"
    assert _only_resume(_call(trigger(run, "NODE_FAIL"), runs, {}, apply=True))["applied"]["pid"]
    requeue = _call(_attempt(_signed(run, "job.started", "job", {}), 1), runs, {})
    (action,) = requeue["actions"]
    assert action["kind"] == "diagnose" and action["needs_person"] and action["commands"] == [f"scancel {JOB}"]
    assert "two copies of the run" in action["why"] and _starts(marker, 1) == 1
