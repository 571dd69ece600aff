"""The on-event tool: one training event in, the intended actions out (references/events.md).

In order, before anything is done: the event's form (schemas/event.json, size), its signature
(the shared secret), its age (stale replays are refused), and its run (a run directory under
runs_root). Then, under the run's event record: an event id seen before, or an incident
already acted on, answers 'duplicate' and does nothing. Otherwise the actions are worked out
(events/actions.py), recorded, and, with apply, those the policy allows are started.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from ..contract import Context, Tool, parse_json, validator
from ..errors import ToolError
from ..events import actions
from ..events import event as ev
from ..events.ledger import Ledger, folder
from ..runs import RunLock

MAX_FILE_BYTES = 64 * 1024
CLOCK_SKEW_S = 300  # an event may come from a host whose clock runs this far ahead


def _load(req: dict) -> tuple[dict[str, Any], str]:
    if "event" in req:
        return req["event"], "/event"
    path = Path(req["event_file"])
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ToolError("not_found", f"cannot read {path}: {e.strerror}", where="/event_file",
                        fix="give the file the event was saved to") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ToolError("bad_request", f"{path} is larger than {MAX_FILE_BYTES // 1024} KiB: no event is",
                        where="/event_file", fix="give the event alone (the emitters keep one under 32 KiB)")
    document = ev.unwrap(parse_json(raw.decode("utf-8", errors="replace"), "/event_file", f"the event in {path}"))
    errors = sorted(validator({"$ref": "event.json"}).iter_errors(document), key=lambda e: e.path)
    if errors:
        err = errors[0]
        where = "/event_file:/" + "/".join(str(p) for p in err.absolute_path)
        raise ToolError("bad_request", f"not a training event: {err.message}", where=where,
                        fix="see schemas/event.json (emit_event.py makes such events)")
    return document, "/event_file"


def _trusted(event: dict[str, Any], where: str, max_age_s: float) -> None:
    if len(ev.canonical(event)) > ev.MAX_BYTES:
        raise ToolError("bad_request", f"the event is larger than {ev.MAX_BYTES // 1024} KiB", where=where,
                        fix="shorten details.log_tail")
    secret = ev.secret_from_env()
    if not secret:
        raise ToolError("environment", "no shared secret to check the event's signature with",
                        where=ev.SECRET_ENV, fix=f"set {ev.SECRET_ENV} (or {ev.SECRET_FILE_ENV}) to the secret "
                        "the emitters sign with, where this tool runs")
    if "signature" not in event:
        raise ToolError("refused", "the event is not signed", where=where + "/signature",
                        fix=f"set {ev.SECRET_ENV} where the job runs, so that its emitters sign what they send")
    if not ev.verified(event, secret):
        raise ToolError("refused", "the event's signature does not match: it was changed or signed with another "
                        "secret", where=where + "/signature", fix="nothing is done for it; if it is genuine, give "
                        "the emitters and this tool the same secret")
    age = time.time() - ev.parse_time(event["time"])
    if age > max_age_s:
        raise ToolError("refused", f"the event is {age / 60:.0f} minutes old, older than the policy's "
                        f"{max_age_s / 60:.0f} (a replay, or a receiver that held it)", where=where + "/time",
                        fix="raise policy.max_age_s to handle it anyway; 'launch.py logs' reads the run as it is now")
    if age < -CLOCK_SKEW_S:
        raise ToolError("refused", f"the event is dated {-age / 60:.0f} minutes in the future", where=where + "/time",
                        fix="check the emitting host's clock (NTP)")


def _is_run(folder: Path) -> bool:
    return folder.is_dir() and any((folder / f).exists() for f in ("state.json", "events.jsonl", *actions.SCRIPTS))


def _run_dir(runs_root: Path, event: dict[str, Any], where: str) -> Path:
    """runs_root/RUN_ID, or the event's run_dir where render put the run elsewhere under runs_root."""
    run_dir = runs_root / event["run_id"]
    if not _is_run(run_dir) and event.get("run_dir"):
        given = Path(event["run_dir"]).resolve()
        if given.is_relative_to(runs_root) and _is_run(given):
            run_dir = given
    if not _is_run(run_dir):
        raise ToolError("not_found", f"no run {event['run_id']} under {runs_root}", where=where + "/run_id",
                        fix="give the runs_root the job's run directory is in (train's runs_root, or the folder "
                            "above render's run_dir)")
    return run_dir


def _running(run: actions.Run, ledger: Ledger, event: dict[str, Any]) -> bool:
    return RunLock(run.dir).held_elsewhere() or (event["type"] not in ("job.finished", "job.failed")
                                                 and ledger.job_running(event["job"]["job_id"]))


def decide(event: dict[str, Any], run: actions.Run, ledger: Ledger, policy: dict[str, Any], proposals: Path,
           ctx: Context) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(verdict, actions, facts) for an event not seen before."""
    kind = event["type"]
    if kind in ("job.started", "checkpoint.saved"):
        return "noted", [{"kind": "record", "needs_person": False, "why": f"{kind} recorded"}], {}
    found = actions.facts(run, event, ctx)
    running = _running(run, ledger, event)
    if kind == "node.failure" and running:
        return "noted", [{"kind": "wait", "needs_person": False,
                          "why": "a node or NCCL failure while the job still runs: it ends soon; its end (job.failed) "
                                 "brings the resume"}], found
    if kind == "job.finished":
        return "handled", [actions.summary(run, found)], found
    if kind in ("training.stalled", "throughput.drop"):
        return "handled", [actions.diagnose(run, event, found, kind)], found
    if kind == "loss.anomaly":
        return "handled", [actions.rollback(run, event, found, policy["lr_factor"], proposals, running)], found
    why = actions.cause(event, found)  # job.failed, or node.failure after the job ended
    if why == "out_of_memory":
        return "handled", [actions.relayout(run, found, proposals, ctx)], found
    if why == "nan":
        return "handled", [actions.rollback(run, event, found, policy["lr_factor"], proposals, False)], found
    if why in actions.RESUMABLE:
        text = {"killed": "the job was killed from outside (a signal, a time limit, a person)",
                "node_failure": "a node or GPU failed", "nccl_timeout": "a collective timed out",
                "nccl_error": "NCCL failed"}[why]
        return "handled", [actions.resume(run, event, text + ": the same layout resumes from the last checkpoint",
                                          failed_node=why == "node_failure")], found
    return "handled", [actions.diagnose(run, event, found, why)], found


def _policy(action: dict[str, Any], ledger: Ledger, policy: dict[str, Any], now: float) -> None:
    """Mark the action allowed or not, by the policy and the relaunch limits."""
    if action["kind"] not in policy["apply_kinds"] or action.get("needs_person") or not action.get("argv"):
        action["allowed"] = False
        return
    if action["kind"] == "relayout" and not (action.get("validation") or {}).get("valid"):
        action.update(allowed=False, needs_person=True)
        action["why"] += "; its script did not validate, so it waits for a person"
        return
    ok, why, not_before = ledger.relaunch_allowed(now, policy["max_relaunches"], policy["window_s"],
                                                  policy["backoff_s"])
    action["allowed"] = ok
    if not ok:
        action["why"] += f"; not now: {why}"
        action["needs_person"] = True
        action["not_before"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(not_before))


def _apply(action: dict[str, Any], run: actions.Run) -> dict[str, Any]:
    """Start the action's command, detached (it outlives this tool), its output in the run's logs."""
    logs = run.dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    n = len(list(logs.glob("on-event-*.out")))
    out = logs / f"on-event-{n + 1}-{action['kind']}.out"
    with open(out, "ab") as sink:
        proc = subprocess.Popen(action["argv"], stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                cwd=action.get("cwd") or str(run.dir), start_new_session=True)
    return {"pid": proc.pid, "output": str(out), "at": time.time()}


def run(req: dict, ctx: Context) -> dict[str, Any]:
    event, where = _load(req)
    policy = req["policy"]
    _trusted(event, where, policy["max_age_s"])
    runs_root = Path(req["runs_root"]).resolve()
    run_dir = _run_dir(runs_root, event, where)
    incident = ev.incident(event)
    base = {"event_id": event["event_id"], "type": event["type"], "run_id": event["run_id"], "incident": incident}
    if ctx.dry_run:
        ledger = Ledger(runs_root, event["run_id"]).read()
        return {**base, "dry_run": True, **_handle(event, incident, run_dir, ledger, req, ctx, dry=True)}
    with Ledger(runs_root, event["run_id"]) as ledger:
        return {**base, **_handle(event, incident, run_dir, ledger, req, ctx, dry=False)}


def _handle(event: dict[str, Any], incident: str, run_dir: Path, ledger: Ledger, req: dict, ctx: Context,
            dry: bool) -> dict[str, Any]:
    first = ledger.seen(event["event_id"])
    if first:
        return {"verdict": "duplicate", "duplicate_of": event["event_id"], "actions": [],
                "facts": {"first_seen": first}}
    claimed = ledger.claimed(incident)
    if claimed:
        if not dry:
            ledger.note(event, "duplicate", incident)
            ledger.save()
        return {"verdict": "duplicate", "duplicate_of": claimed["event_id"], "actions": [],
                "facts": {"incident_actions": claimed["actions"], "applied": claimed.get("applied", {})}}
    run = actions.Run(run_dir, event)
    verdict, todo, found = decide(event, run, ledger, req["policy"], folder(Path(req["runs_root"]).resolve(),
                                                                            event["run_id"]) / "proposals", ctx)
    now = time.time()
    for action in todo:
        _policy(action, ledger, req["policy"], now)
    if dry:
        return {"verdict": verdict, "actions": [_shown(a, req["apply"]) for a in todo], "facts": found}
    ledger.note(event, verdict, incident)
    if event["type"] == "checkpoint.saved":
        ledger.checkpoint(event.get("details", {}).get("checkpoint_iteration", -1), event.get("details", {}).get("loss"))
    if verdict == "handled":
        ledger.claim(incident, event, [a["kind"] for a in todo])
    ledger.save()  # before anything starts: a crash from here on never starts it twice
    for action in todo:
        for f in action.get("files", []):  # the proposed requests, so that the commands run as shown
            path = Path(f["path"])
            if path.parent == ledger.dir / "proposals" and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f["content"])
        if req["apply"] and action.get("allowed"):
            ledger.count_relaunch(now)
            ledger.save()
            action["applied"] = _apply(action, run)
            ledger.applied(incident, action["kind"], action["applied"])
            ledger.save()
            ctx.progress(f"on-event: {action['kind']} started (pid {action['applied']['pid']}), output "
                         f"{action['applied']['output']}")
    return {"verdict": verdict, "actions": todo, "facts": found}


def _shown(action: dict[str, Any], apply: bool) -> dict[str, Any]:
    if apply and action.get("allowed"):
        return {**action, "applied": {"dry_run": True, "would_run": action.get("commands", [])}}
    return action


TOOL = Tool(name="on-event", summary="Handle a training event (job failed, stalled, NaN, finished, ...): check "
                     "it, drop duplicates, answer the intended actions; --apply starts those the policy allows.",
            run=run)
