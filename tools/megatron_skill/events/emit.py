"""The emitter side: record an event in the run directory and POST it where the environment says.

Nothing here may slow or fail training: every POST has a timeout and a total deadline, a job's
start is delivered by a process of its own, errors are reported on stderr and swallowed, and the
caller always gets on. What is not delivered stays in the run's outbox, and a sender of its own
(one per outbox, outside the job) keeps trying it with a growing back-off after the emitter has
returned, until it is delivered or too old (an hour: on-event would refuse it then); any later
emitter call of the run tries it too.  Only the Python standard library is used (and the skill's
log patterns), so the job's own Python runs it.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..adapter import log as megatron_log
from ..files import read_regular, read_tail
from . import event as ev

RECORD = "events.jsonl"  # in the run directory: every event the run's emitters made, one per line
TAIL_LINES = 20


def _open_record(path: Path, flags: int, mode: int) -> int:
    """A descriptor of the run's own file at path (made where missing): never a symbolic link (an
    append would go wherever it points), a FIFO (a write would wait for a reader) or a device."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    os.set_blocking(fd, True)
    return fd


def record(run_dir: Path | None, event: dict[str, Any]) -> None:
    """Append the event to RUN_DIR/events.jsonl (one write of one line: appends of concurrent
    emitters do not interleave)."""
    if not run_dir or not Path(run_dir).is_dir():
        return
    line = (json.dumps(event, sort_keys=True, allow_nan=False) + "\n").encode()
    try:
        fd = _open_record(Path(run_dir) / RECORD, os.O_WRONLY | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as e:
        print(f"emit: cannot record the event in {run_dir}: {e.strerror}", file=sys.stderr)


# A Gateway admits a hook in 0.5 to 14 s (it starts an agent turn first): one try waits this long,
# so that a slow admission is not cut off and sent again.
TRY_TIMEOUT_S = 20.0
DEADLINE_S = 30.0  # all tries of one event at a job's end, and of the events still waiting
OUTBOX = "events.outbox.jsonl"  # in the run directory: events to deliver, and each one's outcome
OUTBOX_MAX_BYTES = 64 * 2**20
OUTBOX_MAX_AGE_S = 3600.0  # on-event refuses older events (policy.max_age_s): delivering them is moot
FUTURE_S = 300.0  # on-event refuses events dated further ahead (its clock skew): not sent either
BACKGROUND = ("job.started",)  # delivered by a process of its own: a job never waits at its start
# The sender's schedule, from the environment (a test compresses an hour into seconds with them):
RETRY_ENV = "MEGATRON_SKILL_EVENTS_RETRY_S"  # the first wait before the outbox is tried again
RETRY_MAX_ENV = "MEGATRON_SKILL_EVENTS_RETRY_MAX_S"  # the longest wait (each wait doubles until then)
MAX_AGE_ENV = "MEGATRON_SKILL_EVENTS_MAX_AGE_S"  # an event older than this is no longer sent
RETRY_S, RETRY_MAX_S = 5.0, 60.0
EMITTER = Path(__file__).resolve().parents[2] / "emit_event.py"
JOB_MARK_ENV = "MEGATRON_SKILL_JOB_MARK"  # every process of a job train runs has it (megatron_skill/watchdog.py)


# Answers that are tried again: too many requests, and a token the receiver does not take (401,
# 403), which the newest receiver settings of the run (a token changed since) may cure.
RETRIED = (401, 403, 429)


def post(event: dict[str, Any], url: str, token: str | None, deadline_s: float = DEADLINE_S,
         tries: int = 3) -> tuple[str, bool]:
    """POST the event's body: ('delivered' or why not, whether that is final). The event id is
    the Idempotency-Key, so a receiver answers a retry as the first try (OpenClaw gives it the
    same run). Retries server errors, unreachable receivers and RETRIED answers with a short
    back-off until tries or the deadline run out; any other refusal (4xx) is final. A receiver
    that accepts and never answers costs at most deadline_s."""
    data = json.dumps(ev.body(event), allow_nan=False).encode()
    headers = {"Content-Type": "application/json", "User-Agent": "megatron-skill-events/1",
               "Idempotency-Key": event["event_id"]}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    end = time.monotonic() + deadline_s
    why = "not sent"
    for attempt in range(tries):
        left = end - time.monotonic()
        if left <= 0.05:
            break
        try:
            req = urllib.request.Request(url, data=data, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=min(TRY_TIMEOUT_S, left)) as resp:
                return ("delivered", True) if 200 <= resp.status < 300 else (f"HTTP {resp.status}", True)
        except urllib.error.HTTPError as e:
            why = f"HTTP {e.code}"
            if e.code < 500 and e.code not in RETRIED:
                return why, True
        except (urllib.error.URLError, OSError, ValueError) as e:
            why = str(getattr(e, "reason", e))
        if attempt + 1 < tries:
            time.sleep(max(0.0, min(0.5 * 2 ** attempt, end - time.monotonic())))
    return why, False


# ---- the outbox: what is still to be delivered, kept across emitter calls ---------------------
def _append(path: Path, record: dict[str, Any]) -> None:
    """One line appended and flushed to disk (a crash right after still has it)."""
    fd = _open_record(path, os.O_WRONLY | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def queue(run_dir: Path, event: dict[str, Any]) -> None:
    _append(run_dir / OUTBOX, {"event": event})


def waiting(run_dir: Path, now: float | None = None, max_age_s: float | None = None) -> list[dict[str, Any]]:
    """The outbox's events with no outcome yet, younger than max_age_s (MEGATRON_SKILL_EVENTS_MAX_AGE_S,
    an hour by default) and not dated ahead of this clock by more than FUTURE_S, oldest first."""
    now = time.time() if now is None else now
    max_age_s = schedule()[2] if max_age_s is None else max_age_s
    try:
        lines = read_regular(run_dir / OUTBOX, OUTBOX_MAX_BYTES).decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    queued, done = {}, set()
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line cut by a crash
        if isinstance(record, dict) and isinstance(record.get("event"), dict):
            if isinstance(record["event"].get("event_id"), str):
                queued.setdefault(record["event"]["event_id"], record["event"])
        elif isinstance(record, dict) and isinstance(record.get("done"), str):
            done.add(record["done"])
    return [e for i, e in queued.items() if i not in done and _young(e, now, max_age_s)]


def _young(event: dict[str, Any], now: float, max_age_s: float) -> bool:
    try:
        return -FUTURE_S < now - ev.parse_time(event["time"]) < max_age_s
    except (KeyError, TypeError, ValueError, OverflowError):
        return False


def _seconds(env: dict[str, str], name: str, default: float, low: float, high: float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:  # NaN fails both
        print(f"emit: {name}={text[:40]!r} is not a number of seconds from {low:g} to {high:g}; "
              f"{default:g} is used", file=sys.stderr)
        return default
    return value


def schedule(env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """The background sender's schedule: (first wait, longest wait, the age at which an event is
    no longer sent), from MEGATRON_SKILL_EVENTS_RETRY_S, _RETRY_MAX_S and _MAX_AGE_S (5 s, 60 s,
    an hour by default; a value that is not a number in range is replaced by its default)."""
    env = os.environ if env is None else env
    first = _seconds(env, RETRY_ENV, RETRY_S, 0.05, 3600.0)
    longest = max(first, _seconds(env, RETRY_MAX_ENV, RETRY_MAX_S, 0.05, 3600.0))
    return first, longest, _seconds(env, MAX_AGE_ENV, OUTBOX_MAX_AGE_S, 1.0, 7 * 86400.0)


def _lock(path: Path, wait_s: float):
    """An open file of path holding its exclusive flock, or None when another process held it for
    all of wait_s (0: do not wait)."""
    import fcntl

    try:
        handle = os.fdopen(_open_record(path, os.O_RDWR, 0o600), "rb")
    except OSError as e:
        print(f"emit: no lock at {path}: {e.strerror or e}", file=sys.stderr)
        return None
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except OSError:
            if time.monotonic() >= end:
                handle.close()
                return None
            time.sleep(0.05)


def flush(run_dir: Path, url: str, token: str | None, deadline_s: float = DEADLINE_S,
          tries: int = 3) -> dict[str, str]:
    """Deliver what waits in the run's outbox, oldest first, within deadline_s; each outcome
    (delivered, or refused) is appended. {event_id: status} for those tried. Delivery from one
    outbox is one process at a time: another that delivers now is waited for (within deadline_s),
    so that an event is never POSTed by two at once and an outcome is read before the next try."""
    end = time.monotonic() + deadline_s
    tried: dict[str, str] = {}
    lock = _lock(run_dir / (OUTBOX + ".lock"), deadline_s)
    if lock is None:
        return tried
    with lock:
        for event in waiting(run_dir):
            left = end - time.monotonic()
            if left <= 0.05:
                break
            status, final = post(event, url, token, left, tries)
            tried[event["event_id"]] = status
            if final:
                _append(run_dir / OUTBOX, {"done": event["event_id"], "outcome": status})
    return tried


# ---- the background sender: keeps trying after the emitter has gone ------------------------------
SENDER_LOCK = OUTBOX + ".sender"  # held by the one sender of the outbox for as long as it runs
# The receiver (URL and token) the newest emitter call of the run was given, mode 0600: the sender
# reads it before each round, so that it delivers where the run's emitters now send (a Gateway that
# moved, a token that changed, the Slurm trigger's settings on the controller), not where it was
# pointed when it started an hour ago.
RECEIVER = OUTBOX + ".receiver"
RECEIVER_MAX_BYTES = 16 * 1024


def remember_receiver(run_dir: Path, url: str, token: str | None) -> None:
    """Keep the receiver this emitter call was given beside the outbox (written atomically, mode
    0600, never through a link), unless it is what is kept already."""
    if receiver(run_dir) == (url, token):
        return
    path = Path(run_dir) / RECEIVER
    tmp = path.with_name(f".{RECEIVER}.{os.getpid()}.{random.randrange(1 << 30)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps({"url": url, "token": token}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)   # replaces a link at path itself, never what it points to
    except OSError as e:
        print(f"emit: cannot keep the receiver beside the outbox ({e.strerror or e}); its sender keeps "
              "the one it was started with", file=sys.stderr)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def receiver(run_dir: Path) -> tuple[str, str | None] | None:
    """The receiver kept beside the outbox (URL, token), or None where there is none this process
    may trust: a link, anything but a regular file, a file of another user or that others may
    write (it decides where the events and the token go), or one of another shape."""
    try:
        fd = os.open(Path(run_dir) / RECEIVER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            return None
        raw = os.read(fd, RECEIVER_MAX_BYTES + 1)
        if len(raw) > RECEIVER_MAX_BYTES:
            return None
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or not isinstance(data.get("url"), str) or not data["url"]:
        return None
    token = data.get("token")
    return (data["url"], token) if token is None or isinstance(token, str) else None


def sending(run_dir: Path) -> bool:
    """Whether a sender of this outbox runs now."""
    from ..locks import FileLock

    return FileLock(run_dir / SENDER_LOCK).held_elsewhere()


def deliver(run_dir: Path, url: str, token: str | None, env: dict[str, str] | None = None,
            say=lambda message: print(message, file=sys.stderr)) -> str:
    """Keep delivering the run's outbox until nothing waits in it: one try of each waiting event
    per round, rounds apart by a wait that starts at MEGATRON_SKILL_EVENTS_RETRY_S and doubles up
    to _RETRY_MAX_S (back to the first after a round that delivered something), for at most
    _MAX_AGE_S (by then every event it holds is too old to send). Each round goes to the receiver
    the run's newest emitter call was given (RECEIVER), else to url and token. One sender per
    outbox: where another runs, this one leaves it the work. Answers why it stopped."""
    first, longest, max_age = schedule(env)
    end = time.monotonic() + max_age
    wait = first
    to = (url, token)
    while True:
        lock = _lock(run_dir / SENDER_LOCK, 0)
        if lock is None:
            return "another sender delivers this outbox"
        with lock:
            while True:
                left = waiting(run_dir, max_age_s=max_age)
                if not left:
                    break
                if time.monotonic() >= end:
                    return f"{len(left)} event(s) not delivered in {max_age:g} s; left in the outbox"
                now = receiver(run_dir) or (url, token)
                if now != to:
                    say(f"emit: the run's emitters now send to {now[0]}" + (" with another token" if now[1] != to[1]
                                                                           else "") + ": delivering there")
                    to, wait = now, first
                for event_id, status in flush(run_dir, to[0], to[1], min(DEADLINE_S, end - time.monotonic()),
                                              tries=1).items():
                    say(f"emit: {event_id}: {status}")
                still = waiting(run_dir, max_age_s=max_age)
                if not still:
                    break
                wait = first if len(still) < len(left) else wait
                time.sleep(max(0.0, min(wait * random.uniform(1.0, 1.25), end - time.monotonic())))
                wait = min(longest, wait * 2)
        # The lock is given up: an event queued after the last look is taken again, unless a sender
        # started meanwhile has it.
        if not waiting(run_dir, max_age_s=max_age):
            return "the outbox is delivered"
        if time.monotonic() >= end:
            return f"events left in the outbox after {max_age:g} s"


def start_sender(run_dir: Path, env: dict[str, str] | None = None) -> bool:
    """Start the outbox's sender, a process of its own outside the job (emit_event.py deliver),
    unless one runs. Whether one was started."""
    if sending(run_dir):
        return False
    # Not one of the job's processes: without the job's mark, stopping the job leaves it delivering.
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != JOB_MARK_ENV}
    subprocess.Popen([sys.executable, str(EMITTER), "deliver", "--run-dir", str(run_dir)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, env=env)
    return True


def emit(event: dict[str, Any], run_dir: Path | None, env: dict[str, str] | None = None,
         deadline_s: float = DEADLINE_S) -> dict[str, Any]:
    """Sign, record and (where MEGATRON_SKILL_EVENTS_URL is set) deliver one event: through the
    run's outbox, with the events earlier calls could not deliver; a start in the background."""
    env = os.environ if env is None else env
    secret = ev.secret_from_env(env)
    signed = ev.sign(event, secret)
    if len(ev.canonical(signed)) > ev.MAX_BYTES and "details" in signed:
        signed = ev.sign({**event, "details": {k: v for k, v in event["details"].items() if k != "log_tail"}}, secret)
    record(run_dir, signed)
    url = env.get(ev.URL_ENV)
    if not url:
        return {"event": signed, "delivery": "no receiver (MEGATRON_SKILL_EVENTS_URL unset)"}
    if signed["type"] in skipped(env):
        return {"event": signed, "delivery": f"recorded only ({ev.SKIP_ENV})"}
    if run_dir and Path(run_dir).is_dir():
        remember_receiver(Path(run_dir), url, env.get(ev.TOKEN_ENV))
    status = _deliver(signed, Path(run_dir) if run_dir else None, url, env, deadline_s)
    print(f"emit: {signed['type']} {signed['event_id']}: {status}", file=sys.stderr)
    return {"event": signed, "delivery": status}


def skipped(env: dict[str, str]) -> set[str]:
    """The event types the user does not want to wake an agent for (MEGATRON_SKILL_EVENTS_SKIP,
    comma-separated, e.g. job.started,checkpoint.saved): recorded in the run, never POSTed."""
    return {t.strip() for t in env.get(ev.SKIP_ENV, "").split(",") if t.strip()}


def _deliver(signed: dict[str, Any], run_dir: Path | None, url: str, env: dict[str, str], deadline_s: float) -> str:
    token = env.get(ev.TOKEN_ENV)
    if not run_dir or not run_dir.is_dir():
        return post(signed, url, token, deadline_s)[0]
    try:
        queue(run_dir, signed)
    except OSError as e:
        print(f"emit: no outbox in {run_dir}: {e.strerror}; sending once", file=sys.stderr)
        return post(signed, url, token, deadline_s)[0]
    if signed["type"] in BACKGROUND:
        start_sender(run_dir, env)
        return "queued: delivering in the background"
    status = flush(run_dir, url, token, deadline_s).get(signed["event_id"], "queued: another emitter delivers it")
    if waiting(run_dir, max_age_s=schedule(env)[2]):
        start_sender(run_dir, env)
        if status != "delivered":
            status += "; a sender of its own keeps trying"
    return status


# ---- what a job's end says --------------------------------------------------------------
def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def tail(log: Path | None, lines: int = TAIL_LINES) -> list[str]:
    """The last lines of the log (read from its end: a log can be large)."""
    if not log:
        return []
    try:
        text = read_tail(log, 64 * 1024).decode("utf-8", errors="replace")
    except OSError:
        return []
    return [ln[:500] for ln in text.splitlines() if ln.strip()][-lines:]


def ending(exit_code: int, log: Path | None) -> dict[str, Any]:
    """The details of a job's end: exit code, the signal that ended it (from the status: a
    shell reports 128+N, Python's subprocess -N; or from torchrun's summary in the log), the
    known failure the log's end shows, and its last lines."""
    details: dict[str, Any] = {"exit_code": max(-255, min(255, exit_code))}
    sig = -exit_code if exit_code < 0 else exit_code - 128 if 128 < exit_code < 160 else None
    lines = tail(log)
    text = "\n".join(lines)
    if sig is None:
        m = re.search(r"Signal (\d+) \(SIG[A-Z]+\) received|exitcode\s*:\s*-(\d+)", text)
        sig = int(m.group(1) or m.group(2)) if m else None
    name = _signal_name(sig) if sig else None
    if name:
        details["signal"] = name
    for code, pattern, *_ in megatron_log.FAILURES:
        if pattern.search(text):
            details["failure"] = code
            break
    if exit_code and lines:
        details["log_tail"] = lines
    return details


# ---- the log watcher ---------------------------------------------------------------------
class Watcher:
    """Reads a growing training log and says what deserves an event: a checkpoint saved, a NaN
    or spiking loss, a throughput drop, a node or NCCL failure, and a stall (no new iteration
    for stall_s, or for twenty logging intervals when that is longer). Each is said once per
    episode: a stall again only after iterations came back."""

    def __init__(self, stall_s: float = 600.0):
        self.stall_s = stall_s
        self.losses: list[float] = []
        self.iter_ms: list[float] = []
        self.slow = 0
        self.last_progress = time.monotonic()
        self.last_iteration: int | None = None
        self.said: set[str] = set()

    def line(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        saved = megatron_log.CHECKPOINT_SAVED.search(text)
        if saved:
            details: dict[str, Any] = {"checkpoint_iteration": int(saved.group(1))}
            if self.losses:
                details["loss"] = self.losses[-1]
            out.append(("checkpoint.saved", details))
        for code, pattern, *_ in megatron_log.FAILURES:
            if code in ("node_failure", "nccl_timeout", "nccl_error") and pattern.search(text) and code not in self.said:
                self.said.add(code)
                out.append(("node.failure", {"failure": code, "message": text.strip()[:1000],
                                             **self._at()}))
        rec = megatron_log.parse_iteration(text) if "iteration" in text else None
        if not rec:
            return out
        self.last_progress = time.monotonic()
        self.said.discard("training.stalled")
        self.last_iteration = rec["iteration"]
        out += self._loss(rec) + self._speed(rec)
        return out

    def _at(self) -> dict[str, Any]:
        return {"iteration": self.last_iteration} if self.last_iteration is not None else {}

    def _loss(self, rec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        loss = rec.get("loss")
        if loss is None:
            return []
        if loss != loss or loss in (float("inf"), float("-inf")):
            if "nan" in self.said:
                return []
            self.said.add("nan")
            return [("loss.anomaly", {"iteration": rec["iteration"], "loss": str(loss).lower(),
                                      "message": "the loss is not a number"})]
        base = megatron_log.spike_base(self.losses[-5:], loss)
        self.losses.append(loss)
        if base is None:
            self.said.discard("spike")
            return []
        if "spike" in self.said:
            return []
        self.said.add("spike")
        return [("loss.anomaly", {"iteration": rec["iteration"], "loss": loss, "before": base,
                                  "message": "loss spike"})]

    def _speed(self, rec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        ms = rec.get("iter_ms")
        if ms is None:
            return []
        self.iter_ms.append(ms)
        steady = self.iter_ms[1:-1]  # the first interval holds compilation and warm-up
        if len(steady) < 5:
            return []
        typical = sorted(steady[-50:])[len(steady[-50:]) // 2]
        self.slow = self.slow + 1 if ms > 1.5 * typical else 0
        if self.slow < 3:
            self.said.discard("slow")
            return []
        if "slow" in self.said:
            return []
        self.said.add("slow")
        return [("throughput.drop", {"iteration": rec["iteration"], "iter_ms": ms, "before": typical,
                                     "message": "three logging intervals in a row took half as long again"})]

    def idle(self) -> list[tuple[str, dict[str, Any]]]:
        """Called when no line came: a stall once the silence is long enough."""
        if self.last_iteration is None or "training.stalled" in self.said:
            return []
        interval = (sorted(self.iter_ms)[len(self.iter_ms) // 2] / 1e3) if self.iter_ms else 0.0
        silent = time.monotonic() - self.last_progress
        if silent < max(self.stall_s, 20 * interval):
            return []
        self.said.add("training.stalled")
        return [("training.stalled", {"iteration": self.last_iteration, "silent_s": round(silent, 1)})]


def _alive(pid: int) -> bool:
    """Whether the process runs: a zombie (ended, not yet reaped by a parent that may itself be
    waiting for this watcher's output to close) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def watch(log: Path, pid: int, on_event, stall_s: float = 600.0, poll_s: float = 2.0) -> None:
    """Follow log (from its current end: a resumed run does not report its earlier life again)
    until process pid is gone, or until this process is asked to stop (SIGTERM: the job ended and
    its launcher stops the watcher); on_event(kind, details) for each thing worth an event. Either
    way the log is read to its end first: a checkpoint or a failure written just before the job
    died is still reported."""
    stopping = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    watcher = Watcher(stall_s)
    offset = log.stat().st_size if log.exists() else 0
    partial = b""
    while True:
        alive = _alive(pid) and not stopping.is_set()
        try:
            size = log.stat().st_size
            if size < offset:  # the log was replaced: read the new one from its start
                offset, partial = 0, b""
            with open(log, "rb") as f:
                f.seek(offset)
                chunk = f.read(1 << 20)
                offset += len(chunk)
        except OSError:
            chunk = b""
        lines = (partial + chunk).split(b"\n")
        partial = lines.pop()
        found = [e for raw in lines for e in watcher.line(raw.decode("utf-8", errors="replace"))]
        if not lines:
            found = watcher.idle()
        for kind, details in found:
            on_event(kind, details)
        if not alive and not chunk:
            for kind, details in watcher.line(partial.decode("utf-8", errors="replace")) if partial else []:
                on_event(kind, details)   # a last line the job had no time to end
            return
        if not chunk:
            stopping.wait(poll_s)   # a stop ends the wait at once
