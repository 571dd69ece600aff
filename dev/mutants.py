#!/usr/bin/env python3
"""Mutation checks: small wrong edits of the code that matters most, each of which a named unit
test must turn red.

A test suite can pass while guarding nothing: a rule that lost a factor, a memory term that went
missing, a deduplication keyed by the wrong field. Each mutant below is such an edit, made on
purpose, with the fast unit tests that must fail on it. The command copies the tree (the files
git tracks or would track, as they are now) into a temporary folder, checks that the named tests
pass there unchanged, then applies each mutant in the copy alone, runs its tests and puts the
file back; the working tree is never written. The answer is one JSON object on stdout:

    .venv/bin/python dev/mutants.py              # every mutant
    .venv/bin/python dev/mutants.py --only memory-qk-norm-term planner-rank-ties
    .venv/bin/python dev/mutants.py --list       # the mutants, nothing run

Each mutant ends as killed (its tests failed), survived (they passed: a hole in the tests),
stale (its original text is no longer in the file, once exactly: the code moved on, and the
mutant must be written again) or error (pytest could not run the tests). The exit status is 0
when every mutant was killed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "tools/megatron_skill/"
GUARDS = "tests/test_mutant_guards.py"

# Each mutant: the file, its exact original text (found once), the replacement, why the mutant is
# wrong, and the unit tests (pytest node ids) that must fail on it.
MUTANTS = [
    # ---- the rule book (core/layout.py)
    {"id": "rules-expert-folding-without-cp", "area": "rule book", "file": PKG + "core/layout.py",
     "original": "if (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.etp):",
     "replacement": "if (lay.tp * lay.dp) % (lay.ep * lay.etp):",
     "why": "Megatron folds the expert groups over TP x CP x DP: without CP, layouts whose experts fold "
            "across context parallel ranks are refused",
     "tests": [GUARDS + "::test_experts_fold_across_the_context_parallel_ranks_too"]},
    {"id": "rules-moe-sp-from-tp4", "area": "rule book", "file": PKG + "core/layout.py",
     "original": "if model.is_moe and lay.tp > 1 and not lay.sequence_parallel:",
     "replacement": "if model.is_moe and lay.tp > 2 and not lay.sequence_parallel:",
     "why": "an MoE model at TP 2 without sequence parallelism passes the rule book and dies in Megatron",
     "tests": ["tests/test_core.py::test_each_rule_is_broken_by_its_one_change"]},
    {"id": "rules-cp-sequence-unbalanced", "area": "rule book", "file": PKG + "core/layout.py",
     "original": "if lay.seq_length % (2 * lay.cp) and lay.cp > 1:",
     "replacement": "if lay.seq_length % lay.cp and lay.cp > 1:",
     "why": "load-balanced causal CP cuts the sequence into 2 x CP chunks: a length only CP divides passes",
     "tests": ["tests/test_core.py::test_each_rule_is_broken_by_its_one_change"]},
    {"id": "rules-batch-without-micro-batch", "area": "rule book", "file": PKG + "core/layout.py",
     "original": "if lay.gbs % (lay.mbs * lay.dp):",
     "replacement": "if lay.gbs % lay.dp:",
     "why": "the global batch must be whole micro-batches on every DP rank: a batch DP alone divides passes",
     "tests": [GUARDS + "::test_the_global_batch_is_whole_micro_batches_on_every_data_parallel_rank"]},
    # ---- the memory model (core/memory.py)
    {"id": "memory-qk-norm-term", "area": "memory model", "file": PKG + "core/memory.py",
     "original": "qk_norm = q if model.qk_layernorm else 0",
     "replacement": "qk_norm = 0",
     "why": "a QK-norm model's attention keeps the query norm's output for the backward: its memory "
            "would be under-counted",
     "tests": [GUARDS + "::test_a_qk_norm_model_keeps_the_query_norms_output"]},
    {"id": "memory-sp-always", "area": "memory model", "file": PKG + "core/memory.py",
     "original": "rep = 1 / t if sp else 1.0",
     "replacement": "rep = 1 / t",
     "why": "without sequence parallelism the norms and the residual stream are whole on every TP rank",
     "tests": [GUARDS + "::test_sequence_parallel_shards_what_tensor_parallel_leaves_whole"]},
    {"id": "memory-interleaved-warmup", "area": "memory model", "file": PKG + "core/memory.py",
     "original": "warmup = 2 * (lay.pp - rank - 1) + (lay.vp - 1) * lay.pp",
     "replacement": "warmup = (lay.pp - rank - 1) + (lay.vp - 1) * lay.pp",
     "why": "the interleaved schedule warms up with 2 (PP - rank - 1) + (VP - 1) PP micro-batches "
            "(Megatron's schedules.py): fewer would under-count the first stage's activations",
     "tests": [GUARDS + "::test_in_flight_micro_batches_follow_megatrons_schedules"]},
    {"id": "memory-optimizer-shard-without-cp", "area": "memory model", "file": PKG + "core/memory.py",
     "original": "lay.tp, lay.ep, lay.etp, lay.dp * lay.cp, lay.expert_dp,",
     "replacement": "lay.tp, lay.ep, lay.etp, lay.dp, lay.expert_dp,",
     "why": "the distributed optimizer shards its state over the DP x CP ranks; over DP alone a CP "
            "layout is charged CP times the optimizer state",
     "tests": [GUARDS + "::test_the_distributed_optimizer_shards_over_context_parallel_ranks_too"]},
    # ---- the planner's search (core/planner.py)
    {"id": "planner-rank-ties", "area": "planner search", "file": PKG + "core/planner.py",
     "original": "out.append(left.pop(min(range(tied), key=lambda i: peak(left[i]))))",
     "replacement": "out.append(left.pop(0))",
     "why": "of layouts tied in speed the leaner goes first; the mutant takes the fastest by a hair",
     "tests": ["tests/test_core.py::test_rank_is_fastest_first_with_near_ties_to_the_leaner"]},
    {"id": "planner-heaviest-recompute", "area": "planner search", "file": PKG + "core/planner.py",
     "original": "                continue   # the heaviest fits: the lightest between that fits is the one\n",
     "replacement": "                pass\n",
     "why": "once the heaviest recompute fits, the lightest one that fits is costed; the mutant takes "
            "full recompute where selective recompute fits, losing time",
     "tests": [GUARDS + "::test_the_search_takes_the_lightest_recompute_that_fits"]},
    {"id": "planner-split-embedding-loss", "area": "planner search", "file": PKG + "core/planner.py",
     "original": "if (num_layers + 2) % pp == 0:",
     "replacement": "if (num_layers + 1) % pp == 0:",
     "why": "the embedding and the loss count as two layers in Megatron's split",
     "tests": ["tests/test_core.py::test_pipeline_splits_even_embedding_loss_and_uneven"]},
    {"id": "planner-qk-norm-keeps-sp", "area": "planner search", "file": PKG + "core/planner.py",
     "original": 'sp = lay.tp > 1 and not (c.get("sequence_parallel") is False or (model.qk_layernorm and not opts.te))',
     "replacement": 'sp = lay.tp > 1 and not c.get("sequence_parallel") is False',
     "why": "a QK-norm model on local layers runs TP without sequence parallelism: the mutant searches "
            "only layouts the rule book refuses, and loses every TP > 1 layout",
     "tests": ["tests/test_rules.py::test_a_qk_norm_model_is_never_planned_onto_sequence_parallel_local_layers"]},
    # ---- the script reader (adapter/shell.py)
    {"id": "shell-colon-default", "area": "script reader", "file": PKG + "adapter/shell.py",
     "original": 'is_set = value is not None and not (op.startswith(":") and value == "")',
     "replacement": "is_set = value is not None",
     "why": "${V:-w} takes w when V is empty too (${V-w} only when V is unset)",
     "tests": [GUARDS + "::test_the_reader_expands_defaults_as_bash_does"]},
    {"id": "shell-strip-longest", "area": "script reader", "file": PKG + "adapter/shell.py",
     "original": "cuts = range(len(value) + 1) if longest == suffix else range(len(value), -1, -1)",
     "replacement": "cuts = range(len(value) + 1) if longest != suffix else range(len(value), -1, -1)",
     "why": "${V#p} cuts the shortest match, ${V##p} the longest (and % / %% from the end)",
     "tests": [GUARDS + "::test_the_reader_strips_prefixes_and_suffixes_as_bash_does"]},
    {"id": "shell-append-replaces", "area": "script reader", "file": PKG + "adapter/shell.py",
     "original": "            return name, old + text\n",
     "replacement": "            return name, text\n",
     "why": "V+=text appends to a string variable; the mutant drops what the script set before",
     "tests": [GUARDS + "::test_the_reader_appends_to_strings_and_counts_as_bash_does"]},
    {"id": "shell-decrement", "area": "script reader", "file": PKG + "adapter/shell.py",
     "original": 'new = old + (1 if op == "++" else -1)',
     "replacement": "new = old + 1",
     "why": "(( N-- )) counts down",
     "tests": [GUARDS + "::test_the_reader_appends_to_strings_and_counts_as_bash_does"]},
    # ---- event deduplication (events/event.py, events/ledger.py)
    {"id": "events-incident-by-type", "area": "event deduplication", "file": PKG + "events/event.py",
     "original": '        what = "end"\n',
     "replacement": "        what = kind\n",
     "why": "every report of one job's end (trap, trigger, train, watcher) is one incident, whatever its type: "
            "keyed by type, a job.failed and a job.finished of one job would both act",
     "tests": ["tests/test_events.py::test_one_job_run_is_one_incident_whatever_reports_it"]},
    {"id": "events-incident-without-job", "area": "event deduplication", "file": PKG + "events/event.py",
     "original": "return f\"{event['run_id']}/{job}/{what}\"",
     "replacement": "return f\"{event['run_id']}/{what}\"",
     "why": "the next job of a run is a new incident: without the job in the key its failure is a duplicate "
            "of the first and is never resumed",
     "tests": ["tests/test_events.py::test_one_job_run_is_one_incident_whatever_reports_it"]},
    {"id": "events-seen-by-type", "area": "event deduplication", "file": PKG + "events/ledger.py",
     "original": 'self.data["events"][event["event_id"]] = {',
     "replacement": 'self.data["events"][event["type"]] = {',
     "why": "an event delivered twice is recognised by its id; keyed by type it is taken as a new report",
     "tests": [GUARDS + "::test_an_event_delivered_twice_is_one_report"]},
]


def tree_files(root: Path) -> list[str]:
    """The files git tracks or would track (ignored ones left out), as they are in the working tree."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                         capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (root / f).is_file()]


def copy_tree(root: Path, dest: Path) -> None:
    for name in tree_files(root):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    if (root / ".venv").exists():  # the tools look for the skill's own Python beside them
        (dest / ".venv").symlink_to(root / ".venv")


def run_tests(copy: Path, tests: list[str], timeout: int) -> tuple[int, float, str]:
    """pytest over the tests in the copy: (exit status, seconds, the last lines it printed)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # a restored file must never meet a stale .pyc
    started = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-o", "addopts=", "-p", "no:cacheprovider",
                               *tests], cwd=copy, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return -1, round(time.time() - started, 1), f"timed out after {timeout} s"
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    return proc.returncode, round(time.time() - started, 1), tail


def judge(mutant: dict, copy: Path, timeout: int) -> dict:
    path = copy / mutant["file"]
    text = path.read_text()
    found = text.count(mutant["original"])
    entry = {"id": mutant["id"], "area": mutant["area"], "file": mutant["file"], "tests": mutant["tests"]}
    if found != 1:
        return {**entry, "status": "stale", "why": f"the original text is in the file {found} times, not once"}
    path.write_text(text.replace(mutant["original"], mutant["replacement"]))
    try:
        code, seconds, tail = run_tests(copy, mutant["tests"], timeout)
    finally:
        path.write_text(text)
    # pytest: 0 all passed, 1 some failed; anything else (no tests collected, a usage error) says nothing
    status = {0: "survived", 1: "killed"}.get(code, "error")
    return {**entry, "status": status, "seconds": seconds, **({"pytest": tail} if status != "killed" else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests; run nothing")
    parser.add_argument("--timeout", type=int, default=600, help="seconds for one pytest run (default 600)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m["id"] in args.only]
    unknown = sorted(set(args.only or ()) - {m["id"] for m in MUTANTS})
    if unknown:
        parser.error(f"no mutant {', '.join(unknown)}")
    if args.list:
        print(json.dumps([{k: m[k] for k in ("id", "area", "file", "why", "tests")} for m in chosen], indent=1))
        return 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = Path(tmp) / "tree"
        copy_tree(ROOT, copy)
        tests = sorted({t for m in chosen for t in m["tests"]})
        print(f"mutants: the {len(tests)} test(s) on the unchanged copy first", file=sys.stderr, flush=True)
        code, seconds, tail = run_tests(copy, tests, args.timeout)
        baseline = {"status": "passed" if code == 0 else "failed", "seconds": seconds, "tests": tests}
        if code != 0:  # a test red without a mutant says nothing about one
            print(json.dumps({"baseline": {**baseline, "pytest": tail}, "mutants": []}, indent=1))
            return 2
        results = []
        for m in chosen:
            results.append(judge(m, copy, args.timeout))
            print(f"mutants: {m['id']}: {results[-1]['status']}", file=sys.stderr, flush=True)
    counts = {s: sum(r["status"] == s for r in results) for s in ("killed", "survived", "stale", "error")}
    print(json.dumps({"baseline": baseline, "counts": counts, "mutants": results}, indent=1))
    return 0 if counts["killed"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
