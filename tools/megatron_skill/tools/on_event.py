"""The on-event tool: one training event in, the intended actions out (references/events.md).

In order, before anything is done: the event's form (schemas/event.json, size), its signature
(the shared secret), its age (stale replays are refused), and its run (a run directory under
runs_root). Then, under the run's event record: the event joins its incident (one job's end,
whoever reports it; one stall, ...); the incident's cause is the most specific any report gave,
and its actions are decided when it opens and again when a later report names a more specific
cause (events/actions.py). Seen is not acted: the decided actions stay in the record, and with
apply those the policy allows (or the user approved) start, each at most once per incident,
whichever report or repeat of the event brings the apply.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

from .. import files
from ..contract import Context, Tool, check_values, parse_json, validator
from ..errors import ToolError
from ..events import actions, settle
from ..events import event as ev
from ..events.ledger import RELAUNCHING, Ledger, own_folder
from ..locks import write_atomic
from ..runs import RunLock

MAX_FILE_BYTES = 64 * 1024
CLOCK_SKEW_S = 300  # an event may come from a host whose clock runs this far ahead


def _read_event_file(path: Path) -> str:
    """The event file's text: a regular file of at most MAX_FILE_BYTES (a FIFO or a device is
    refused without waiting on it), UTF-8 with anything else replaced."""
    return files.read_bytes(path, "/event_file", "event file", MAX_FILE_BYTES).decode("utf-8", errors="replace")


def _load(req: dict) -> tuple[dict[str, Any], str]:
    if "event" in req:
        return req["event"], "/event"
    path = Path(req["event_file"])
    document = ev.unwrap(parse_json(_read_event_file(path), "/event_file", f"the event in {path}"))
    try:
        check_values(document)  # numbers out of range (1e400), lone surrogates, deep nesting
    except ToolError as e:
        raise ToolError("bad_request", f"the event in {path}: {e.message}", where=f"/event_file:{e.where}",
                        fix=e.fix) from None
    errors = sorted(validator({"$ref": "event.json"}).iter_errors(document), key=lambda e: e.path)
    if errors:
        err = errors[0]
        where = "/event_file:/" + "/".join(str(p) for p in err.absolute_path)
        raise ToolError("bad_request", f"not a training event: {err.message}", where=where,
                        fix="see schemas/event.json (emit_event.py makes such events)")
    return document, "/event_file"


def _secret() -> bytes:
    try:
        secret = ev.load_secret()
    except ev.SecretFileError as e:
        raise ToolError("environment", f"the shared secret cannot be read: {e}", where=ev.SECRET_FILE_ENV,
                        fix=f"point {ev.SECRET_FILE_ENV} at a regular file whose first line is the secret, or set "
                            f"{ev.SECRET_ENV}") from None
    if not secret:
        raise ToolError("environment", "no shared secret to check the event's signature with",
                        where=ev.SECRET_ENV, fix=f"set {ev.SECRET_ENV} (or {ev.SECRET_FILE_ENV}) to the secret "
                        "the emitters sign with, where this tool runs")
    return secret


def _trusted(event: dict[str, Any], where: str) -> None:
    """The event's size and signature."""
    if len(ev.canonical(event)) > ev.MAX_BYTES:
        raise ToolError("bad_request", f"the event is larger than {ev.MAX_BYTES // 1024} KiB", where=where,
                        fix="shorten details.log_tail")
    secret = _secret()
    if "signature" not in event:
        raise ToolError("refused", "the event is not signed", where=where + "/signature",
                        fix=f"set {ev.SECRET_ENV} where the job runs, so that its emitters sign what they send")
    if not ev.verified(event, secret):
        raise ToolError("refused", "the event's signature does not match: it was changed or signed with another "
                        "secret", where=where + "/signature", fix="nothing is done for it; if it is genuine, give "
                        "the emitters and this tool the same secret")


def _fresh(event: dict[str, Any], where: str, max_age_s: float, ledger: Ledger) -> float | None:
    """The event's age: an event older than max_age_s is refused as a replay, unless the run's
    record took it when it was fresh (then it is the same event again: the user's yes to its
    decided action, given later, still applies it). The age of such a late event, else None."""
    age = time.time() - ev.parse_time(event["time"])
    known = ledger.seen(event["event_id"])
    if known and known.get("time") == event["time"] and known.get("type") == event["type"]:
        return age if age > max_age_s else None
    if age > max_age_s:
        raise ToolError("refused", f"the event is {age / 60:.0f} minutes old, older than the policy's "
                        f"{max_age_s / 60:.0f} (a replay, or a receiver that held it)", where=where + "/time",
                        fix="raise policy.max_age_s to handle it anyway; 'launch.py logs' reads the run as it is now")
    if age < -CLOCK_SKEW_S:
        raise ToolError("refused", f"the event is dated {-age / 60:.0f} minutes in the future", where=where + "/time",
                        fix="check the emitting host's clock (NTP)")
    return None


def _is_run(folder: Path) -> bool:
    return files.is_dir(folder) and any(os.path.lexists(folder / f) for f in ("state.json", "events.jsonl",
                                                                              *actions.SCRIPTS))


def _run_dir(runs_root: Path, event: dict[str, Any], where: str) -> Path:
    """runs_root/RUN_ID, or the event's run_dir where render put the run elsewhere under runs_root;
    either way a folder that is below runs_root itself, not a link to elsewhere (what on-event
    writes in the run, the record of a dead attempt, stays below the runs_root it was given)."""
    run_dir = runs_root / event["run_id"]
    if not _is_run(run_dir) and event.get("run_dir"):
        given = Path(os.path.realpath(event["run_dir"]))
        if given.is_relative_to(runs_root) and _is_run(given):
            run_dir = given
    if not _is_run(run_dir):
        raise ToolError("not_found", f"no run {event['run_id']} under {runs_root}", where=where + "/run_id",
                        fix="give the runs_root the job's run directory is in (train's runs_root, or the folder "
                            "above render's run_dir)")
    real = Path(os.path.realpath(run_dir))
    if not real.is_relative_to(runs_root) or real == runs_root:
        raise ToolError("not_found", f"the run {event['run_id']} is not under {runs_root}: {run_dir} is a link to "
                        f"{real}", where=where + "/run_id", fix=f"give the runs_root the run's folder itself is in "
                        f"({real.parent})")
    return real




# ---- what the event is about -----------------------------------------------------------------
def _running(run: actions.Run, ledger: Ledger, event: dict[str, Any]) -> bool:
    lock = run.dir / "run.lock"
    held = lock.is_file() and RunLock(run.dir).held_elsewhere()  # (a FIFO put there would block the probe)
    return held or (event["type"] not in ("job.finished", "job.failed") and ledger.job_running(ev.job_of(event)))


def _ended(run: actions.Run, ledger: Ledger, event: dict[str, Any], found: dict[str, Any]) -> bool:
    return (ledger.job_ended(ev.job_of(event)) or run.state.get("status") == "finished"
            or found.get("log_state") == "finished")


def _only_noted(event: dict[str, Any], cause: str, run: actions.Run, ledger: Ledger,
                found: dict[str, Any]) -> dict[str, Any] | None:
    """The one action of an event that asks nothing of anyone (a record, a wait), or None."""
    if event["type"] == "node.failure" and _running(run, ledger, event):
        return {"kind": "wait", "needs_person": False,
                "why": "a node or NCCL failure while the job still runs: it ends soon; its end (job.failed) is the "
                       f"same incident and brings the action, with this report's cause ({cause}) counted"}
    if cause in ("stalled", "throughput_drop") and _ended(run, ledger, event, found):
        return {"kind": "record", "needs_person": False,
                "why": f"{event['type']} reported after the job had ended: the job's last iterations (its final "
                       "checkpoint, its shutdown) are no slowdown of a running job; nothing to do"}
    return None


_RESUME_WHY = {"killed": "the job was killed from outside (a signal, a time limit, a person)",
               "node_failure": "a node or GPU failed", "nccl_timeout": "a collective timed out",
               "nccl_error": "NCCL failed"}


def decide(event: dict[str, Any], cause: str, nodes: list[str], run: actions.Run, found: dict[str, Any],
           running: bool, policy: dict[str, Any], proposals: Path, ctx: Context) -> list[dict[str, Any]]:
    """The actions for the incident's cause (actions.ACTION_OF), before the policy has its say."""
    kind = actions.ACTION_OF[cause]
    if kind == "resume":
        why = _RESUME_WHY[cause] + ": the same layout resumes from the last checkpoint"
        return [actions.resume(run, why, nodes if cause == "node_failure" else [])]
    if kind == "relayout":
        return [actions.relayout(run, found, proposals, ctx)]
    if kind == "rollback":
        action = actions.rollback(run, event, found, policy["lr_factor"], proposals, running)
        return [actions.with_evidence(action, found) if event["type"] == "loss.anomaly" and cause == "nan"
                else action]
    if kind == "summary":
        summary = actions.summary(run, found)
        if event["type"] != "job.finished":
            how = event.get("details", {}).get("signal") or event.get("details", {}).get("failure") or "failed"
            saved = found.get("checkpoint_iteration")
            done = f"its last checkpoint ({saved}) is at train_iters" if saved else \
                "its log shows its last iteration and it saves no checkpoints"
            summary["why"] += f" (reported as {event['type']}, {how}, but {done}: a resume would train nothing)"
        return [summary]
    what = event["type"] if cause in ("stalled", "throughput_drop") else actions.failure_code(found)
    return [actions.diagnose(run, event, found, what)]


def _check_policy(policy: dict[str, Any]) -> None:
    """Each cause allows only the action it gets: anything else would never start, silently."""
    for cause, kinds in policy["allow"].items():
        for i, kind in enumerate(kinds):
            if kind != actions.ACTION_OF[cause]:
                raise ToolError("bad_request", f"the policy allows {kind} after {cause}, whose action is "
                                f"{actions.ACTION_OF[cause]}", where=f"/policy/allow/{cause}/{i}",
                                fix=f"allow {actions.ACTION_OF[cause]} for {cause}, or leave {cause} out"
                                if actions.ACTION_OF[cause] in RELAUNCHING else f"leave {cause} out: its action "
                                f"({actions.ACTION_OF[cause]}) is always a person's")


# ---- the policy --------------------------------------------------------------------------------
def _judge(action: dict[str, Any], cause: str, key: str, ledger: Ledger, req: dict, now: float) -> dict[str, Any]:
    """The action as answered now: applied already, allowed to start, or waiting for a person
    with the exact command (the policy by cause and action, the user's approval, the relaunch
    limits, one relaunch per incident)."""
    a = dict(action)
    kind = a["kind"]
    done = ledger.incident(key)["applied"].get(kind)
    if done:
        return {**a, "allowed": False, "needs_person": False, "applied": done}
    a["allowed"] = False
    if kind not in RELAUNCHING or not a.get("argv") or a.get("needs_person"):
        return a
    other = ledger.relaunched(key)
    if other:
        return _for_person(a, f"this incident's job was already relaunched ({other[0]}, "
                              f"{other[1].get('output', 'started')}): look at that run before starting another")
    if kind == "relayout" and not (a.get("validation") or {}).get("valid"):
        return _for_person(a, "its script did not validate")
    if kind in req["approve"]:
        return {**a, "allowed": True, "approved": True}
    if kind not in req["policy"]["allow"].get(cause, []):
        return _for_person(a, f"the policy does not start a {kind} after {cause} by itself: run the command, or "
                              f"on-event again with --apply --approve {kind}")
    if req.get("late_s"):
        return _for_person(a, f"the event is {req['late_s'] / 60:.0f} minutes old, past the policy's "
                              f"{req['policy']['max_age_s'] / 60:.0f}: the policy starts nothing that late (the run may "
                              f"have changed since); the user's yes does (--apply --approve {kind})")
    policy = req["policy"]
    ok, why, not_before = ledger.relaunch_allowed(now, policy["max_relaunches"], policy["window_s"],
                                                  policy["backoff_s"])
    if not ok:
        a["not_before"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(not_before))
        return _for_person(a, f"not now: {why}; a person decides (--approve {kind} starts it)")
    return {**a, "allowed": True}


def _for_person(action: dict[str, Any], why: str) -> dict[str, Any]:
    return {**action, "allowed": False, "needs_person": True, "why": f"{action['why']}; {why}"}


def _start(action: dict[str, Any], run: actions.Run, key: str, ledger: Ledger, now: float) -> dict[str, Any]:
    """Start the action's command, detached (it outlives this tool), its output in the run's logs.
    Marked as started in the record before the process starts: never twice for one incident."""
    logs = own_folder(run.dir, "logs")
    out = logs / f"on-event-{len(list(logs.glob('on-event-*.out'))) + 1}-{action['kind']}.out"
    what: dict[str, Any] = {"output": str(out), "at": now, "approved": bool(action.get("approved"))}
    ledger.started(key, action["kind"], {**what, "starting": True})
    ledger.count_relaunch(now)
    ledger.save()
    try:
        with os.fdopen(os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644),
                       "ab") as sink:
            proc = subprocess.Popen(action["argv"], stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                    cwd=action.get("cwd") or str(run.dir), start_new_session=True)
        what["pid"] = proc.pid
    except OSError as e:
        what["error"] = f"could not start {action['argv'][0]}: {e.strerror or e}"
    ledger.started(key, action["kind"], what)
    ledger.save()
    return what


# ---- the tool ----------------------------------------------------------------------------------
POLICY_FILE = "policy.json"  # RUNS_ROOT/.events/policy.json: the runs root's recorded policy


def _policy_schema() -> dict[str, Any]:
    from ..contract import load_schema

    return load_schema("on-event", "request")["properties"]["policy"]


def _stored_policy(path: Path) -> dict[str, Any] | None:
    """The runs root's recorded policy (save_policy wrote it), its defaults filled; None when
    there is none. A link, or a file that is not a policy, is a clear error naming it."""
    from ..contract import _fill_defaults

    if not os.path.lexists(path):
        return None

    def damaged(why: str) -> ToolError:
        return ToolError("runtime", f"the runs root's recorded policy {path} is not usable: {why}", where=str(path),
                         fix="record the policy again (on-event --policy JSON --save-policy), or move the file aside "
                             "(the default policy is then used)")
    if os.path.islink(path):
        raise damaged("it is a symbolic link, not the file on-event writes")
    try:
        stored = files.read_json(path, str(path), "recorded policy", MAX_FILE_BYTES)
    except ToolError as e:
        raise damaged(e.message) from None
    error = next(iter(validator(_policy_schema()).iter_errors(stored)), None)
    if error is not None:
        raise damaged(f"at /{'/'.join(str(p) for p in error.absolute_path)}: {error.message}")
    policy = _fill_defaults({"properties": {"policy": _policy_schema()}}, {"policy": stored})["policy"]
    try:
        _check_policy(policy)
    except ToolError as e:
        raise damaged(e.message) from None
    return policy


def _policy(req: dict, runs_root: Path, ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    """The policy of this call: the request's (recorded as the runs root's with save_policy), else
    the runs root's recorded one, else the defaults; and what the answer says of it."""
    from ..contract import _fill_defaults

    path = runs_root / ".events" / POLICY_FILE
    if "policy" in req:
        _check_policy(req["policy"])
        info: dict[str, Any] = {"source": "request"}
        if req.get("save_policy"):
            if not files.is_dir(runs_root):
                raise ToolError("not_found", f"no runs root {runs_root} to record the policy in", where="/runs_root",
                                fix="give the runs root the runs are in (train's runs_root)")
            if os.path.islink(path) or (os.path.lexists(path) and not files.is_file(path)):
                raise ToolError("runtime", f"{path} is not a file on-event wrote (a link, or not a regular file)",
                                where=str(path), fix="move it aside; on-event writes the recorded policy there")
            if not ctx.dry_run:
                own_folder(runs_root, ".events")
                write_atomic(path, json.dumps(req["policy"], indent=1, sort_keys=True) + "\n")
            info.update(file=str(path), saved=not ctx.dry_run)
        return req["policy"], {**info, **req["policy"]}
    if req.get("save_policy"):
        raise ToolError("bad_request", "save_policy records the policy given with it, and none is given",
                        where="/policy", fix="give the policy to record (--policy JSON)")
    stored = _stored_policy(path)
    if stored is not None:
        return stored, {"source": "stored", "file": str(path), **stored}
    policy = _fill_defaults({"properties": {"policy": _policy_schema()}}, {"policy": {}})["policy"]
    return policy, {"source": "default", **policy}


def run(req: dict, ctx: Context) -> dict[str, Any]:
    runs_root = Path(os.path.realpath(req["runs_root"]))
    policy, about = _policy(req, runs_root, ctx)
    req = {**req, "policy": policy}
    if "event" not in req and "event_file" not in req:   # only the policy, recorded
        return {"policy": about}
    out = _event(req, runs_root, ctx)
    return {**out, "policy": about}


def _event(req: dict, runs_root: Path, ctx: Context) -> dict[str, Any]:
    event, where = _load(req)
    _trusted(event, where)
    run_dir = _run_dir(runs_root, event, where)
    ledger = Ledger(runs_root, event["run_id"]).read()
    req = {**req, "late_s": _fresh(event, where, req["policy"]["max_age_s"], ledger)}
    event = _of_attempt(event, ledger)
    key = ev.incident(event)
    base = {"event_id": event["event_id"], "type": event["type"], "run_id": event["run_id"], "incident": key}
    if ctx.dry_run:
        return {**base, "dry_run": True, **_handle(event, key, run_dir, ledger, req, ctx, dry=True)}
    # A train that died before its job's end left the run "running" with nobody holding it: the
    # run is marked failed and that end is sent now (it comes back as an event of its own).
    dead = settle.report(run_dir)
    if dead:
        base["ended_attempt"] = {"event_id": dead["event_id"], "job_id": dead["job"]["job_id"],
                                 "why": dead["details"]["message"]}
        ctx.progress(f"on-event: {dead['details']['message']}; its job.failed ({dead['job']['job_id']}) is sent")
    with Ledger(runs_root, event["run_id"]) as ledger:
        return {**base, **_handle(event, key, run_dir, ledger, req, ctx, dry=False)}


def _of_attempt(event: dict[str, Any], ledger: Ledger) -> dict[str, Any]:
    """A job's end that the scheduler reported without its attempt (Slurm's trigger on the
    controller, where SLURM_RESTART_COUNT is not set, unless it passes --attempt) is the end of the
    job's last attempt
    the record knows: after Slurm requeued a job, its end is the requeued attempt's, not the first
    attempt's, whose end was handled."""
    job = event["job"]
    if "attempt" in job or event["type"] not in ev.ENDINGS or event["emitter"] != "scheduler":
        return event
    latest = ledger.latest_attempt(job["job_id"])
    return {**event, "job": {**job, "attempt": latest}} if latest else event


def _handle(event: dict[str, Any], key: str, run_dir: Path, ledger: Ledger, req: dict, ctx: Context,
            dry: bool) -> dict[str, Any]:
    first = ledger.seen(event["event_id"])
    decided = False
    if first is None:
        out = _take_report(event, key, run_dir, ledger, req, ctx, dry)
        if "decided" not in out:   # noted, or a requeued attempt's start answered
            return out
        decided, found = out["decided"], out["facts"]
    else:
        found = {"first_seen": first}
    record = ledger.incident(key)
    if record is None:  # an event seen before that opened no incident (a start, a checkpoint)
        return {"verdict": "duplicate", "duplicate_of": event["event_id"], "actions": [], "facts": found}
    now = time.time()
    answered, started = [], False
    for action in (a for a in record["actions"] if isinstance(a, dict)):
        judged = _judge(action, record.get("cause", ""), key, ledger, req, now)
        if req["apply"] and judged["allowed"]:
            judged["applied"] = {"dry_run": True, "would_run": judged.get("commands", [])} if dry else \
                _start(judged, actions.Run(run_dir, event), key, ledger, now)
            started = True
            if not dry:
                ctx.progress(f"on-event: {judged['kind']} started, output {judged['applied']['output']}")
        answered.append(judged)
    verdict = "handled" if decided or started else "pending" if any(_waiting(a) for a in answered) else "duplicate"
    out = {"verdict": verdict, "cause": record.get("cause"), "actions": answered if verdict != "duplicate" else [],
           "facts": found}
    if verdict == "duplicate":
        out["duplicate_of"] = record.get("decided_by", record["event_id"])
        out["facts"] = {**found, "incident_actions": [a["kind"] for a in answered], "applied": record["applied"]}
    return out


def _waiting(action: dict[str, Any]) -> bool:
    """An action that could still start for this incident: allowed, or waiting for a person's yes."""
    return action["kind"] in RELAUNCHING and bool(action.get("argv")) and not action.get("applied")


def _take_report(event: dict[str, Any], key: str, run_dir: Path, ledger: Ledger, req: dict, ctx: Context,
                 dry: bool) -> dict[str, Any]:
    """A report not seen before: recorded, merged into its incident, and the incident decided when
    it is new or this report names a more specific cause."""
    kind = event["type"]
    if kind in ("job.started", "checkpoint.saved"):
        return _start_or_checkpoint(event, ledger, dry)
    run = actions.Run(run_dir, event)
    found = actions.facts(run, event, ctx)
    cause = actions.cause(event, found)
    quiet = _only_noted(event, cause, run, ledger, found)
    if quiet:
        ledger.note(event, "noted", key)
        if kind == "node.failure":  # its cause counts when the job's end arrives
            ledger.report(key, event, cause)
        if not dry:
            ledger.save()
        return {"verdict": "noted", "cause": cause, "actions": [quiet], "facts": found}
    ledger.note(event, "reported", key)
    record = ledger.report(key, event, cause)
    best = _most_specific(record)
    went_nan = _nan_of_job(ledger, key)
    deciding = event
    if went_nan and best != "nan":
        # The job's loss went NaN (the watcher's report; the log here may not show it): whatever
        # ended it afterwards (a person stopping it, a kill), its end is that NaN's, to roll back
        # to a checkpoint before it, never to resume as it was.
        best = "nan"
        bad = [r["iteration"] for r in went_nan["reports"] if isinstance(r.get("iteration"), int)]
        if bad:
            deciding = {**event, "details": {**event.get("details", {}), "iteration": min(bad)}}
    if record["actions"] and not actions.more_specific(best, record.get("cause")):
        if not dry:
            ledger.save()
        return {"decided": False, "facts": found}
    nodes = list(dict.fromkeys(n for r in record["reports"] for n in r.get("nodes", [])))
    todo = decide(deciding, best, nodes, run, found, _running(run, ledger, event), req["policy"],
                  ledger.dir / "proposals", ctx)
    attempt = event["job"].get("attempt") or 0
    if kind in ev.ENDINGS and ledger.latest_attempt(event["job"]["job_id"]) > attempt:
        todo = [_left_to_slurm(a, event["job"]["job_id"], ledger.latest_attempt(event["job"]["job_id"]))
                for a in todo]
    ledger.decide(key, event, best, todo)
    if best == "nan" and kind == "loss.anomaly":
        _end_went_nan(ledger, key, event, todo)
    if not dry:
        ledger.save()  # the decision before anything starts
        _write_proposals(todo, ledger)
    return {"decided": True, "facts": found}


def _start_or_checkpoint(event: dict[str, Any], ledger: Ledger, dry: bool) -> dict[str, Any]:
    """A job's start or a checkpoint: noted (a checkpoint's iteration and loss kept for later
    rollbacks), unless a start is Slurm's requeue of a job whose end the record holds."""
    kind = event["type"]
    requeued = _requeued(event, ledger) if kind == "job.started" else None
    if requeued:
        ledger.note(event, "reported", None)
        if not dry:
            ledger.save()
        return {"verdict": "handled", "cause": None, "actions": requeued, "facts": {}}
    if not dry:
        ledger.note(event, "noted", None)
        if kind == "checkpoint.saved":
            details = event.get("details", {})
            ledger.checkpoint(details.get("checkpoint_iteration", -1), details.get("loss"))
        ledger.save()
    return {"verdict": "noted", "actions": [{"kind": "record", "needs_person": False, "why": f"{kind} recorded"}],
            "facts": {}}


def _left_to_slurm(action: dict[str, Any], job_id: str, attempt: int) -> dict[str, Any]:
    """A relaunch of an attempt that Slurm requeued: the requeued attempt continues from the last
    checkpoint itself, and a resume of the skill's would run beside it on the same run folder."""
    if action["kind"] not in RELAUNCHING:
        return action
    return {"kind": "record", "needs_person": False,
            "why": f"{action['why']}; but Slurm requeued job {job_id} (its attempt {attempt} started): the requeued "
                   "job continues from the last checkpoint itself, and nothing is started beside it (the skill's "
                   "scripts ask for --no-requeue; this job's did not)"}


def _requeued(event: dict[str, Any], ledger: Ledger) -> list[dict[str, Any]] | None:
    """A start of a requeued attempt (job.attempt > 0): each earlier attempt's end whose relaunch
    has not started is left to Slurm (its actions become a record); where one has started, the
    job now runs twice on one run folder, which a person must stop. None when nothing changes."""
    attempt = event["job"].get("attempt") or 0
    if not attempt:
        return None
    job = event["job"]["job_id"]
    out = []
    for n in range(attempt):
        key = ev.incident({**event, "type": "job.failed", "job": {**event["job"], "attempt": n}})
        record = ledger.incident(key)
        if not record:
            continue
        started = ledger.relaunched(key)
        if started:
            out.append({"kind": "diagnose", "needs_person": True, "commands": [f"scancel {shlex.quote(job)}"],
                        "why": f"Slurm requeued job {job} (attempt {attempt} started) after its attempt {n} ended, "
                               f"for which a {started[0]} was already started (output {started[1].get('output', '?')}"
                               "): two copies of the run now train on one run folder; stop one of them (scancel "
                               "the requeued job, or the relaunch)"})
        elif any(a.get("kind") in RELAUNCHING for a in record.get("actions", [])):
            todo = [_left_to_slurm(a, job, attempt) for a in record["actions"]]
            ledger.decide(key, event, record.get("cause"), todo)
            out.extend(todo)
    return out or None


def _job_key(key: str) -> str:
    return key.rsplit("/", 1)[0]


def _nan_of_job(ledger: Ledger, key: str) -> dict[str, Any] | None:
    """For a job's end: the incident of a NaN loss reported for the same job, if one was."""
    if not key.endswith("/end"):
        return None
    nan = ledger.incident(_job_key(key) + "/loss.anomaly")
    return nan if nan and nan.get("cause") == "nan" else None


def _end_went_nan(ledger: Ledger, key: str, event: dict[str, Any], todo: list[dict[str, Any]]) -> None:
    """A NaN reported after the job's end was decided (reports arrive in any order): the end,
    while nothing was started for it, becomes the NaN's, with its rollback, so that no later yes
    resumes the job as it was. A resume already started is said in the NaN's answer."""
    end = ledger.incident(_job_key(key) + "/end")
    if not end or end.get("cause") == "nan":
        return
    started = ledger.relaunched(_job_key(key) + "/end")
    if started is None:
        ledger.decide(_job_key(key) + "/end", event, "nan", todo)
        return
    for action in todo:
        action["why"] += (f"; this job's end was already relaunched ({started[0]}, output "
                          f"{started[1].get('output', '?')}): stop that run before rolling back")


def _most_specific(record: dict[str, Any]) -> str:
    """The incident's cause: the most specific any of its reports gave (the earliest among equals)."""
    causes = [r["cause"] for r in record["reports"] if r.get("cause")]
    best = causes[0]
    for cause in causes[1:]:
        if actions.more_specific(cause, best):
            best = cause
    return best


def _write_proposals(todo: list[dict[str, Any]], ledger: Ledger) -> None:
    """The proposed train requests, so that the commands run as shown (named by their content's
    hash: one there already is left as it is, as is anything else of that name)."""
    for action in todo:
        for f in action.get("files", []):
            path = Path(f["path"])
            if path.parent == ledger.dir / "proposals" and not os.path.lexists(path):
                write_atomic(ledger.proposals() / path.name, f["content"])


TOOL = Tool(name="on-event", summary="Handle a training event (job failed, stalled, NaN, finished, ...): check "
                     "it, merge it into its incident, answer the intended actions; --apply starts those the policy "
                     "allows or the user approved, once per incident.", run=run)
