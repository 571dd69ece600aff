#!/usr/bin/env python3
"""Send the skill's training events from a job (references/events.md). Standard library only.

    emit_event.py send --type job.started --run-id ID --run-dir DIR [--log LOG] [--layout JSON]
    emit_event.py send --end --exit-code N ...      # job.finished (N = 0) or job.failed, with the
                                                    # signal and known failure read from the log
    emit_event.py watch --log LOG --pid PID ...     # checkpoints, NaN / spikes, slowdowns, NCCL
                                                    # and node failures, stalls; exits with PID
    emit_event.py flush --run-dir DIR               # deliver what the run's outbox still holds
    emit_event.py deliver --run-dir DIR             # the same, and keep trying with a back-off until
                                                    # it is delivered or too old (the emitters start
                                                    # it themselves; one per outbox), each round to
                                                    # the receiver the run's newest emitter call had
    emit_event.py settle --run-dir DIR              # a train that died before the job's end: the
                                                    # run marked failed, its job.failed sent

Every event is appended to RUN_DIR/events.jsonl; where MEGATRON_SKILL_EVENTS_URL is set it is
POSTed there as {"source": "megatron-skill", "event": {...}} (through RUN_DIR/events.outbox.jsonl:
what a call cannot deliver, a sender of its own keeps trying after it, as MEGATRON_SKILL_EVENTS_RETRY_S,
_RETRY_MAX_S and _MAX_AGE_S say; a job.started is sent by that sender alone), with the bearer token in
MEGATRON_SKILL_EVENTS_TOKEN and signed with MEGATRON_SKILL_EVENTS_SECRET (or the file named by
MEGATRON_SKILL_EVENTS_SECRET_FILE). The job's id comes from SLURM_JOB_ID or
MEGATRON_SKILL_JOB_ID unless --job-id gives it. This program always exits 0: a receiver that
is down, slow or refusing never fails the job; what happened is said on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from pathlib import Path

from megatron_skill.events import emit as emitter
from megatron_skill.events import event as ev

HOSTLIST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._,\[\]-]{0,254}")  # schemas/event.json's job.nodes


def _job(args: argparse.Namespace) -> dict:
    env = os.environ
    slurm = env.get("SLURM_JOB_ID")
    return {"job_id": args.job_id or slurm or env.get("MEGATRON_SKILL_JOB_ID") or f"{socket.gethostname()}.{os.getppid()}",
            "scheduler": args.scheduler or ("slurm" if slurm else "torchrun"),
            "attempt": _attempt(args.attempt if args.attempt is not None else env.get("SLURM_RESTART_COUNT")),
            "host": socket.gethostname()[:255],
            "nodes": _nodes(args.nodes or env.get("SLURM_JOB_NODELIST"))}


def _attempt(text: str | None) -> int | None:
    """The job's attempt (restarts before this one): a number of at most 9 digits, else left out."""
    return int(text) if text and text.isdigit() and len(text) <= 9 else None


def _nodes(hostlist: str | None) -> list[str] | None:
    """The job's nodes as the scheduler writes them (gpu[03-04],cpu7), kept whole; anything else
    (Slurm's "(null)" before the job has nodes) is left out."""
    return [hostlist] if hostlist and HOSTLIST.fullmatch(hostlist) else None


def _identity(args: argparse.Namespace) -> dict:
    layout = None
    if args.layout:
        try:
            layout = {k: v for k, v in json.loads(args.layout).items() if isinstance(v, int)}
        except (ValueError, AttributeError):
            print("emit: --layout is not a JSON object; left out", file=sys.stderr)
    return {"request_id": args.request_id, "run_dir": str(Path(args.run_dir).resolve()) if args.run_dir else None,
            "log": str(Path(args.log).resolve()) if args.log else None, "layout": layout}


def _send(args: argparse.Namespace, kind: str, details: dict) -> None:
    event = ev.new(kind, args.run_id, _job(args), args.emitter, details=details, **_identity(args))
    out = emitter.emit(event, Path(args.run_dir) if args.run_dir else None, deadline_s=args.deadline_s)
    if args.print:
        print(json.dumps(out))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emit_event.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("send", "watch"):
        s = sub.add_parser(name)
        s.add_argument("--run-id", required=True)
        s.add_argument("--run-dir")
        s.add_argument("--request-id")
        s.add_argument("--job-id")
        s.add_argument("--attempt", help="the job's restarts before this attempt (Slurm's Restarts of "
                       "'scontrol show job', SLURM_RESTART_COUNT in the job); default SLURM_RESTART_COUNT")
        s.add_argument("--scheduler", choices=["slurm", "torchrun", "local", "other"])
        s.add_argument("--emitter", default="job" if name == "send" else "watcher",
                       choices=["job", "watcher", "train", "scheduler", "monitor"])
        s.add_argument("--log")
        s.add_argument("--layout", help="the layout as a JSON object of integers (tp, pp, dp, mbs, ...)")
        s.add_argument("--nodes", help="the job's nodes (Slurm's hostlist, e.g. gpu[03-04]); default SLURM_JOB_NODELIST")
        s.add_argument("--deadline-s", type=float, default=emitter.DEADLINE_S,
                       help="at most this long to deliver one event and those still waiting")
        s.add_argument("--print", action="store_true", help="print each event and its delivery on stdout")
    flush = sub.add_parser("flush", help="deliver the events the run's outbox still holds")
    flush.add_argument("--run-dir", required=True)
    flush.add_argument("--deadline-s", type=float, default=emitter.DEADLINE_S)
    deliver = sub.add_parser("deliver", help="deliver the run's outbox, trying again with a back-off until "
                             "nothing waits in it (one sender per outbox)")
    deliver.add_argument("--run-dir", required=True)
    settle = sub.add_parser("settle", help="a train that died before its job's end: mark the run failed and "
                            "send the end")
    settle.add_argument("--run-dir", required=True)
    settle.add_argument("--event", help="the end event already made (train, as it starts again)")
    send, watch = sub.choices["send"], sub.choices["watch"]
    send.add_argument("--type", choices=sorted(ev_types()))
    send.add_argument("--end", action="store_true", help="the job ended: job.finished or job.failed by --exit-code")
    send.add_argument("--exit-code", type=int)
    send.add_argument("--details", help="the event's details as a JSON object")
    watch.add_argument("--pid", type=int, required=True, help="follow the log until this process is gone")
    watch.add_argument("--stall-s", type=float, default=600.0, help="seconds without an iteration that make a stall")
    watch.add_argument("--poll-s", type=float, default=2.0)
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # a bad flag must not fail the job that calls this
        return 0 if e.code in (0, None) else _refuse("bad arguments")
    try:
        if args.command == "flush":
            return _flush(args)
        if args.command == "deliver":
            return _deliver(args)
        if args.command == "settle":
            return _settle(args)
        if args.command == "watch":
            emitter.watch(Path(args.log), args.pid, lambda kind, details: _send(args, kind, details),
                          stall_s=args.stall_s, poll_s=args.poll_s)
            return 0
        details = json.loads(args.details) if args.details else {}
        if args.end or args.type in ("job.finished", "job.failed"):
            code = args.exit_code if args.exit_code is not None else (1 if args.type == "job.failed" else 0)
            details = {**emitter.ending(code, Path(args.log) if args.log else None), **details}
            kind = args.type or ("job.finished" if code == 0 else "job.failed")
        else:
            kind = args.type
        if not kind:
            return _refuse("give --type or --end")
        _send(args, kind, details)
    except Exception as e:  # noqa: BLE001 -- never fail the job over an event
        return _refuse(f"{type(e).__name__}: {e}")
    return 0


def _flush(args: argparse.Namespace) -> int:
    url = os.environ.get(ev.URL_ENV)
    if url and Path(args.run_dir).is_dir():
        emitter.remember_receiver(Path(args.run_dir), url, os.environ.get(ev.TOKEN_ENV))
        for event_id, status in emitter.flush(Path(args.run_dir), url, os.environ.get(ev.TOKEN_ENV),
                                              args.deadline_s).items():
            print(f"emit: {event_id}: {status}", file=sys.stderr)
    return 0


def _deliver(args: argparse.Namespace) -> int:
    url = os.environ.get(ev.URL_ENV)
    if url and Path(args.run_dir).is_dir():
        print(f"emit: {args.run_dir}: " + emitter.deliver(Path(args.run_dir), url, os.environ.get(ev.TOKEN_ENV)),
              file=sys.stderr)
    return 0


def _settle(args: argparse.Namespace) -> int:
    from megatron_skill.events import settle

    if args.event:
        emitter.emit(json.loads(args.event), Path(args.run_dir))  # made (unsigned) by the train that starts again
    elif settle.report(Path(args.run_dir), wait=True) is None:
        print(f"emit: {args.run_dir}: no attempt to settle (none running, or its train still runs)", file=sys.stderr)
    return 0


def ev_types() -> list[str]:
    schema = Path(__file__).resolve().parent.parent / "schemas" / "event.json"
    return json.loads(schema.read_text())["properties"]["type"]["enum"]


def _refuse(why: str) -> int:
    print(f"emit: no event sent: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
