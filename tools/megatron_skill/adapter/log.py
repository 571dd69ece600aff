"""Reading Megatron training logs: iteration lines, memory reports, and known failures.

Megatron's last rank prints one line per logging interval:
  [time] iteration   10/ 100 | consumed samples: 320 | elapsed time per iteration (ms): 3091.0 |
  throughput per GPU (TFLOP/s/GPU): 348.6 | learning rate: 1.8E-04 | global batch size: 32 |
  lm loss: 3.06E-01 | loss scale: 1.0 | grad norm: 1.451 | number of skipped iterations: 0 | ...
and memory reports "[Rank 0] (after 5 iterations) memory (MB) | allocated: ... | max allocated: ...".
With several ranks writing to one file, lines can interleave or break; the parser takes
what it can read from each line and counts the rest.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterable

ITER = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)")
FIELD = re.compile(r"\|\s*([A-Za-z][A-Za-z0-9 /()_\-]*?)\s*:\s*([-+0-9.eEinfaINFA]+)")
MEMORY = re.compile(r"\[Rank (\d+)\].*?memory \(MB\)\s*\|\s*allocated:\s*([\d.]+)\s*\|\s*max allocated:\s*([\d.]+)"
                    r"\s*\|\s*reserved:\s*([\d.]+)\s*\|\s*max reserved:\s*([\d.]+)")
# Megatron's line after a checkpoint is written (the CPU loop prints the same words).
CHECKPOINT_SAVED = re.compile(r"successfully saved checkpoint from iteration\s+(\d+)")
KEYS = {
    "consumed samples": "consumed_samples",
    "elapsed time per iteration (ms)": "iter_ms",
    "throughput per GPU (TFLOP/s/GPU)": "tflops_per_gpu",
    "learning rate": "lr",
    "global batch size": "global_batch_size",
    "lm loss": "loss",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "number of skipped iterations": "skipped",
    "number of nan iterations": "nan",
}

# Known failures: what the log says, what it means, what to do.
FAILURES = [
    ("out_of_memory", re.compile(r"CUDA out of memory|OutOfMemoryError|torch\.OutOfMemoryError"),
     "a rank ran out of GPU memory",
     "lower --micro-batch-size, add recompute (--recompute-granularity selective or full), or raise TP/PP; "
     "'launch.py plan' with the same model and GPUs predicts which layouts fit"),
    ("nccl_timeout", re.compile(r"Watchdog caught collective operation timeout|NCCL.*[Tt]imeout|ProcessGroupNCCL.*timed out|"
                                r"Some NCCL operations have failed or timed out|watchdog (thread )?(got )?stuck|"
                                r"Heartbeat monitor timed out"),
     "a collective timed out: a rank hung or died, or the network stalled",
     "find the first rank that failed above this line; check NCCL_DEBUG=INFO output, the network (NCCL_SOCKET_IFNAME, "
     "IB), and that every rank runs the same script; raise --distributed-timeout-minutes only for slow checkpoint I/O"),
    ("nccl_error", re.compile(r"NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError|ncclRemoteError|"
                              r"DistBackendError|NCCL communicator was aborted"),
     "NCCL failed", "run with NCCL_DEBUG=INFO; check driver / NCCL versions and the fabric"),
    ("node_failure", re.compile(r"srun: error: .*(Node failure|NODE_FAIL)|slurmstepd: error: .*(NODE_FAIL|node failure)|"
                                r"CUDA error: uncorrectable ECC|Xid \d+|GPU has fallen off the bus|"
                                r"CUDA error: unspecified launch failure"),
     "a node or GPU failed (hardware or driver), not the training's arithmetic",
     "resume from the last checkpoint on healthy nodes (leave the failed one out: sbatch -x NODE); report the node"),
    ("killed", re.compile(r"Signals\.SIGKILL|signal 9|exitcode\s*:\s*-9|Killed\b|oom-kill|CANCELLED AT .* DUE TO TIME LIMIT|"
                          r"DUE TO TIME LIMIT"),
     "a process was killed from outside (the scheduler's time limit, the host's out-of-memory killer, or a person)",
     "resume from the last checkpoint; for a time limit, raise it or checkpoint more often (--save-interval); for the "
     "host's OOM killer, fewer dataloader workers or more host memory"),
    ("make_helpers", re.compile(r"Failed to compile the C\+\+ dataset helper|make: \*\*\*.*helpers"),
     "Megatron tried to build its dataset helpers with make, which the pip wheel cannot",
     "launch through the skill's tools/pretrain_gpt.py, which uses the prebuilt helpers"),
    ("missing_fusion", re.compile(r"No module named '(apex|transformer_engine|fused_layer_norm_cuda)'|"
                                  r"apex is not installed|Transformer Engine.*required"),
     "a fused kernel that needs Transformer Engine or apex was asked for",
     "without TE add --transformer-impl local --no-masked-softmax-fusion --no-gradient-accumulation-fusion "
     "--no-persist-layer-norm --no-rope-fusion ('launch.py render' does this)"),
]


def _num(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_iteration(line: str) -> dict[str, Any] | None:
    m = ITER.search(line)
    if not m or "|" not in line:
        return None
    rec: dict[str, Any] = {"iteration": int(m.group(1)), "train_iters": int(m.group(2))}
    for key, value in FIELD.findall(line):
        name = KEYS.get(key.strip())
        if name:
            v = _num(value)
            if v is not None:
                rec[name] = v
    return rec


# Megatron prints its arguments at start-up, one "  name ....... value" line each, between
# "---- arguments ----" and "---- end of arguments ----" (rank prefixes such as "[rank0]:" aside).
ARG_LINE = re.compile(r"^(?:\[\w*rank\d+\]:\s?)?\s+(\w+) \.{3,} (.*?)\s*$")
ARGS_READ = ("seq_length", "micro_batch_size", "global_batch_size", "world_size", "data_parallel_size",
             "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
             "expert_model_parallel_size", "num_layers", "hidden_size", "num_attention_heads", "transformer_impl",
             "attention_backend", "fp8", "recompute_granularity", "sequence_parallel")

# Where an out-of-memory error happened, read from the traceback's frames just above it: the
# frame names what to change.
OOM_SITES = [
    ("unfused_attention", re.compile(r"baddbmm|dot_product_attention\.py|attention_scores|scaled_masked_softmax"),
     "the S x S attention scores of unfused attention (Megatron's local DotProductAttention keeps them)",
     "use flash / cuDNN attention: Transformer Engine with --attention-backend flash (or auto), or the skill's "
     "entry script, whose local layers run torch SDPA ('launch.py render' writes it)"),
    ("logits", re.compile(r"cross_entropy|output_layer|vocab_parallel|compute_language_model_loss|logits"),
     "the output layer's logits or the cross-entropy over them",
     "--cross-entropy-loss-fusion (TE) or the skill's fused output layer + cross-entropy, a smaller "
     "--micro-batch-size, or more TP (the vocabulary is split over TP)"),
    ("optimizer", re.compile(r"optimizer\.py|distrib_optimizer|\.step\(|adam", re.I),
     "the optimizer's state (fp32 master weights and Adam moments)",
     "--use-distributed-optimizer (shards it over data parallel), or more PP / EP"),
]


def _arg_value(text: str) -> Any:
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    try:
        return int(text)
    except ValueError:
        return _num(text) if re.fullmatch(r"[-+0-9.eE]+", text) else text


# A Megatron iteration line starts with its wall-clock time: [2026-12-02 13:24:31.160461].
STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?\]")
RANK = re.compile(r"^\s*\[(?:default)?(?:rank)?(\d+)\]:|^\s*(\d+):\s|\brank[ =:]?(\d+)\b", re.I)
SKILL_NOTE = "> megatron-core-training skill:"   # what the skill's entry script says it changed
FINISHED = re.compile(r"\[after training is done\]|after training is done")


def _rank_of(line: str) -> int | None:
    """The rank a line says it comes from: torchrun's [rankN]: prefix, srun --label's 'N: '."""
    m = RANK.search(line)
    if not m:
        return None
    return int(next(g for g in m.groups() if g is not None))


def parse(lines: Iterable[str]) -> dict[str, Any]:
    iterations: dict[int, dict] = {}
    memory: dict[int, dict] = {}
    failures: list[dict] = []
    arguments: dict[str, Any] = {}
    dumps = 0          # argument dumps: one per start of the job (a resume adds one)
    in_args = False
    recent: list[str] = []  # the lines just above the current one (a traceback's frames)
    unreadable = 0
    finished = False
    last_stamp = None
    for n, line in enumerate(lines, 1):
        if "-- arguments --" in line:
            in_args = True
            dumps += 1
        elif "-- end of arguments --" in line:
            in_args = False
        elif in_args:
            a = ARG_LINE.match(line)
            if a and (dumps == 1 or a.group(1) not in arguments):
                arguments.setdefault(a.group(1), _arg_value(a.group(2)))
        if FINISHED.search(line):
            finished = True
        if SKILL_NOTE in line and "SDPA core attention" in line:
            arguments["skill_entry"] = True   # the skill's entry said which attention it runs
        recent = (recent + [line])[-80:]
        m = MEMORY.search(line)
        if m:
            rank = int(m.group(1))
            cur = memory.setdefault(rank, {"max_allocated_mb": 0.0, "max_reserved_mb": 0.0})
            cur["max_allocated_mb"] = max(cur["max_allocated_mb"], float(m.group(3)))
            cur["max_reserved_mb"] = max(cur["max_reserved_mb"], float(m.group(5)))
        elif "iteration" in line and "|" in line:
            rec = parse_iteration(line)
            if rec and ("loss" in rec or "iter_ms" in rec):
                stamp = STAMP.search(line)
                if stamp:
                    rec["time"] = last_stamp = stamp.group(1)
                iterations[rec["iteration"]] = {**iterations.get(rec["iteration"], {}), **rec}
            else:
                unreadable += 1
        for code, rx, meaning, fix in FAILURES:
            if not rx.search(line):
                continue
            seen = next((f for f in failures if f["code"] == code), None)
            rank = _rank_of(line)
            if seen is None:
                failure = {"code": code, "line": n, "text": line.strip()[:300], "meaning": meaning, "fix": fix,
                           "ranks": [] if rank is None else [rank]}
                if code == "out_of_memory":
                    failure.update(_oom_site(recent))
                failures.append(failure)
            elif rank is not None and rank not in seen["ranks"] and len(seen["ranks"]) < 64:
                seen["ranks"].append(rank)
    return {"iterations": [iterations[k] for k in sorted(iterations)], "memory": memory,
            "failures": failures, "unreadable_lines": unreadable, "arguments": arguments, "starts": dumps,
            "finished": finished, "last_time": last_stamp}


def _oom_site(frames: list[str]) -> dict[str, str]:
    """The innermost recognised frame of the traceback above an out-of-memory error."""
    for line in reversed(frames):
        for site, rx, meaning, fix in OOM_SITES:
            if rx.search(line):
                return {"site": site, "meaning": f"out of GPU memory in {meaning}", "fix": fix}
    return {}


def summarize(parsed: dict[str, Any], seq_length: int | None = None, peak_tflops: float | None = None,
              skip_first: int = 1) -> dict[str, Any]:
    """Loss curve, speed (excluding the first logged interval: compilation and warm-up),
    memory, and anomalies (NaN, skipped iterations, loss spikes, divergence)."""
    its = parsed["iterations"]
    out: dict[str, Any] = {"logged_iterations": len(its), "failures": parsed["failures"],
                           "unreadable_lines": parsed["unreadable_lines"], "starts": parsed.get("starts", 0)}
    out["state"] = ("failed" if parsed["failures"] else "finished" if parsed.get("finished") or
                    (its and its[-1]["iteration"] >= its[-1]["train_iters"]) else "stopped or running")
    if not its:
        return out
    out["last_logged"] = {"iteration": its[-1]["iteration"], "time": its[-1].get("time")}
    out["last_iteration"] = its[-1]["iteration"]
    out["train_iters"] = its[-1]["train_iters"]
    losses = [(r["iteration"], r["loss"]) for r in its if "loss" in r]
    out["loss_curve"] = [[i, loss] for i, loss in losses]
    if losses:
        out["first_loss"], out["final_loss"] = losses[0][1], losses[-1][1]
    out["lr_curve"] = [[r["iteration"], r["lr"]] for r in its if "lr" in r]
    steady = its[skip_first:] if len(its) > skip_first else its
    times = [r["iter_ms"] for r in steady if "iter_ms" in r]
    if times:
        ms = sorted(times)[len(times) // 2]
        out["iter_ms_median"] = round(ms, 1)
        gbs = its[-1].get("global_batch_size")
        if gbs and seq_length:
            out["tokens_per_s"] = round(gbs * seq_length / (ms / 1e3), 1)
    tf = [r["tflops_per_gpu"] for r in steady if "tflops_per_gpu" in r]
    if tf:
        t = sorted(tf)[len(tf) // 2]
        out["tflops_per_gpu"] = round(t, 1)
        if peak_tflops:
            out["mfu"] = round(t / peak_tflops, 4)
    if parsed["memory"]:
        out["max_allocated_gib"] = round(max(m["max_allocated_mb"] for m in parsed["memory"].values()) / 1024, 2)
        out["max_reserved_gib"] = round(max(m["max_reserved_mb"] for m in parsed["memory"].values()) / 1024, 2)
    out["nan_iterations"] = int(max((r.get("nan", 0) for r in its), default=0))
    out["skipped_iterations"] = int(max((r.get("skipped", 0) for r in its), default=0))
    anomalies = []
    vals = [loss for _, loss in losses]
    for k in range(3, len(vals)):
        base = spike_base(vals[max(0, k - 5):k], vals[k])
        if base is not None:
            anomalies.append({"kind": "loss_spike", "iteration": losses[k][0], "loss": vals[k], "before": base})
    if any(not math.isfinite(v) for v in vals) or out["nan_iterations"]:
        anomalies.append({"kind": "nan", "iteration": next((i for i, v in losses if not math.isfinite(v)), None)})
    rise = _divergence(vals)
    if rise:
        anomalies.append({"kind": "divergence", "iteration": losses[-1][0], "loss": rise[0], "best": rise[1]})
    norms = [(r["iteration"], r["grad_norm"]) for r in its if math.isfinite(r.get("grad_norm", math.nan))]
    for k in range(5, len(norms)):
        before = sorted(g for _, g in norms[k - 5:k])[2]
        if norms[k][1] > 5 * before and norms[k][1] > 1.0:
            anomalies.append({"kind": "grad_norm_spike", "iteration": norms[k][0], "grad_norm": norms[k][1],
                              "before": before})
    out["anomalies"] = anomalies
    return out


def spike_base(before: list[float], loss: float) -> float | None:
    """The median of the losses before when loss stands out as a spike above them (half as high
    again and 0.5 nats more; a lower or NaN loss is no spike), else None."""
    if len(before) < 3 or not math.isfinite(loss):
        return None
    base = sorted(before)[len(before) // 2]
    return base if base > 0 and loss > 1.5 * base and loss - base > 0.5 else None


def _divergence(vals: list[float]) -> tuple[float, float] | None:
    """(recent mean, best before) when the loss has risen beyond its own noise: the mean of the
    last tenth of the logged values (three at least) stands above the best value before them by
    more than five times the typical step-to-step change and by 0.1 nats and 10 % at least.
    Needs 20 logged values; a loss near zero that wobbles is noise, not divergence."""
    finite = [v for v in vals if math.isfinite(v)]
    if len(finite) < 20:
        return None
    tail_n = max(3, len(finite) // 10)
    tail, head = finite[-tail_n:], finite[:-tail_n]
    steps = sorted(abs(b - a) for a, b in zip(finite, finite[1:]))
    noise = steps[len(steps) // 2]
    recent, best = sum(tail) / len(tail), min(head)
    if recent - best > max(5 * noise, 0.1, 0.1 * best):
        return round(recent, 4), best
    return None
