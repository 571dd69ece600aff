#!/usr/bin/env bash
# Reproduce every GPU figure in references/benchmarks.md on the GPU(s) of this machine:
#   bash benchmarks/run_benchmarks.sh OUTDIR
# Needs Python with torch and megatron-core (tools/setup.sh). Each step is a launch.py call;
# the JSON each prints is kept in OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${1:?usage: run_benchmarks.sh OUTDIR}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
RUNS="$OUT/runs"
ONLY=${ONLY:-doctor calibrate bench-3b bench-1b levers peers kill-resume quickstart}  # a subset: ONLY="bench-1b kill-resume"
want() { [[ " $ONLY " == *" $1 "* ]]; }
step() { local name=$1 limit=$2; shift 2; echo "== $name" >&2; timeout "$limit" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"; echo "   rc=$?" >&2; }

want doctor && step doctor 120 "$PY" tools/launch.py doctor
want calibrate && step calibrate 300 "$PY" tools/launch.py bench --calibrate --runs-root "$RUNS"
want bench-3b && step bench-3b 400 "$PY" tools/launch.py bench --request benchmarks/requests/llama-3b-shape-bf16.json --runs-root "$RUNS"
want bench-1b && step bench-1b 400 "$PY" tools/launch.py bench --request benchmarks/requests/llama-1b-shape-bf16.json --runs-root "$RUNS"
# Each throughput lever of benchmarks/requests/levers.json, one bench call each.
want levers && { echo "== levers" >&2; PYTHON="$PY" "$PY" benchmarks/run_levers.py "$OUT/levers" > "$OUT/levers.md" 2> "$OUT/levers.err"; }
# Issue 38's table: each shape's bench (BF16, FP8) beside the Hugging Face peers (liger-kernel and
# torchao must import; a peer that cannot is recorded in OUTDIR/peers/SHAPE/peers.err).
want peers && for shape in 1b 3b qwen1.5b; do echo "== peers $shape" >&2; PYTHON="$PY" bash benchmarks/peer_lease.sh "$OUT/peers" "$shape"; done

# A train run killed with SIGKILL mid-run (the whole process group, as a node failure would),
# refused when started again without --resume, then resumed from its last checkpoint.
if want kill-resume; then
echo "== kill-resume" >&2
KREQ=benchmarks/requests/kill-resume-125m.json
run_dir=$("$PY" tools/launch.py train --request "$KREQ" --runs-root "$RUNS" --dry-run 2>/dev/null |
  "$PY" -c 'import json, sys; print(json.load(sys.stdin)["result"]["run_dir"])')
log="$run_dir/logs/train.log"
setsid "$PY" tools/launch.py train --request "$KREQ" --runs-root "$RUNS" > "$OUT/kill-first.json" 2> "$OUT/kill-first.err" &
pid=$!
for _ in $(seq 1 600); do
  if [ -f "$log" ] && grep -qE "iteration +25/" "$log"; then break; fi
  sleep 0.5
done
kill -9 -- -"$pid" 2>/dev/null; sleep 3
echo "   killed after: $(grep -oE 'iteration +[0-9]+/' "$log" | tail -1)" >&2
step kill-norsm 120 "$PY" tools/launch.py train --request "$KREQ" --runs-root "$RUNS"
step kill-resume 400 "$PY" tools/launch.py train --request "$KREQ" --runs-root "$RUNS" --resume
cp "$log" "$OUT/kill-resume-train.log" 2>/dev/null
fi

# The README's first command: plan, render and a short train of the embedded default.
want quickstart && step quickstart 400 bash tools/quickstart.sh "$OUT/quickstart"
