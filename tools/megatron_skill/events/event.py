"""A training event (schemas/event.json): made, signed, verified, and named by its incident.

The signature is HMAC-SHA256 over the event's canonical JSON without the signature: sorted
keys, no spaces, UTF-8, and every float that is a whole number written as an integer.  The
last rule lets an event pass through a JavaScript receiver (OpenClaw's Gateway re-serialises
payloads, and JSON.stringify writes 3.0 as 3) and still verify.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import os
import uuid
from typing import Any

from ..files import read_regular

SECRET_ENV = "MEGATRON_SKILL_EVENTS_SECRET"
SECRET_FILE_ENV = "MEGATRON_SKILL_EVENTS_SECRET_FILE"
URL_ENV = "MEGATRON_SKILL_EVENTS_URL"
TOKEN_ENV = "MEGATRON_SKILL_EVENTS_TOKEN"
SKIP_ENV = "MEGATRON_SKILL_EVENTS_SKIP"  # event types recorded in the run but not POSTed (no agent woken)
SOURCE = "megatron-skill"  # the "source" of the POSTed body, which a Gateway mapping can match on
MAX_BYTES = 32 * 1024  # an event's canonical size; the log tail is what makes one large

# The events that end a job: whichever emitter reports the end first, the rest are the same incident.
ENDINGS = ("job.finished", "job.failed", "node.failure")


def now_text() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> float:
    return dt.datetime.strptime(text.replace("Z", "+0000"),
                                "%Y-%m-%dT%H:%M:%S.%f%z" if "." in text else "%Y-%m-%dT%H:%M:%S%z").timestamp()


def new(kind: str, run_id: str, job: dict[str, Any], emitter: str, **fields: Any) -> dict[str, Any]:
    """An unsigned event of this kind; fields that are None are left out."""
    event = {"version": 1, "event_id": uuid.uuid4().hex, "type": kind, "time": now_text(), "run_id": run_id,
             "emitter": emitter, "job": {k: v for k, v in job.items() if v is not None}}
    event.update({k: v for k, v in fields.items() if v is not None and v != {}})
    return event


def _whole(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


def canonical(event: dict[str, Any]) -> bytes:
    body = {k: v for k, v in event.items() if k != "signature"}
    return json.dumps(_whole(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def signature(event: dict[str, Any], secret: bytes) -> str:
    return "sha256=" + hmac.new(secret, canonical(event), hashlib.sha256).hexdigest()


def sign(event: dict[str, Any], secret: bytes | None) -> dict[str, Any]:
    return {**_whole(event), "signature": signature(event, secret)} if secret else _whole(event)


def verified(event: dict[str, Any], secret: bytes) -> bool:
    given = event.get("signature")
    return isinstance(given, str) and hmac.compare_digest(given, signature(event, secret))


MAX_SECRET_BYTES = 4096


class SecretFileError(ValueError):
    """MEGATRON_SKILL_EVENTS_SECRET_FILE names something that is no usable secret file."""


def load_secret(env: dict[str, str] | None = None) -> bytes | None:
    """The shared secret: MEGATRON_SKILL_EVENTS_SECRET, or the first line of the file that
    MEGATRON_SKILL_EVENTS_SECRET_FILE names (for secrets mounted as files); None when neither
    is set. A secret file that is missing, empty, not a regular file (a FIFO would block) or
    larger than 4 KiB raises SecretFileError."""
    env = os.environ if env is None else env
    if env.get(SECRET_ENV):
        return env[SECRET_ENV].encode()
    name = env.get(SECRET_FILE_ENV)
    if not name:
        return None
    try:
        text = read_regular(name, MAX_SECRET_BYTES).decode("utf-8", errors="strict")
    except (OSError, UnicodeDecodeError) as e:
        raise SecretFileError(f"{SECRET_FILE_ENV} ({name}): {getattr(e, 'strerror', None) or e}") from None
    line = text.splitlines()[0].strip() if text.strip() else ""
    if not line:
        raise SecretFileError(f"{SECRET_FILE_ENV} ({name}) holds no secret on its first line")
    return line.encode()


def secret_from_env(env: dict[str, str] | None = None) -> bytes | None:
    """The shared secret, or None where there is none to use (the emitters' side: an event is
    then sent unsigned, which on-event refuses)."""
    try:
        return load_secret(env)
    except SecretFileError:
        return None


def job_of(event: dict[str, Any]) -> str:
    """The job's run the event is about: its job id, and for a job that Slurm requeued its attempt
    (job.attempt, SLURM_RESTART_COUNT), JOB~N: each attempt ends on its own, and each end is an
    incident of its own. ("~" is in no job id: JOB~1 is never another job's id.)"""
    job = event["job"]
    attempt = job.get("attempt")
    return f"{job['job_id']}~{attempt}" if attempt else job["job_id"]


def incident(event: dict[str, Any]) -> str:
    """What the event is about, so that two reports of one thing act once: the end of a job's
    attempt (its trap, the train tool and the scheduler each report it), a stall, a loss anomaly,
    a throughput drop of one attempt; a checkpoint by its iteration; a start by its attempt."""
    job = job_of(event)
    kind = event["type"]
    if kind in ENDINGS:
        what = "end"
    elif kind == "checkpoint.saved":
        what = f"checkpoint-{event.get('details', {}).get('checkpoint_iteration', '?')}"
    else:
        what = kind
    return f"{event['run_id']}/{job}/{what}"


def body(event: dict[str, Any]) -> dict[str, Any]:
    """What is POSTed: the event under "event", with a "source" a Gateway mapping can match."""
    return {"source": SOURCE, "event": event}


def unwrap(document: Any) -> Any:
    """The event of a POSTed body, or the document itself when it is the bare event."""
    if isinstance(document, dict) and set(document) == {"source", "event"}:
        return document["event"]
    return document
