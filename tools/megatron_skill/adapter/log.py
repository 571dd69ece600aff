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

import collections
import dataclasses
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
    "elapsed time per iteration (ms)": "iter_ms",
    "throughput per GPU (TFLOP/s/GPU)": "tflops_per_gpu",
    "learning rate": "lr",
    "global batch size": "global_batch_size",
    "lm loss": "loss",
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
    ("kernel_fault", re.compile(r"CUDA error: (an illegal memory access|device-side assert|misaligned address|"
                                r"an illegal instruction)|CUBLAS_STATUS_EXECUTION_FAILED|Assertion `.*` failed"),
     "a GPU kernel faulted: an index out of range (a token id at or above the vocabulary size, a label the loss "
     "cannot take), a kernel's own bug, or faulty GPU memory",
     "check that the data's token ids are below the run's vocabulary (--vocab-size, the tokenizer's size) and that "
     "the data matches its tokenizer; rerun with CUDA_LAUNCH_BLOCKING=1 to name the kernel; if it recurs on one "
     "GPU only, leave that node out"),
    ("host_out_of_memory", re.compile(r"DefaultCPUAllocator: can't allocate memory|std::bad_alloc|"
                                      r"Cannot allocate memory|^\W*(\[\w*rank\d+\]:\s*)?MemoryError\b"),
     "a process ran out of host (CPU) memory",
     "fewer dataloader workers (--num-workers), no --optimizer-cpu-offload (or more host memory), fewer ranks per "
     "node loading a checkpoint at once (a torch_dist checkpoint loads shard by shard); check other jobs on the node"),
    ("worker_failed", re.compile(r"ChildFailedError|failed \(exitcode: [1-9]\d*\)|exitcode\s*:\s*[1-9]"),
     "a training process exited with an error (torchrun's summary; the error above it says why)",
     "read the first error or traceback above this line; fix it and resume from the last checkpoint"),
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

def _arg_value(text: str) -> Any:
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    if text in ("inf", "-inf", "nan"):   # e.g. --clip-grad inf
        return float(text)
    try:
        return int(text)
    except ValueError:
        return _num(text) if re.fullmatch(r"[-+0-9.eE]+", text) else text


# A Megatron iteration line starts with its wall-clock time: [2026-12-02 13:24:31.160461].
STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?\]")
RANK_PREFIX = re.compile(r"^\s*\[(?:default)?(?:rank)?(\d+)\]:|^\s*(\d+):\s", re.I)   # torchrun's, srun --label's
RANK = re.compile(RANK_PREFIX.pattern + r"|\brank[ =:]?(\d+)\b", re.I)           # or a rank the text names
SKILL_NOTE = "> megatron-core-training skill:"   # what the skill's entry script says it changed
SUMMARY_RANK = re.compile(r"^\W*(?:\[\w*rank\d+\]:)?\s*rank\s*:\s*(\d+)\s*\(local_rank")   # torchrun's summary
FINISHED = re.compile(r"\[after training is done\]|after training is done")


def _prefix_rank(line: str) -> int | None:
    """The rank a line's own prefix names (torchrun's [rankN]:, srun --label's 'N: '), not a rank
    its text mentions."""
    m = RANK_PREFIX.match(line)
    return int(m.group(1) or m.group(2)) if m else None


def _rank_of(line: str) -> int | None:
    """The rank a line says it comes from: torchrun's [rankN]: prefix, srun --label's 'N: '."""
    m = RANK.search(line)
    if not m:
        return None
    return int(next(g for g in m.groups() if g is not None))


# Words one of which each FAILURES pattern needs (each alternative of each pattern holds one of
# them): a line with none of them is searched by none of the patterns. Most lines of a log are
# iterations that name no failure, and seven searches a line made a log of 10^6 iterations take
# half a minute. tests/test_hostile_round3.py checks a line of each alternative of each pattern.
FAILURE_WORDS = ("emory", "atchdog", "NCCL", "nccl", "Heartbeat", "DistBackendError", "srun", "slurmstepd",
                 "CUDA error", "Xid ", "fallen off", "SIGKILL", "signal 9", "exitcode", "Killed", "oom-kill",
                 "DUE TO TIME LIMIT", "helper", "No module named", "apex is not installed", "Transformer Engine",
                 "CUBLAS_STATUS", "Assertion `", "bad_alloc", "ChildFailedError")

# The last line of a Python traceback: the exception's type and message ("[rank3]: " or "3: " before
# it where torchrun or srun --label prefix the ranks' lines). Read only within TRACEBACK_REACH lines of
# a "Traceback (most recent call last)" line, and only where no FAILURES pattern named the line.
EXCEPTION = re.compile(r"^\s*(?:\[\w*rank\d+\]:|\d+:)?\s*(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*"
                       r"(?:Error|Exception|Interrupt))(?::\s*(?P<message>.*))?$")
TRACEBACK_REACH = 400


def _may_fail(line: str) -> bool:
    return any(word in line for word in FAILURE_WORDS)


# The arguments that make a run the run it is: a dump that differs in one of them starts another
# run (a launch script that appends every launch to one log, tee -a); the same values again are a
# restart of the same run (a resume), whose iterations continue the curve, even where it trains
# longer (--train-iters) or saves elsewhere.
RUN_DEFINING = ARGS_READ + ("ffn_hidden_size", "num_query_groups", "kv_channels", "vocab_size", "padded_vocab_size",
                            "num_experts", "bf16", "fp16", "swiglu", "normalization")


def _earlier_run(arguments: dict[str, Any], iterations: dict[int, dict], failures: list[dict], dumps: int) -> dict:
    """What the answer keeps of a run that a later one in the same log follows."""
    its = [iterations[k] for k in sorted(iterations)]
    return {"starts": dumps, "logged_iterations": len(its), "last_iteration": its[-1]["iteration"] if its else None,
            "final_loss": next((r["loss"] for r in reversed(its) if "loss" in r), None),
            "failures": [{"code": f["code"], "line": f["line"]} for f in failures],
            "arguments": {k: arguments[k] for k in ARGS_READ if k in arguments}}


def parse(lines: Iterable[str]) -> dict[str, Any]:
    """A Megatron log read line by line: the iterations, memory, failures and argument dump of its
    last run, and a short record of each earlier run in the same file."""
    iterations: dict[int, dict] = {}
    memory: dict[int, dict] = {}
    failures: list[dict] = []
    arguments: dict[str, Any] = {}
    dump: dict[str, Any] | None = None   # the dump being read
    earlier: list[dict] = []
    resumed_after: list[dict] = []   # failures of this run's earlier starts, each followed by a resume
    dumps = 0          # argument dumps of this run: one per start of the job (a resume adds one)
    recent: collections.deque[str] = collections.deque(maxlen=400)  # the lines just above (a traceback's frames)
    unreadable = 0
    finished = False
    traceback_at = -TRACEBACK_REACH - 1   # the line of the last "Traceback (most recent call last)"
    ignored_at = -TRACEBACK_REACH - 1     # the line of the last "Exception ignored in"
    last_stamp = None
    top_seen = [-1]   # the highest iteration of the run read so far

    previous: tuple | None = None   # the run before the last split, whole: taken back if nothing follows

    def close_dump() -> None:
        """A whole dump: another run where a run-defining value differs from the run's (values
        of another type are a garbled line, not a change; a name either dump lacks, no change)."""
        nonlocal arguments, iterations, memory, failures, dumps, finished, previous
        new = dump or {}
        if arguments and any(k in new and k in arguments and type(new[k]) is type(arguments[k])
                             and new[k] != arguments[k] for k in RUN_DEFINING):
            previous = (arguments, iterations, memory, failures, dumps - 1, finished, list(resumed_after))
            # the run before keeps what ended each of its starts
            earlier.append(_earlier_run(arguments, iterations, resumed_after + failures, dumps - 1))
            iterations, memory, failures, arguments, dumps, finished = {}, {}, [], {}, 1, False
            resumed_after.clear()
            top_seen[0] = -1
        elif failures:
            # the same run started again (a resume after the failure): what ended the start
            # before is its history, not the state of the run now
            last = max(iterations, default=None)
            resumed_after.extend({"code": f["code"], "line": f["line"], "ranks": f["ranks"], "after_iteration": last}
                                 for f in failures)
            failures = []
        for k, v in new.items():
            arguments.setdefault(k, v)   # the first dump's value (a resume repeats it)

    for n, line in enumerate(lines, 1):
        if "-- arguments --" in line:
            dump = {}   # a dump cut short before its end line (a start killed in it) is left out
            dumps += 1
        elif "-- end of arguments --" in line:
            if dump is not None:
                close_dump()
            dump = None
        elif dump is not None:
            a = ARG_LINE.match(line)
            if a and a.group(1) not in dump:   # rank 0's copy (every rank may print one)
                dump[a.group(1)] = _arg_value(a.group(2))
        if "after training is done" in line:   # FINISHED
            finished = True
        if SKILL_NOTE in line and "SDPA core attention" in line:
            arguments["skill_entry"] = True   # the skill's entry said which attention it runs
        recent.append(line)
        m = MEMORY.search(line) if "memory (MB)" in line else None
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
                it = rec["iteration"]
                iterations[it] = {**iterations[it], **rec} if it in iterations else rec
                # only the latest iteration keeps its time (the answer's last_logged): a log of a
                # million iterations would otherwise hold a million time strings
                if it >= top_seen[0]:
                    if it != top_seen[0] and top_seen[0] in iterations:
                        iterations[top_seen[0]].pop("time", None)
                    top_seen[0] = it
                else:
                    iterations[it].pop("time", None)
            else:
                unreadable += 1
        if "Traceback (most recent call last)" in line:
            traceback_at = n
        named = False
        for code, rx, meaning, fix in FAILURES if _may_fail(line) else ():
            if rx.search(line):
                named = True
                _add_failure(failures, code, n, line, meaning, fix, recent)
        summary_rank = SUMMARY_RANK.match(line) if "rank" in line else None
        if summary_rank:   # torchrun's summary of a worker failure names each failed rank below it
            failed = next((f for f in failures if f["code"] == "worker_failed" and n - f["line"] <= 400), None)
            if failed is not None and int(summary_rank[1]) not in failed["ranks"] and len(failed["ranks"]) < 64:
                failed["ranks"].append(int(summary_rank[1]))
        if "Exception ignored in" in line:   # Python's note of an error it did not raise (a __del__ at exit)
            ignored_at = n
        # (Python prints "Exception ignored in ..." on the line just above such a traceback)
        if not named and n - traceback_at <= TRACEBACK_REACH and ignored_at < traceback_at - 2 and \
                ("Error" in line or "Exception" in line or "Interrupt" in line):
            m = EXCEPTION.match(line)
            if m:   # a traceback's end that no known failure explains
                now = max(iterations, default=0)
                # an earlier exception the run trained on after is superseded by this one
                failures[:] = [f for f in failures if f["code"] != "exception" or f["after_iteration"] >= now]
                meaning, fix = exception_advice(m["type"], m["message"] or "", traceback_frames(list(recent)))
                _add_failure(failures, "exception", n, line, meaning, fix, recent)
                next(f for f in failures if f["code"] == "exception").setdefault("after_iteration", now)
    if previous is not None and not iterations and not failures:
        # the last run has only just started (its dump, nothing since): the answer stays the run
        # before it, which the log has, and counts the start
        arguments, iterations, memory, failures, dumps, finished = previous[:4] + (previous[4] + dumps,
                                                                                   previous[5])
        resumed_after[:] = previous[6]
        earlier.pop()
    # an exception the run went on training after (a logger's lost connection, a retried save), or
    # one raised once training was done, ended nothing: not the run's failure
    last = max(iterations, default=0)
    failures = [f for f in failures if f["code"] != "exception" or not (finished or last > f["after_iteration"])]
    for failure in failures:
        failure.pop("after_iteration", None)
        if failure["code"] == "out_of_memory":
            failure.pop("oom_site")
            failure.update(oom_advice(failure.pop("frames"), arguments))
    return {"iterations": [iterations[k] for k in sorted(iterations)], "memory": memory,
            "failures": failures, "unreadable_lines": unreadable, "arguments": arguments, "starts": dumps,
            "finished": finished, "last_time": last_stamp, "earlier_runs": earlier, "resumed_after": resumed_after}


def _add_failure(failures: list[dict], code: str, n: int, line: str, meaning: str, fix: str, recent) -> None:
    """The first line of each failure kind, with the ranks that reported it (64 at most); an
    out-of-memory error once for each site its ranks' tracebacks show (one rank in the attention,
    the last pipeline stage in its logits)."""
    rank = _rank_of(line)
    frames = traceback_frames(list(recent), rank) if code == "out_of_memory" else []
    site = (oom_site(frames) or ("",))[0]
    seen = next((f for f in failures if f["code"] == code and f.get("oom_site", "") == site), None)
    if seen is None:
        failure = {"code": code, "line": n, "text": line.strip()[:300], "meaning": meaning, "fix": fix,
                   "ranks": [] if rank is None else [rank]}
        if code == "out_of_memory":
            failure["frames"], failure["oom_site"] = frames, site   # advice once the arguments are known
        failures.append(failure)
    elif rank is not None and rank not in seen["ranks"] and len(seen["ranks"]) < 64:
        seen["ranks"].append(rank)


# What a training process's own exception most often means, by its type.
EXCEPTION_FIXES = {
    "FileNotFoundError": "a path the run names does not exist where it runs: check --data-path, --load, --save, "
                         "the tokenizer's files and the container's mounts",
    "PermissionError": "the run may not read or write a path it names: check --save / --load and the mounts",
    "AssertionError": "one of Megatron's (or the script's) own checks failed: its message and frame say which; "
                      "'launch.py validate' runs Megatron's argument checks on the launch before it starts",
    "ModuleNotFoundError": "a package the run imports is missing from the job's Python: install it in the "
                           "image, or leave out the flag that needs it ('launch.py doctor' lists what is there)",
    "ImportError": "a package the run imports is missing or of another version: 'launch.py doctor' lists them",
    "KeyboardInterrupt": "the process was interrupted (Ctrl-C, or a SIGINT from the scheduler): resume from the "
                         "last checkpoint",
}


def exception_advice(kind: str, message: str, frames: list[str]) -> tuple[str, str]:
    """(what it means, what to do) for a Python exception that ended a training process."""
    where = f" at {frames[-1].split(' | ')[0]}" if frames else ""
    meaning = f"a training process raised {kind}{': ' + message[:200] if message else ''}{where}"
    fix = EXCEPTION_FIXES.get(kind.rsplit(".", 1)[-1], "read the exception and its innermost frame; fix the cause "
                              "and resume from the last checkpoint ('launch.py validate' checks the launch first)")
    return meaning, fix


# ---- out of memory: where, from the traceback's frames, and what fits the run -------------
# A frame of a Python traceback, as torch's and Megatron's ranks print it (a rank prefix aside).
FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>[\w<>.]+)')

# Where an allocation failed, by the frames of the traceback above the error. Tried in this
# order (the first site any frame names wins: a checkpoint load reaches the optimizer's code,
# an output layer reaches a generic linear layer); activations is what is left of a forward
# or backward through the layers. Each: its code, the frames that name it, what it holds, and
# its fix where the log has no argument dump to fit the fix to.
OOM_SITES = (
    # a save's frames name checkpointing.py too: the save is told by its own functions, first
    ("checkpoint_save", re.compile(r" in (save_checkpoint\w*|_save\w*|save|sharded_param_state\w*|"
                                   r"get_parameter_state\w*)\b|dist_checkpointing/\S*save"),
     "saving a checkpoint (the optimizer state gathered or copied for the write)",
     "a torch_dist checkpoint (--ckpt-format torch_dist: each rank writes its own shards); "
     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
    ("checkpoint_load", re.compile(r"checkpointing\.py|load_checkpoint|dist_checkpointing"),
     "loading the checkpoint", "see the fixes for a load: a torch_dist checkpoint, --no-load-optim"),
    ("optimizer_step", re.compile(r"torch/optim/|_multi_tensor_adam|_fused_adam|_foreach_|optimizer\.step\(|"
                                  r"distrib_optimizer\.py|megatron/core/optimizer/"),
     "the optimizer step (fp32 master weights, Adam moments and the step's temporaries)",
     "--use-distributed-optimizer where DP > 1 and it is off (it shards over data parallel only, nothing at DP 1); "
     "more PP or TP; a fused Adam (Transformer Engine's or apex's)"),
    ("logits", re.compile(r"output_layer|cross_entropy|fused_head|vocab_parallel|compute_language_model_loss"),
     "the output layer's logits or the cross-entropy over them",
     "--cross-entropy-loss-fusion, or the skill's fused output layer + cross-entropy; a smaller --micro-batch-size; "
     "more TP (the vocabulary is split over TP)"),
    ("attention_scores", re.compile(r"dot_product_attention|core_attention|baddbmm|fused_softmax|"
                                    r"scaled_masked_softmax|attention_scores|flash_attn"),
     "core attention (where it is unfused, its S x S scores)",
     "where attention is unfused (--transformer-impl local with Megatron's entry), flash / cuDNN attention: Transformer "
     "Engine with --attention-backend flash, or the skill's entry script (torch SDPA); else a smaller "
     "--micro-batch-size or selective recompute"),
    ("activations", re.compile(r"megatron/core/(transformer|tensor_parallel|models)/|torch/autograd/|backward"),
     "the activations of the layers, in the forward or the backward",
     "lower --micro-batch-size, add recompute (--recompute-granularity selective or full), or raise TP/PP"),
)


def traceback_frames(lines: list[str], rank: int | None = None) -> list[str]:
    """The frames of the last traceback in lines, innermost last: each frame's place and the
    code line under it ("path:line in func | code"). With a rank: that rank's lines alone, where
    the log prefixes lines with their rank (tracebacks of several ranks interleave there)."""
    if rank is not None and any(_prefix_rank(ln) == rank for ln in lines):
        lines = [ln for ln in lines if _prefix_rank(ln) == rank]
    start = max((i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln), default=0)
    frames: list[str] = []
    for i in range(start, len(lines)):
        m = FRAME.search(lines[i])
        if m:
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            code = "" if FRAME.search(nxt) else re.sub(r"^(\[\w*rank\d+\]:)?\s*", "", nxt).strip()
            frames.append(f"{m['path'].replace(chr(92), '/')}:{m['line']} in {m['func']} | {code}")
    return frames


def oom_site(frames: list[str]) -> tuple[str, str, str] | None:
    """(site, what it holds, the innermost frame that names it), or None."""
    for site, rx, meaning, _ in OOM_SITES:
        frame = next((f for f in reversed(frames) if rx.search(f)), None)
        if frame is not None:
            return site, meaning, frame
    return None


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What a run's argument dump says that decides which fix helps (None: no dump)."""
    mbs: int
    gbs: int | None
    dp: int
    tp: int
    pp: int
    cp: int
    seq: int | None
    heads: int | None
    distributed_optimizer: bool
    recompute: str | None
    unfused_attention: bool
    fused_cross_entropy: bool     # Megatron's --cross-entropy-loss-fusion
    skill_head: bool              # the skill's fused output layer + loss (never whole logits)
    sequence_parallel: bool
    ckpt_format: str | None = None
    no_load_optim: bool = False

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "RunFacts | None":
        if not args:
            return None
        from . import described  # the attention path, read as validate reads it

        def n(key: str, default: int | None = 1) -> int | None:
            v = args.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else default

        tp, pp, cp = n("tensor_model_parallel_size"), n("pipeline_model_parallel_size"), n("context_parallel_size")
        world = n("world_size", None)
        dp = n("data_parallel_size", None) or (max(1, world // (tp * pp * cp)) if world else 1)
        ns = described.Args(args)
        return cls(mbs=n("micro_batch_size"), gbs=n("global_batch_size", None), dp=dp, tp=tp, pp=pp, cp=cp,
                   seq=n("seq_length", None), heads=n("num_attention_heads", None),
                   distributed_optimizer=args.get("use_distributed_optimizer") is True,
                   recompute=args.get("recompute_granularity") if isinstance(args.get("recompute_granularity"), str)
                   else None, unfused_attention=described.attention_path(ns)[0] == "unfused",
                   fused_cross_entropy=bool(args.get("cross_entropy_loss_fusion")),
                   skill_head=bool(args.get("skill_linear_cross_entropy")),
                   sequence_parallel=args.get("sequence_parallel") is True,
                   ckpt_format=args.get("ckpt_format") if isinstance(args.get("ckpt_format"), str) else None,
                   no_load_optim=args.get("no_load_optim") is True)


def _smaller_micro_batch(run: RunFacts, why: str) -> list[str]:
    if run.mbs <= 1:
        return []
    keep = f": the global batch stays {run.gbs} with more gradient-accumulation steps" if run.gbs else ""
    return [f"lower --micro-batch-size from {run.mbs} ({why}){keep}"]


def _attention_fixes(run: RunFacts) -> list[str]:
    if not run.unfused_attention:
        return _smaller_micro_batch(run, "attention memory grows with it") + (
            [f"--context-parallel-size 2 (splits the {run.seq}-token sequence)"] if (run.seq or 0) >= 8192 else [])
    scores = ""
    if run.heads and run.seq:
        gib = run.mbs * run.heads / run.tp * run.seq ** 2 * 2 / 2 ** 30
        scores = f" (one layer's scores: {run.mbs} x {run.heads // run.tp} heads x {run.seq}^2, about {gib:.1f} GiB)"
    out = ["use attention that keeps no S x S scores: Transformer Engine's layers (--transformer-impl "
           "transformer_engine --attention-backend flash or auto), or the skill's entry script (torch SDPA) with the "
           f"local layers; this run's unfused DotProductAttention materialises them{scores}"]
    out += _smaller_micro_batch(run, "the scores grow with it")
    if run.recompute != "selective":
        out.append("--recompute-granularity selective (core attention recomputed: no layer keeps its scores for the "
                   "backward)")
    return out


def _logits_fixes(run: RunFacts) -> list[str]:
    out = []
    if not run.skill_head:
        out.append(("" if run.fused_cross_entropy else "--cross-entropy-loss-fusion (no fp32 copy of the logits), or ")
                   + "the skill's entry script with its fused output layer + cross-entropy "
                   "(--skill-linear-cross-entropy: the logits are never whole)")
    out += _smaller_micro_batch(run, "the logits are micro-batch x sequence x vocabulary")
    if run.skill_head:
        # the head keeps a chunk of logits at a time; it runs first in the backward, when every
        # layer's saved activations are still alive: those are what fill the GPU there
        out += [f"{fix} (every layer's saved activations are alive when the output layer's backward runs)"
                for fix in _recompute_fixes(run)]
    if run.tp < 8:
        gpus = run.tp * run.pp * run.cp * run.dp
        where = (f" (its TP group then takes GPUs from the {run.dp} data-parallel replicas)" if run.dp > 1
                 else f": more GPUs than this run's {gpus}, or fewer for PP / CP" if gpus > run.tp
                 else f": more GPUs than this run's {gpus}")
        out.append(f"raise --tensor-model-parallel-size from {run.tp} (the vocabulary, and the logits, split "
                   f"over TP){where}")
    return out or [f"raise PP from {run.pp} (fewer layers, and their activations, on the last rank)"]


def _recompute_fixes(run: RunFacts) -> list[str]:
    if run.recompute is None:
        return ["--recompute-granularity selective, or full with --recompute-method uniform"]
    if run.recompute == "selective":
        return ["--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"]
    return []


def _optimizer_fixes(run: RunFacts, frame: str) -> list[str]:
    out = []
    if "_foreach_" in frame or "_multi_tensor_adam" in frame:
        out.append("the step died in torch's multi-tensor (foreach) Adam, whose temporaries are as large as a whole "
                   "parameter group's moments: a fused Adam (Transformer Engine's or apex's, which Megatron takes "
                   "when installed) steps in place")
    if run.dp > 1 and not run.distributed_optimizer:
        out.append(f"--use-distributed-optimizer (shards the master weights and moments over the {run.dp} "
                   "data-parallel ranks)")
    elif run.dp == 1:
        had = "is on but " if run.distributed_optimizer else "would "
        out.append(f"the distributed optimizer {had}shard{'s' if had.startswith('is') else ''} nothing at DP 1: "
                   "run data-parallel replicas (more GPUs at the same TP x PP) to shard the optimizer state")
    if run.distributed_optimizer:
        out.append("--optimizer-cpu-offload --use-precision-aware-optimizer (the state and its step on the host)")
    out.append(f"more GPUs for PP or TP (PP {run.pp} x TP {run.tp} now): each rank then steps fewer parameters")
    return out


def _activation_fixes(run: RunFacts) -> list[str]:
    out = _smaller_micro_batch(run, "activations grow with it") + _recompute_fixes(run)
    if run.tp > 1 and not run.sequence_parallel:
        out.append("--sequence-parallel (splits the activations outside the TP regions over TP)")
    if (run.seq or 0) >= 8192 and run.cp == 1:
        out.append(f"--context-parallel-size 2 (splits the {run.seq}-token sequence)")
    out.append(f"raise PP from {run.pp} (fewer layers, and their activations, on each rank)")
    return out


def _checkpoint_fixes(run: RunFacts | None) -> list[str]:
    out = ["the load ran out of memory before training started, so the layout's training memory is not the cause"]
    if run is None or run.ckpt_format != "torch_dist":
        out.append("load a torch_dist checkpoint (--ckpt-format torch_dist, read shard by shard) rather than a legacy "
                   "torch one")
    if run is None or not run.no_load_optim:
        out.append("--no-load-optim where the optimizer state is not needed (the start of a fine-tune)")
    return out + ["check that no other process holds memory on the GPU (nvidia-smi)"]


def _checkpoint_save_fixes(run: RunFacts | None) -> list[str]:
    out = ["the save ran out of memory after training steps fitted: the layout's training memory is not the cause, "
           "what the save allocates on top of it is"]
    if run is None or run.ckpt_format != "torch_dist":
        out.append("--ckpt-format torch_dist: each rank writes its own shards of the optimizer state (the legacy "
                   "torch format gathers it onto one data-parallel rank first)")
    return out + ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the save's large buffers come after training "
                  "has fragmented the allocator's cache)", "check that no other process holds memory on the GPU "
                  "(nvidia-smi)"]


def _generic_fixes(run: RunFacts | None) -> list[str]:
    if run is None:
        return ["lower --micro-batch-size, add recompute (--recompute-granularity selective or full), or raise TP/PP; "
                "'launch.py plan' with the same model and GPUs predicts which layouts fit"]
    return _activation_fixes(run) + (["--use-distributed-optimizer"] if run.dp > 1 and not run.distributed_optimizer
                                     else [])


def oom_advice(frames: list[str], args: dict[str, Any]) -> dict[str, Any]:
    """Where an out-of-memory error happened (its traceback's frames) and the fixes that fit the
    run's own arguments (its dump): never one it already has, never sharding at DP 1."""
    run = RunFacts.from_args(args)
    found = oom_site(frames)
    out: dict[str, Any] = {}
    if found is None:
        fixes = _generic_fixes(run)
    else:
        site, meaning, frame = found
        out.update(site=site, frame=frame, meaning=f"out of GPU memory in {meaning}")
        without_dump = next(fix for code, _, _, fix in OOM_SITES if code == site)
        by_site = {"checkpoint_load": lambda: _checkpoint_fixes(run), "checkpoint_save": lambda: _checkpoint_save_fixes(run),
                   "optimizer_step": lambda: _optimizer_fixes(run, frame),
                   "logits": lambda: _logits_fixes(run), "attention_scores": lambda: _attention_fixes(run),
                   "activations": lambda: _activation_fixes(run)}
        fixes = by_site[site]() if run is not None or site.startswith("checkpoint") else [without_dump]
    if run is not None:
        out["run"] = {"micro_batch_size": run.mbs, "data_parallel_size": run.dp, "tensor_parallel_size": run.tp,
                      "pipeline_parallel_size": run.pp, "distributed_optimizer": run.distributed_optimizer,
                      "recompute": run.recompute, "unfused_attention": run.unfused_attention}
    out["fixes"] = fixes
    out["fix"] = "; ".join(fixes)
    return out


def summarize(parsed: dict[str, Any], seq_length: int | None = None, peak_tflops: float | None = None,
              skip_first: int = 1) -> dict[str, Any]:
    """Loss curve, speed (excluding the first logged interval: compilation and warm-up),
    memory, and anomalies (NaN, skipped iterations, loss spikes, divergence)."""
    its = parsed["iterations"]
    out: dict[str, Any] = {"logged_iterations": len(its), "failures": parsed["failures"],
                           "unreadable_lines": parsed["unreadable_lines"], "starts": parsed.get("starts", 0)}
    if parsed.get("earlier_runs"):
        out["earlier_runs"] = parsed["earlier_runs"]
    if parsed.get("resumed_after"):
        out["resumed_after"] = parsed["resumed_after"]
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
        # Megatron leaves the loss out of a line whose interval had a NaN: the last loss shown
        # may be older than the last iteration
        out["final_loss_iteration"] = losses[-1][0]
    out["lr_curve"] = [[r["iteration"], r["lr"]] for r in its if "lr" in r]
    steady = its[skip_first:] if len(its) > skip_first else its
    # speeds from finite figures only (a damaged line's inf or NaN is no speed, and JSON has neither)
    times = [r["iter_ms"] for r in steady if math.isfinite(r.get("iter_ms", math.nan))]
    if times:
        ms = sorted(times)[len(times) // 2]
        out["iter_ms_median"] = round(ms, 1)
        gbs = its[-1].get("global_batch_size")
        rate = gbs * seq_length / (ms / 1e3) if gbs and seq_length and ms > 0 else math.inf
        if math.isfinite(rate):   # a 0 ms iteration (a log printed too coarsely) has no rate
            out["tokens_per_s"] = round(rate, 1)
    tf = [r["tflops_per_gpu"] for r in steady if math.isfinite(r.get("tflops_per_gpu", math.nan))]
    if tf:
        t = sorted(tf)[len(tf) // 2]
        out["tflops_per_gpu"] = round(t, 1)
        if peak_tflops:
            out["mfu"] = round(t / peak_tflops, 4)
    if parsed["memory"]:
        out["max_allocated_gib"] = round(max(m["max_allocated_mb"] for m in parsed["memory"].values()) / 1024, 2)
        out["max_reserved_gib"] = round(max(m["max_reserved_mb"] for m in parsed["memory"].values()) / 1024, 2)
    # counts: each line's count is of its own logging interval (Megatron resets both after printing),
    # so the run's is their sum; a damaged line's inf or nan (1e999 parses as inf) counts for nothing
    out["nan_iterations"], out["skipped_iterations"] = _interval_total(its, "nan"), _interval_total(its, "skipped")
    anomalies = []
    vals = [loss for _, loss in losses]
    last_spike = None   # a spike the next values stay up with is one spike (a plateau), said once
    for k in range(3, len(vals)):
        base = spike_base(vals[max(0, k - 5):k], vals[k])
        if base is not None and last_spike != k - 1:
            anomalies.append({"kind": "loss_spike", "iteration": losses[k][0], "loss": vals[k], "before": base})
        last_spike = k if base is not None else last_spike
    if any(not math.isfinite(v) for v in vals) or out["nan_iterations"]:
        # the first line whose loss is not finite or whose interval counted a NaN iteration
        first = next((r["iteration"] for r in its if not math.isfinite(r.get("loss", 0.0))
                      or (math.isfinite(r.get("nan", 0)) and r.get("nan", 0) > 0)), None)
        anomalies.append({"kind": "nan", "iteration": first})
    rise = _divergence(vals)
    if rise:
        # the last iteration with a finite loss: the rise is of those (a NaN after them is the 'nan' anomaly)
        last = next(i for i, v in reversed(losses) if math.isfinite(v))
        anomalies.append({"kind": "divergence", "iteration": last, "loss": rise[0], "best": rise[1]})
    norms = [(r["iteration"], r["grad_norm"]) for r in its if math.isfinite(r.get("grad_norm", math.nan))]
    for k in range(5, len(norms)):
        before = sorted(g for _, g in norms[k - 5:k])[2]
        if norms[k][1] > 5 * before and norms[k][1] > 1.0:
            anomalies.append({"kind": "grad_norm_spike", "iteration": norms[k][0], "grad_norm": norms[k][1],
                              "before": before})
    out["anomalies"] = anomalies
    return out


def _interval_total(its: list[dict], key: str) -> int:
    """The sum of a count each line gives for its own interval; a damaged line's huge values
    (1e308 twice overflows a float) make it the largest one alone."""
    counts = [v for r in its if math.isfinite(v := r.get(key, 0)) and v > 0]
    total = sum(counts)
    return int(total) if math.isfinite(total) else int(max(counts))


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
