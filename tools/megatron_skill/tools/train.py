"""The train tool: run Megatron training for a request, in a run directory named by its id.

On GPUs it renders the launch script (render) into the run directory and runs it: torchrun
on this machine, or sbatch with launcher slurm.  Without a GPU it runs the same model
code (Megatron-Core's GPTModel, the skill's layer spec) in a small CPU loop with gloo, for
tiny models.  Progress (iteration, loss, tokens/s, ETA) goes to stderr as the log grows.

The same request never starts a second job: a running one is refused; a finished one
returns its recorded result; a killed or failed one continues from its last checkpoint.
The job's start and end are training events (references/events.md).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .. import files, watchdog
from ..adapter import log as megatron_log
from ..contract import Context, Tool, invoke, request_fields
from ..core.catalog import gpu_by_device_name
from ..core.resolve import DEFAULT_TRAIN_ITERS
from ..data.datasets import check_datasets
from ..environment import gpu_count_and_name, have_transformer_engine
from ..errors import ToolError
from ..events import settle
from ..locks import write_atomic
from ..runs import RunLock, latest_checkpoint, read_state, write_state

EMITTER = Path(__file__).resolve().parents[2] / "emit_event.py"


def _backend(req: dict) -> str:
    if req["backend"] != "auto":
        return req["backend"]
    return "gpu" if gpu_count_and_name()[0] else "cpu"


def _progress_line(rec: dict, started: float, seq: int | None) -> str:
    it, total = rec["iteration"], rec["train_iters"]
    parts = [f"iter {it}/{total}"]
    if "loss" in rec:
        parts.append(f"loss {rec['loss']:.4f}")
    if rec.get("iter_ms") and rec.get("global_batch_size") and seq:  # 0 ms: a log line too coarse to say
        parts.append(f"{rec['global_batch_size'] * seq / (rec['iter_ms'] / 1e3):,.0f} tokens/s")
        eta = (total - it) * rec["iter_ms"] / 1e3
        parts.append(f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")
    if "tflops_per_gpu" in rec:
        parts.append(f"{rec['tflops_per_gpu']:.0f} TFLOP/s/GPU")
    return "train: " + " | ".join(parts) + f" ({time.time() - started:.0f}s)"


def stream(cmd: list[str], log_path: Path | None, ctx: Context, seq: int | None, env: dict | None = None,
           cwd: Path | None = None, keep_fds: tuple[int, ...] = (), run_dir: Path | None = None) -> int:
    """Run cmd, show progress from Megatron's iteration lines; append its output to log_path
    (None when the command keeps its own log, as the rendered scripts do).

    The job runs in a process group of its own, its processes marked (watchdog.py), and
    all of it is stopped: when its leader ends while some of its processes still run (a kill of
    torchrun leaves its workers, which have sessions of their own), and when this process dies,
    by a watchdog process that then reports the job's end for run_dir. keep_fds (the run lock)
    are inherited, so the lock stays held for as long as the job's leader lives."""
    import signal
    import threading
    import uuid

    started = time.time()
    mark = uuid.uuid4().hex
    with (open(log_path, "a") if log_path else open(os.devnull, "w")) as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {}), watchdog.MARK_ENV: mark}, cwd=cwd, bufsize=1,
                                start_new_session=True, pass_fds=keep_fds)
        read_end, write_end = os.pipe()
        guard = subprocess.Popen([sys.executable, watchdog.__file__, str(proc.pid), mark, str(run_dir or "")],
                                 stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
        os.close(read_end)

        def leftovers() -> None:  # the leader ended: whatever of the job still runs is stopped
            proc.wait()
            if watchdog.stop(None, mark, grace_s=10.0):
                ctx.progress("train: the job's leader ended while some of its processes ran on; stopped them")

        threading.Thread(target=leftovers, daemon=True).start()
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()  # others (logs, a watcher) read the file while it grows
                rec = megatron_log.parse_iteration(line) if "iteration" in line else None
                if rec and "loss" in rec:
                    ctx.progress(_progress_line(rec, started, seq))
            return proc.wait()
        except KeyboardInterrupt:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        finally:
            with contextlib.suppress(OSError):  # this process saw the job end (or stops it): nothing to report
                os.write(write_end, b"ended")
            os.close(write_end)
            guard.wait()


def run(req: dict, ctx: Context) -> dict[str, Any]:
    given = req
    backend, req = _checked_request(req)
    run_id = ctx.request_id
    runs_root = files.output_folder(req["runs_root"], "/runs_root", "runs_root folder")
    run_dir = files.output_folder(runs_root / run_id, "/runs_root", "run folder").resolve()
    check_datasets(req["training"])
    if req["training"].get("pretrained"):  # the job runs here, in its run folder: a folder here, made absolute
        start = files.folder(Path(req["training"]["pretrained"]).absolute(), "/training/pretrained",
                             "checkpoint folder")
        from ..convert.checkpoint import iteration_dir
        from ..pickles import scan_checkpoint

        scan_checkpoint(iteration_dir(start), "/training/pretrained")  # Megatron unpickles what it loads
        req = {**req, "training": {**req["training"], "pretrained": str(start)}}
    if backend == "cpu":
        from ..runtime.cpu_run import plan_cpu_run
        plan = plan_cpu_run(req, run_dir, run_id)
    else:
        plan = _plan_gpu_run(req, ctx, run_dir)
    if ctx.dry_run:
        return _dry_run_answer(req, run_dir, run_id, backend, plan)
    files.make_folder(run_dir, "/runs_root", "run folder")
    lock = RunLock(run_dir).acquire()  # conflict while another process runs this request
    try:
        return _run_locked(given, req, ctx, run_dir, backend, plan, lock.fd)
    finally:
        lock.release()


def _checked_request(req: dict) -> tuple[str, dict]:
    """The backend the run takes, and the request with what this machine decides filled in (the
    Python, the GPU count, the iterations); an error for what the backend cannot run."""
    if req["launcher"] not in ("torchrun", "slurm"):
        raise ToolError("bad_request", f"train runs jobs from here (torchrun on this machine, or sbatch); "
                        f"{req['launcher']} is started elsewhere", where="/launcher",
                        fix="render the script or manifest and start it where it runs (render's command says how)")
    backend = _backend(req)
    if backend == "cpu":
        _refuse_gpu_options(req)
    req = {**req, "python": req.get("python") or sys.executable}
    _check_runtime(req, backend)
    if req.get("num_gpus") is None and req.get("nodes") is None:
        req = {**req, "num_gpus": max(1, gpu_count_and_name()[0])}
    req = {**req, "training": {**req["training"], "train_iters": req["training"].get("train_iters")
                               or DEFAULT_TRAIN_ITERS[backend]}}
    # A CPU run is a trial of a tiny model: Megatron's mock data unless it is given data. A GPU run
    # is training: its data is asked for, or mock data by name.
    if backend == "gpu" and not req["training"].get("data_path") and not req["training"].get("mock_data"):
        raise ToolError("bad_request", "no training data given for a GPU run", where="/training",
                        fix="give training.data_path (prepare-data makes a dataset from JSONL) with "
                            "training.tokenizer_model, or training.mock_data true for Megatron's mock data (trials, "
                            "benchmarks)")
    return backend, req


def _refuse_gpu_options(req: dict) -> None:
    """What only a GPU run has, asked of the CPU backend: an error, not a run without it."""
    if req.get("moe"):
        raise ToolError("bad_request", "the CPU backend runs Megatron's allgather dispatcher and none of the MoE "
                        "options (they are GPU paths: the all-to-all, grouped GEMMs, the capacity padding)",
                        where="/moe", fix="leave moe out for a CPU run, or train on GPUs (backend gpu)")
    if any((req.get("megatron_options") or {}).values()):
        raise ToolError("bad_request", "the CPU backend's own loop runs none of Megatron's memory options (bf16 "
                        "gradient reduction, FP8 weight gather, Megatron-FSDP, the fused cross-entropy)",
                        where="/megatron_options", fix="leave megatron_options out for a CPU run, or train on GPUs")


def _dry_run_answer(req: dict, run_dir: Path, run_id: str, backend: str, plan: dict) -> dict[str, Any]:
    """What a run of the request would do from the run folder's state, nothing launched."""
    if RunLock(run_dir).held_elsewhere():
        raise RunLock(run_dir).running()
    state, ckpt = read_state(run_dir), latest_checkpoint(run_dir / "checkpoints")
    finished = bool(state and state.get("status") == "finished")
    return {"run_id": run_id, "run_dir": str(run_dir), "backend": backend, "dry_run": True,
            "start": "finished" if finished else _start(state, ckpt), "resume_from": ckpt,
            "train_iters": req["training"]["train_iters"], "estimated_seconds": plan.get("estimated_seconds"),
            "actions": ["return the recorded result; nothing is launched"] if finished else plan["actions"],
            "layout": plan.get("layout"), "prediction": plan.get("prediction"),
            **({"runtime": plan["runtime"]} if plan.get("runtime") else {}),
            **({"pretrained": plan["pretrained"]} if plan.get("pretrained") else {})}


def _run_locked(given: dict, req: dict, ctx: Context, run_dir: Path, backend: str, plan: dict,
                lock_fd: int) -> dict[str, Any]:
    """The run, under the run folder's lock (lock_fd, which the job inherits): the recorded result
    of a finished run, or a new, restarted or resumed attempt to its end."""
    run_id = ctx.request_id
    events = None
    try:
        state, ckpt = _last_attempt(run_dir, ctx)
        if state and state.get("status") == "finished":
            ctx.progress(f"train: run {run_id} already finished; returning its result (nothing launched)")
            return {**state["result"], "already_finished": True}
        start = _start(state, ckpt)
        attempt = int((state or {}).get("attempts", 0))
        # The request as it came (its id is this run's name): `train --request RUN_DIR/request.json
        # --resume` is the same request again, which on-event's resume relies on.
        write_atomic(run_dir / "request.json", json.dumps(given, indent=1, sort_keys=True))
        write_state(run_dir, status="running", run_id=run_id, backend=backend, request=req, start=start,
                    resumed_from=ckpt, attempts=attempt + 1, job_id=f"{run_id}.{attempt}", gpu=plan.get("gpu"),
                    layout=plan.get("layout"), cwd=os.getcwd())  # where its relative paths start
        plan["write"]()
        log_path = run_dir / "logs" / "train.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        ctx.progress(f"train: run {run_id} in {run_dir} ({backend}, {_START_TEXT[start].format(ckpt=ckpt)}); "
                     f"{req['training']['train_iters']} iterations; log {log_path}")
        events = JobEvents(run_dir, run_id, f"{run_id}.{attempt}", plan.get("layout"), log_path,
                           scheduler="slurm" if req["launcher"] == "slurm" and backend == "gpu" else "local")
        events.started(watch=backend == "cpu")  # a rendered script reports its own start and watches its log
        rc = stream(plan["command"], None if backend == "gpu" else log_path, ctx, plan["seq_length"],
                    env={**(plan.get("env") or {}), "MEGATRON_SKILL_JOB_ID": events.job_id}, cwd=run_dir,
                    keep_fds=(lock_fd,), run_dir=run_dir)
        events.ended(rc)
        result = _result(run_id, run_dir, backend, rc, start, ckpt, log_path, plan)
        if rc != 0:
            write_state(run_dir, status="failed", returncode=rc)
            _raise_failure(rc, result, log_path)
        write_state(run_dir, status="finished", result=result)
        return result
    except KeyboardInterrupt:
        write_state(run_dir, status="killed")
        if events:
            events.ended(130)
        raise


def _last_attempt(run_dir: Path, ctx: Context) -> tuple[dict | None, int | None]:
    """The run's state and its last checkpoint; an attempt still marked running (its train died:
    the lock was free) has its job's end reported first."""
    state, ckpt = read_state(run_dir), latest_checkpoint(run_dir / "checkpoints")
    if ckpt is not None:  # what the resume unpickles, read first: a file put into the run folder could run code
        from ..pickles import scan_checkpoint

        scan_checkpoint(run_dir / "checkpoints" / f"iter_{ckpt:07d}", "/runs_root")
    if state and state.get("status") == "running":
        ended = settle.report(run_dir, locked=True)
        if ended:
            ctx.progress(f"train: the last attempt's train stopped before its job's end; reported it "
                         f"({ended['type']} of job {ended['job']['job_id']})")
        state = read_state(run_dir)
    return state, ckpt


def _result(run_id: str, run_dir: Path, backend: str, rc: int, start: str, ckpt: int | None, log_path: Path,
            plan: dict) -> dict[str, Any]:
    """The attempt's answer, read from its log: its summary, the loss curve's end, and for a run
    from pretrained weights what was loaded and the first loss (logged with log_interval 1)."""
    parsed = megatron_log.parse(log_path.read_text(errors="replace").splitlines())
    summary = megatron_log.summarize(parsed, plan["seq_length"], plan.get("peak_tflops"))
    result = {"run_id": run_id, "run_dir": str(run_dir), "backend": backend, "returncode": rc,
              "start": start, "resumed_from": ckpt if start == "resume" else None,
              "log": str(log_path), "checkpoint_iteration": latest_checkpoint(run_dir / "checkpoints"),
              "layout": plan.get("layout"), "prediction": plan.get("prediction"),
              **({"runtime": plan["runtime"]} if plan.get("runtime") else {}),
              "summary": {k: v for k, v in summary.items() if k not in ("loss_curve", "lr_curve")},
              "loss_curve": summary.get("loss_curve", [])[-50:]}
    if plan.get("pretrained"):  # what was loaded, and the tokens of the first loss (to check it)
        first = run_dir / "first_batch-dp0.pt"
        logged = dict((int(i), loss) for i, loss in summary.get("loss_curve") or [])
        result["pretrained"] = {**plan["pretrained"], "first_loss": logged.get(1),
                                "first_batch": str(first) if first.exists() else None}
    return result


def _raise_failure(rc: int, result: dict, log_path: Path) -> None:
    """A failed attempt as the answer's error: the first failure the log names, with its fix."""
    failures = result["summary"].get("failures")
    failure = failures[0] if failures else None
    raise ToolError("runtime", f"training exited with status {rc}"
                    + (f": {failure['meaning']}" if failure else ""), where=str(log_path),
                    fix=(failure["fix"] if failure else "read the end of the log; the same request "
                         "again continues from the last checkpoint (or starts over without one)"),
                    details={"result": result, "log_tail": _log_tail(log_path)})


class JobEvents:
    """The train tool as an emitter of its job's events (references/events.md): start and end of
    the job, and for CPU runs the log watcher (a rendered script runs its own). Each is sent by
    a process of its own, so that a slow receiver never holds up the job or this tool."""

    def __init__(self, run_dir: Path, run_id: str, job_id: str, layout: dict | None, log: Path, scheduler: str):
        self.job_id, self.watcher, self.log_dir = job_id, None, log.parent
        keys = ("tp", "pp", "vp", "cp", "ep", "dp", "mbs", "gbs", "seq_length")
        self.base = [sys.executable, str(EMITTER), "--run-id", run_id, "--run-dir", str(run_dir), "--request-id",
                     run_id, "--job-id", job_id, "--scheduler", scheduler, "--emitter", "train", "--log", str(log),
                     "--layout", json.dumps({k: v for k, v in (layout or {}).items() if k in keys})]

    def _spawn(self, command: str, *extra: str) -> subprocess.Popen:
        # Its own output file, not this tool's stderr: a caller reading that to its end must not
        # wait for a delivery to a slow receiver.
        argv = self.base[:2] + [command] + self.base[2:] + list(extra)
        with open(self.log_dir / "events.log", "ab") as out:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)

    def started(self, watch: bool) -> None:
        self._spawn("send", "--type", "job.started")
        if watch:
            self.watcher = self._spawn("watch", "--pid", str(os.getpid()), "--emitter", "watcher")

    def ended(self, rc: int) -> None:
        if self.watcher:
            self.watcher.terminate()
        self._spawn("send", "--end", "--exit-code", str(rc))


_START_TEXT = {"new": "new run", "restart": "starting over: the earlier attempt saved no checkpoint",
               "resume": "resuming from checkpoint {ckpt}"}


def _start(state: dict | None, ckpt: int | None) -> str:
    """How a run of this request begins: new; restart (an earlier attempt failed or was killed
    before its first checkpoint); resume (from its last checkpoint)."""
    if ckpt is not None:
        return "resume"
    return "restart" if state else "new"


def _check_runtime(req: dict, backend: str) -> None:
    """The Python that will run the job has torch and megatron-core: checked before anything
    is planned or written, dry-run included (a Slurm job's Python lives on the cluster)."""
    if backend == "gpu" and req["launcher"] == "slurm":
        return
    python = req["python"]
    if python == sys.executable:
        import importlib.util
        missing = [m for m in ("torch", "megatron.core") if _find_spec(importlib.util, m) is None]
    else:
        try:
            proc = subprocess.run([python, "-c", "import torch, megatron.core"], capture_output=True, timeout=120)
            missing = [] if proc.returncode == 0 else ["torch / megatron.core"]
        except (OSError, subprocess.TimeoutExpired):
            missing = [f"the Python itself ({python})"]
    if missing:
        raise ToolError("environment", f"{python} cannot import {', '.join(missing)}: train runs Megatron-Core",
                        where="/python" if python != sys.executable else "python",
                        fix="run tools/setup.sh (Python 3.12 with torch and megatron-core in .venv), then "
                            "python tools/launch.py train ... (it uses .venv's Python)")


def _find_spec(util, name: str):
    try:
        return util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _log_tail(path: Path, lines: int = 14) -> list[str]:
    """What a failed run's log says last: from its last Python traceback when there is one
    (torchrun's own failure summary after it says nothing about the cause), else the last
    lines that are not warnings."""
    try:
        text = [ln[:300] for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return []
    starts = [i for i, ln in enumerate(text) if "Traceback (most recent call last)" in ln]
    # The cause is the last traceback of a rank: skip torchrun's own (ChildFailedError), which
    # comes after it and says nothing, and "Exception ignored in" ones from destructors.
    ends = starts[1:] + [len(text)]
    from_ranks = [i for i, j in zip(starts, ends) if "ChildFailedError" not in " ".join(text[i:j])
                  and not (i > 0 and text[i - 1].startswith("Exception ignored"))]
    if starts:
        block = [re.sub(r"^\[(default)?rank\d+\]:\s?", "", ln) for ln in text[(from_ranks or starts)[-1]:]]
        end = next((i for i, ln in enumerate(block) if re.match(r"^[\w.]*(Error|Exception)\b", ln)), len(block) - 1)
        frames = block[:end + 1]
        return frames if len(frames) <= lines else frames[:2] + ["..."] + frames[-(lines - 3):]
    keep = [ln for ln in text if "Warning" not in ln and "warnings.warn" not in ln]
    return keep[-lines:]


def _plan_gpu_run(req: dict, ctx: Context, run_dir: Path) -> dict[str, Any]:
    n, name = gpu_count_and_name()
    if req["backend"] == "gpu" and n == 0 and not ctx.dry_run:
        raise ToolError("environment", "no CUDA GPU is visible here", where="/backend",
                        fix="run on a GPU machine, or train with --backend cpu and a tiny model (--model tiny-gpt)")
    # Render's own fields of this request; the script is rendered as a dry run (nothing written)
    # and written here once the run is sure to start.
    sub = {k: v for k, v in req.items() if k in request_fields("render") - {"dry_run", "output_dir", "run_dir"}}
    sub.update(output_dir=str(run_dir), run_dir=str(run_dir), run_id=ctx.request_id, dry_run=True,
               skill_home=str(EMITTER.parents[1]))  # the job runs here: the skill's own folder
    if "transformer_engine" not in sub:
        # The run goes here: plan for the layers it will really have (the local ones, with the
        # skill's fused head, take far less memory for the logits than TE's assumed path).
        sub["transformer_engine"] = have_transformer_engine()
    if name and "gpu" not in req:
        gpu = gpu_by_device_name(name)
        if gpu:
            sub["gpu"] = gpu.key
    if "gpu" not in sub:
        raise ToolError("bad_request", "no GPU is visible here to size the run for" if not name else
                        f"the GPU here ({name}) is not in the catalog", where="/gpu",
                        fix="give gpu (e.g. h100-sxm, h200), the GPU type the run is for")
    out = invoke("render", sub, ctx)
    text = out["files"][0]["content"]
    script = Path(out["files"][0]["path"])
    peak = None
    try:
        from ..core.catalog import get_gpu
        peak = get_gpu(sub.get("gpu", "h100-sxm")).bf16_dense_tflops
    except ToolError:
        pass

    def write() -> None:
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text)
        script.chmod(0o755)

    if req["launcher"] == "slurm":
        command = ["sbatch", "--wait", f"--chdir={run_dir}", str(script)]
    else:
        command = ["bash", str(script)]
    return {"actions": [f"write {script}", " ".join(shlex.quote(c) for c in command)], "write": write,
            "command": command, "seq_length": out["layout"]["seq_length"], "layout": out["layout"],
            "prediction": out["prediction"], "peak_tflops": peak, "gpu": sub["gpu"], "pretrained": out.get("pretrained")}


TOOL = Tool(name="train", summary="Run Megatron-Core training (torchrun or Slurm on GPUs; a tiny CPU "
                     "run without them) in a run directory named by the request id; resumable.", run=run)
