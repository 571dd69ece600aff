#!/usr/bin/env bash
# One bench lever at an earlier commit and at this tree, one after the other on the same GPU
# (a code move must not cost throughput):
#   bash benchmarks/before_after.sh COMMIT OUTDIR [LEVER]     # LEVER: default 3b-planned
# The earlier tree comes from `git archive COMMIT` (run where the repository's history is); each
# answer lands in OUTDIR/LEVER-before.json and OUTDIR/LEVER-after.json.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
COMMIT=${1:?usage: before_after.sh COMMIT OUTDIR [LEVER]}
OUT=${2:?usage: before_after.sh COMMIT OUTDIR [LEVER]}
LEVER=${3:-3b-planned}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
mkdir -p "$OUT" "$WORK/before"
git archive "$COMMIT" | tar -x -C "$WORK/before" || exit 1
for side in before after; do
  tree=$PWD; [ "$side" = before ] && tree=$WORK/before
  (cd "$tree" && PYTHON="$PY" timeout 400 "$PY" benchmarks/run_levers.py "$WORK/$side" "$LEVER" > "$WORK/$side.md" 2> "$WORK/$side.err")
  cp "$WORK/$side/$LEVER.json" "$OUT/$LEVER-$side.json" 2>/dev/null
  echo "$side: $(tail -1 "$WORK/$side.md")" >&2
done
