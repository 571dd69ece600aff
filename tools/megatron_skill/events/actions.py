"""From a training event and what the run's log and record say, the intended next steps.

Each action says what to do (commands, files), why, and whether a person must decide; whether
`on-event --apply` may carry it out is the policy's (on_event.py). Every event has one cause
(CAUSES), and each cause one action (ACTION_OF):
  node, NCCL or kill failure      -> resume: the same request again, from its last checkpoint
  out of memory                   -> relayout: the layout plan says fits with the error seen
                                     taken off, rendered, validated, and the script's diff
  NaN or a loss spike             -> rollback: stop, back to the checkpoint before it, lower LR
  stall, slowdown, other failure  -> diagnose: the log's last lines, the hung rank, what to run
  finished                        -> summary: tokens, MFU, final loss
Tools are called through the contract (plan, render, validate, logs), never around it.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from .. import files
from ..contract import ROOT, Context, invoke
from ..errors import ToolError
from ..files import read_regular
from ..runs import latest_checkpoint

LAUNCH = ROOT / "tools" / "launch.py"
ACTION_OF = {"node_failure": "resume", "nccl_timeout": "resume", "nccl_error": "resume", "killed": "resume",
             "out_of_memory": "relayout", "nan": "rollback", "loss_spike": "rollback", "stalled": "diagnose",
             "throughput_drop": "diagnose", "other_failure": "diagnose", "finished": "summary"}
CAUSES = tuple(ACTION_OF)
RESUMABLE = {c for c, a in ACTION_OF.items() if a == "resume"}
# How much a report says about why a job ended: a later report that says more (the scheduler saw
# the node die, where the trap only saw SIGKILL) decides the incident again; one that says as much
# or less is merged into it. Causes not named are 0.
SPECIFICITY = {"finished": 1, "killed": 1, "nccl_timeout": 2, "nccl_error": 2, "node_failure": 3,
               "out_of_memory": 3, "nan": 3}
MAX_RECORD_BYTES = 4 * 1024 * 1024  # a run's request.json, state.json or run.lock
# Signals that come from outside the training's arithmetic: a scheduler, a person, a dying node.
OUTSIDE_SIGNALS = {"SIGKILL", "SIGTERM", "SIGHUP", "SIGINT", "SIGBUS", "SIGUSR1", "SIGUSR2"}
SCRIPTS = ("launch.sbatch", "launch.sh", "launch_multinode.sh")


class Run:
    """What the run directory holds: the train request (request.json), its state, the launch
    script, the checkpoints, the log."""

    def __init__(self, run_dir: Path, event: dict[str, Any]):
        self.dir = run_dir
        self.request = _json(run_dir / "request.json")
        self.state = _state(_json(run_dir / "state.json") or {})
        # train's relative paths (runs_root, data) start where it ran: a resume runs from there too.
        self.cwd = self.state.get("cwd") or str(run_dir.parent.parent)
        self.script = next((run_dir / s for s in SCRIPTS if files.is_file(run_dir / s)), None)
        save = _of(_of(self.state.get("request"), dict).get("training"), dict).get("save")
        self.ckpt_dir = Path(save) if isinstance(save, str) and save and "\0" not in save else run_dir / "checkpoints"
        given = Path(event["log"]) if event.get("log") else None
        self.log = given if given and files.is_file(given) else run_dir / "logs" / "train.log"

    def checkpoints(self) -> list[int]:
        found = []
        try:
            names = os.listdir(self.ckpt_dir)
        except (OSError, ValueError):
            return []
        for name in names:
            m = re.fullmatch(r"iter_(\d{1,12})", name)
            if m and files.is_dir(self.ckpt_dir / name):
                found.append(int(m.group(1)))
        return sorted(found)


def _of(value: Any, kind: type) -> Any:
    return value if isinstance(value, kind) else kind()


# The fields of train's state.json that the actions read, by type; one of another type (a damaged or
# forged record) is left out, as if train had not written it.
STATE_FIELDS = {"cwd": str, "gpu": str, "backend": str, "status": str, "layout": dict, "request": dict,
                "result": dict}


def _state(state: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in state.items() if k not in STATE_FIELDS or isinstance(v, STATE_FIELDS[k])}
    if "layout" in out:   # numbers of a layout (seq_length, gbs) are multiplied and formatted
        out["layout"] = {k: v for k, v in out["layout"].items() if isinstance(v, int) and not isinstance(v, bool)
                         and 0 < v < 2**40}
    return out


def _json(path: Path) -> dict[str, Any] | None:
    """A record of the run (strict JSON, an object), or None for anything else."""
    return files.read_record(path)


def facts(run: Run, event: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """What the log says (the logs tool), and the run's record."""
    out: dict[str, Any] = {"run_dir": str(run.dir), "log": str(run.log), "checkpoint_iteration":
                           latest_checkpoint(run.ckpt_dir), "run_state": run.state.get("status")}
    _read_log(run, out, ctx)
    out["left_to_train"] = left_to_train(run, out)
    return out


def _read_log(run: Run, out: dict[str, Any], ctx: Context) -> None:
    if not run.log.is_file():
        out["log_missing"] = True
        return
    request: dict[str, Any] = {"log": str(run.log)}
    if run.state.get("gpu"):
        request["gpu"] = run.state["gpu"]
    if (run.state.get("layout") or {}).get("seq_length"):
        request["seq_length"] = run.state["layout"]["seq_length"]
    try:
        summary = invoke("logs", request, ctx)
    except ToolError as e:
        out["log_unreadable"] = e.message
        return
    keep = ("logged_iterations", "last_iteration", "train_iters", "final_loss", "tokens_per_s", "tflops_per_gpu", "mfu",
            "max_allocated_gib", "nan_iterations", "skipped_iterations", "hints", "prediction")
    out.update({k: summary[k] for k in keep if k in summary})
    out["log_state"] = summary.get("state")
    out["failures"] = [{k: f[k] for k in ("code", "meaning", "fix", "text", "ranks") if k in f}
                       for f in summary.get("failures", [])]
    out["anomalies"] = summary.get("anomalies", [])


def cause(event: dict[str, Any], found: dict[str, Any]) -> str:
    """Why, in one word of CAUSES: for a job's end out_of_memory, nan, a resumable failure,
    finished or other_failure; for the other events what they report."""
    kind = event["type"]
    details = event.get("details", {})
    if kind == "training.stalled":
        return "stalled"
    if kind == "throughput.drop":
        return "throughput_drop"
    if kind == "loss.anomaly":
        return "nan" if str(details.get("loss")).lower() in ("nan", "inf", "-inf") else "loss_spike"
    if kind == "job.finished":
        return "finished"
    why = _failure(kind, details, found)
    # However a job ended (a kill once its worker was done, a node or a collective failing in the
    # final save's wake), where nothing is left to train the run is finished: a resume would train
    # nothing and spend a relaunch. A NaN or loss spike stays one: its last checkpoint holds the
    # bad weights, and the rollback is a person's.
    return "finished" if why not in ("nan", "loss_spike") and trained_out(found) else why


def _whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62


def left_to_train(run: Run, found: dict[str, Any]) -> int | None:
    """How many iterations a resume would still train: the run's train_iters (its log's, else its
    request's) less the iteration it would resume from, its last checkpoint's; for a run that saves
    no checkpoints (training.checkpoint false) the log's last iteration, there being nothing to
    resume from. None where either is not known (no checkpoint yet is iteration 0)."""
    training = _of(_of(run.state.get("request"), dict).get("training"), dict) or \
        _of(_of(run.request, dict).get("training"), dict)
    total = found.get("train_iters")
    if not _whole_number(total) or not total:
        total = training.get("train_iters")
    if not _whole_number(total) or not total:
        return None
    if training.get("checkpoint") is False:
        done = found.get("last_iteration")
    else:
        done = found.get("checkpoint_iteration") or 0
    return max(0, total - done) if _whole_number(done) else None


def trained_out(found: dict[str, Any]) -> bool:
    """Whether a resume of the run would train nothing (facts' left_to_train is 0): its last
    checkpoint is at train_iters, not only its log's last iteration."""
    return found.get("left_to_train") == 0


def _failure(kind: str, details: dict[str, Any], found: dict[str, Any]) -> str:
    codes = [f["code"] for f in found.get("failures", [])]
    given = details.get("failure")
    if "out_of_memory" in codes or given == "out_of_memory":
        return "out_of_memory"
    if any(a["kind"] == "nan" for a in found.get("anomalies", [])):
        return "nan"
    for code in [given] + codes if given else codes:
        if code in RESUMABLE:
            return code
    if details.get("signal") in OUTSIDE_SIGNALS and not codes:
        return "killed"
    if kind == "node.failure":
        return "node_failure"
    return "other_failure"


def more_specific(new: str, old: str | None) -> bool:
    return old is None or SPECIFICITY.get(new, 0) > SPECIFICITY.get(old, 0)


def failure_code(found: dict[str, Any]) -> str:
    codes = [f["code"] for f in found.get("failures", [])]
    return codes[0] if codes else "no known failure in the log"


def nan_evidence(found: dict[str, Any]) -> dict[str, Any]:
    """Whether the run's own log shows the NaN an event reports: a signed event says what its
    emitter saw, the log is what the job wrote."""
    seen = [a for a in found.get("anomalies", []) if a.get("kind") == "nan"]
    if seen or found.get("nan_iterations"):
        return {"source": "log", "log": found.get("log"), "iterations": found.get("nan_iterations")
                or [a.get("iteration") for a in seen]}
    why = "the log is missing" if found.get("log_missing") else "the log shows no NaN"
    return {"source": "event only", "log": found.get("log"), "why": why}


# ---- the actions -----------------------------------------------------------------------------
def _shell(argv: list[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def resume(run: Run, why: str, exclude: list[str]) -> dict[str, Any]:
    """The same request again: train continues it from its last checkpoint with the same layout;
    a run launched from a rendered script runs that script again (under Slurm without the nodes
    given in exclude: the failed job's nodes, as Slurm wrote them)."""
    action: dict[str, Any] = {"kind": "resume", "why": why, "needs_person": False}
    excluded = ",".join(exclude)
    if run.request:
        argv = [sys.executable, str(LAUNCH), "train", "--request", str(run.dir / "request.json")]
        action["commands"] = [f"cd {shlex.quote(run.cwd)} && {_shell(argv)}"]
        action.update(argv=argv, cwd=run.cwd)
    elif run.script and run.script.suffix == ".sbatch":
        # No requeue: the skill resumes the job (a requeued copy would train beside its resume).
        argv = ["sbatch", f"--chdir={run.dir}", *([f"--exclude={excluded}"] if excluded else []), "--no-requeue",
                str(run.script)]
        action["commands"] = [_shell(argv)]
        action["argv"] = argv
        if excluded:
            action["why"] += f"; the failed job's nodes ({excluded}) are left out"
    elif run.script:
        argv = ["bash", str(run.script)]
        action["commands"] = [_shell(argv) + f" > {shlex.quote(str(run.dir / 'logs' / 'resume.out'))} 2>&1"]
        action["argv"] = argv
    else:
        action.update(needs_person=True, commands=[],
                      why=why + "; no train request or launch script in the run directory: launch the job again "
                                "as it was launched (it loads its last checkpoint)")
    return action


def _train_request(run: Run) -> dict[str, Any]:
    """The run's train request with what train had filled in (GPU count, GPU type), so that
    plan and render see the job as it ran."""
    req = dict(run.request or {})
    resolved = run.state.get("request") or {}   # a dict (Run keeps only what has train's types)
    for key in ("num_gpus", "nodes", "gpus_per_node"):
        if req.get(key) is None and resolved.get(key) is not None:
            req[key] = resolved[key]
    if not req.get("gpu") and run.state.get("gpu"):
        req["gpu"] = run.state["gpu"]
    return req


def _proposal(folder: Path, name: str, request: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(request, indent=1, sort_keys=True) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return {"path": str(folder / f"{name}-{digest}.json"), "content": text}


def relayout(run: Run, found: dict[str, Any], proposals: Path, ctx: Context) -> dict[str, Any]:
    """A layout that plan says fits once the memory the failed one was short of is counted; a run
    whose train request plan or render do not take (a damaged or hand-edited request.json) is a
    person's to look at."""
    try:
        return _relayout(run, found, proposals, ctx)
    except ToolError as e:
        return {"kind": "relayout", "needs_person": True, "why": f"out of memory, and the run's train request "
                f"({run.dir / 'request.json'}) is not one the tools take ({e.code} at {e.where}: {e.message}): "
                "run plan for this model and GPU with a smaller micro-batch or more recompute"}


def _relayout(run: Run, found: dict[str, Any], proposals: Path, ctx: Context) -> dict[str, Any]:
    """plan for the same model, GPUs and batch with headroom for the planner's error on this job
    (the GPU's memory less what was predicted, which the job went past) and 5 % more."""
    from .. import contract
    from ..core.catalog import get_gpu

    req = _train_request(run)
    if not req.get("gpu"):
        return {"kind": "relayout", "needs_person": True, "why": "out of memory, and the run's GPU type is not "
                "recorded: run plan for this model with the GPU named and a smaller micro-batch or more recompute"}
    old = run.state.get("result", {}).get("layout") or req.get("layout") or {}
    old = old if isinstance(old, dict) else {}
    render_fields = contract.request_fields("render") - {"dry_run", "output_dir", "run_dir"}
    old_render = invoke("render", {**{k: v for k, v in req.items() if k in render_fields}, "dry_run": True,
                                   "run_id": run.dir.name, "output_dir": str(run.dir), "run_dir": str(run.dir)}, ctx)
    capacity = get_gpu(req["gpu"]).memory_gib
    predicted = old_render["prediction"]["peak_gib"]
    headroom = round(max(0.0, capacity - predicted) + 0.05 * capacity, 2)
    plan_fields = contract.request_fields("plan")
    plan_req = {k: v for k, v in req.items() if k in plan_fields}
    plan_req.update(top=3, headroom_gib=headroom)
    try:
        plans = invoke("plan", plan_req, ctx)["plans"]
    except ToolError as e:
        return {"kind": "relayout", "needs_person": True, "why": f"out of memory, and no layout of this model on these "
                f"GPUs fits with {headroom} GiB kept free: {e.message}; more GPUs, a shorter sequence or a smaller "
                "batch"}
    best = plans[0]
    layout = {k: v for k, v in best["layout"].items() if k not in ("world_size", "expert_dp", "num_microbatches")}
    training = dict(req.get("training") if isinstance(req.get("training"), dict) else {})
    if training.get("checkpoint", True) and not training.get("save"):
        training["save"] = str(run.ckpt_dir)  # the new layout continues from this run's checkpoints
    new_req = {**{k: v for k, v in req.items() if k not in ("resume", "dry_run")}, "layout": layout,
               "training": training, "backend": "gpu"}
    proposal = _proposal(proposals, "relayout", new_req)
    new_render = invoke("render", {**{k: v for k, v in new_req.items() if k in render_fields}, "dry_run": True}, ctx)
    text = new_render["files"][0]["content"]
    check = invoke("validate", {"script_text": text, "gpu": req["gpu"]}, ctx)
    try:
        old_text = read_regular(run.script, MAX_RECORD_BYTES).decode("utf-8", "replace") if run.script else None
    except OSError:
        old_text = None
    old_text = old_render["files"][0]["content"] if old_text is None else old_text
    diff = "".join(difflib.unified_diff(old_text.splitlines(True), text.splitlines(True), "before", "after", n=1))
    argv = [sys.executable, str(LAUNCH), "train", "--request", proposal["path"]]
    return {"kind": "relayout", "cwd": run.cwd, "needs_person": False,
            "why": (f"out of memory with {old_render['label']} (predicted {predicted} GiB of {capacity} GiB): "
                    f"{best['label']} is predicted at {best['memory']['peak_gib']} GiB, within the GPU less "
                    f"{headroom} GiB kept free for the planner's error on this job; it continues from the "
                    "run's checkpoints (torch_dist checkpoints load into another layout)"),
            "layout": {"from": old or old_render["layout"], "to": best["layout"], "from_label": old_render["label"],
                       "to_label": best["label"]},
            "request": new_req, "files": [proposal, {"path": new_render["files"][0]["path"], "content": text}],
            "diff": diff, "validation": {"valid": check.get("valid"), "errors": check.get("errors", [])},
            "commands": [f"cd {shlex.quote(run.cwd)} && {_shell(argv)}"], "argv": argv}


def rollback(run: Run, event: dict[str, Any], found: dict[str, Any], lr_factor: float, proposals: Path,
             running: bool) -> dict[str, Any]:
    """Stop, go back to the last checkpoint saved before the loss went bad, and go on with a
    lower learning rate (the schedule taken from the request, not the checkpoint)."""
    bad = event.get("details", {}).get("iteration")
    nan = next((a for a in found.get("anomalies", []) if a["kind"] in ("nan", "loss_spike", "divergence")), None)
    if bad is None and nan:
        bad = nan.get("iteration")
    saved = run.checkpoints()
    good = max((i for i in saved if bad is None or i < bad), default=None)
    commands = []
    if running:
        commands.append(_stop_command(run, event))
    why = f"the loss went bad at iteration {bad}" if bad is not None else "the loss went bad"
    if good is None:
        return {"kind": "rollback", "needs_person": True, "commands": commands,
                "why": why + "; no checkpoint was saved before it: start again with a lower learning rate"}
    tracker = run.ckpt_dir / "latest_checkpointed_iteration.txt"
    commands.append(f"cp {shlex.quote(str(tracker))} {shlex.quote(str(tracker))}.before-rollback && "
                    f"echo {good} > {shlex.quote(str(tracker))}")
    action: dict[str, Any] = {"kind": "rollback", "needs_person": True, "commands": commands,
                              "why": f"{why}; checkpoint {good} is the last saved before it"}
    req = _train_request(run)
    training = dict(req.get("training") if isinstance(req.get("training"), dict) else {})
    lr, min_lr = training.get("lr", 3e-4), training.get("min_lr", 3e-5)
    if run.request and all(_positive(x) for x in (lr, min_lr)):
        training.update(lr=lr * lr_factor, min_lr=min(min_lr, lr * lr_factor) * lr_factor,
                        override_scheduler=True, save=training.get("save") or str(run.ckpt_dir))
        new_req = {**{k: v for k, v in req.items() if k not in ("resume", "dry_run")}, "training": training}
        proposal = _proposal(proposals, "rollback", new_req)
        argv = [sys.executable, str(LAUNCH), "train", "--request", proposal["path"]]
        action.update(request=new_req, files=[proposal])
        commands.append(f"cd {shlex.quote(run.cwd)} && {_shell(argv)}")
        action["why"] += (f"; then continue from it with the learning rate {lr:g} -> {lr * lr_factor:g} (a new "
                          "request: its run shares this run's checkpoints)")
    return action


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e6


def with_evidence(action: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
    """A rollback for a reported NaN, with what backs it: the run's log, or the event alone
    (then said first in its why)."""
    evidence = nan_evidence(found)
    action["evidence"] = evidence
    if evidence["source"] != "log":
        action["why"] = (f"the event reports a NaN loss but {evidence['why']} ({evidence['log']}): this rests on "
                         f"the event alone, check the log before acting; {action['why']}")
    return action


def _stop_command(run: Run, event: dict[str, Any]) -> str:
    job = event["job"]
    if job.get("scheduler") == "slurm":
        return f"scancel {shlex.quote(job['job_id'])}"
    owner = _json(run.dir / "run.lock") or {}
    pid, host = owner.get("pid"), owner.get("host")
    if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31:
        host = host if isinstance(host, str) else "its host"
        return f"kill -TERM {pid}  # the train tool on {host[:255]}: it stops the job"
    return f"stop job {job['job_id']} on {job.get('host', 'its host')} (kill its torchrun)"


def diagnose(run: Run, event: dict[str, Any], found: dict[str, Any], what: str) -> dict[str, Any]:
    tail = event.get("details", {}).get("log_tail") or _tail(run.log)
    ranks = sorted({r for f in found.get("failures", []) for r in f.get("ranks", [])})
    commands = [_shell([sys.executable, str(LAUNCH), "logs", "--log", str(run.log)])]
    if run.state.get("backend") == "cpu":
        # train's CPU loop: its ranks are the newest processes naming the run's config (torchrun is older)
        config = shlex.quote(f"cpu_loop.py {run.dir / 'cpu_run.json'}")
        commands.append(f"py-spy dump --pid $(pgrep -n -f {config})   # the Python stack of a rank of the CPU run")
    elif event["job"].get("scheduler") == "slurm":
        commands.append(f"srun --jobid {shlex.quote(event['job']['job_id'])} --overlap py-spy dump --pid $(pgrep -f "
                        "pretrain_gpt.py | head -n 1)   # the Python stack of a rank, on each node")
        commands.append("nvidia-smi   # GPUs busy at 100 % in a collective, or idle")
    else:
        commands.append("py-spy dump --pid $(pgrep -f pretrain_gpt.py | head -n 1)   # the Python stack of a rank")
        commands.append("nvidia-smi   # GPUs busy at 100 % in a collective, or idle")
    why = {"training.stalled": f"no iteration for {event.get('details', {}).get('silent_s', '?')} s after iteration "
                               f"{event.get('details', {}).get('iteration', '?')}: a rank may hang in a collective "
                               "or on I/O",
           "throughput.drop": "iterations got slower: a straggler GPU or node, thermal throttling, the network, or "
                              "checkpoint I/O",
           }.get(what, f"the job failed ({what}): resuming would repeat it; read the cause first")
    hints = found.get("hints") or []
    return {"kind": "diagnose", "needs_person": True, "why": why + (f"; {hints[0]}" if hints else ""),
            "commands": commands, "log_tail": tail[-20:], **({"ranks": ranks} if ranks else {})}


def _tail(log: Path) -> list[str]:
    from .emit import tail

    return tail(log)


def summary(run: Run, found: dict[str, Any]) -> dict[str, Any]:
    layout = run.state.get("layout") or {}
    iters = found.get("last_iteration")
    tokens = iters * layout["gbs"] * layout["seq_length"] if iters and layout.get("gbs") and layout.get("seq_length") \
        else None
    parts = [f"{iters} iterations" if iters else None, f"{tokens:,} tokens" if tokens else None,
             f"final loss {found['final_loss']:.4g}" if isinstance(found.get("final_loss"), (int, float)) else None,
             f"{found['tokens_per_s']:,.0f} tokens/s" if found.get("tokens_per_s") else None,
             f"MFU {found['mfu']:.1%}" if found.get("mfu") else None]
    return {"kind": "summary", "needs_person": False, "why": "the job finished: " + ", ".join(p for p in parts if p),
            "numbers": {"iterations": iters, "tokens": tokens, "final_loss": found.get("final_loss"),
                        "tokens_per_s": found.get("tokens_per_s"), "mfu": found.get("mfu")}}
