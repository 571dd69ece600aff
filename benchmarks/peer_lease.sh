#!/usr/bin/env bash
# Issue 38's throughput table on one GPU, in one lease: the skill's bench at the planner's choice
# beside the Hugging Face peers (benchmarks/peers.py), one shape at a time:
#   bash benchmarks/peer_lease.sh OUTDIR SHAPE [PART]
#   SHAPE: 1b, 3b or qwen1.5b.  PART: skill (BF16 and FP8 bench), peers (Liger, torchao Float8),
#   or both (the default). The peers need liger-kernel and torchao importable.
# Each answer lands in OUTDIR/SHAPE/; the table's last lines go to stderr as they finish.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${1:?usage: peer_lease.sh OUTDIR SHAPE [PART]}
SHAPE=${2:?usage: peer_lease.sh OUTDIR SHAPE [PART]}
PART=${3:-both}
PY=${PYTHON:-python3}
case "$SHAPE" in
  1b) REQ=benchmarks/requests/llama-1b-shape-bf16.json ;;
  3b) REQ=benchmarks/requests/llama-3b-shape-bf16.json ;;
  qwen1.5b) REQ=benchmarks/requests/qwen2.5-1.5b-shape-bf16.json ;;
  *) echo "unknown shape $SHAPE (1b, 3b, qwen1.5b)" >&2; exit 2 ;;
esac
mkdir -p "$OUT/$SHAPE"
if [ "$PART" != peers ]; then
  for lever in "$SHAPE-planned" "$SHAPE-fp8-planned"; do
    PYTHON="$PY" timeout 400 "$PY" benchmarks/run_levers.py "$OUT/$SHAPE" "$lever" >> "$OUT/$SHAPE/skill.md" 2>> "$OUT/$SHAPE/skill.err"
    tail -1 "$OUT/$SHAPE/skill.md" >&2
  done
fi
if [ "$PART" != skill ]; then
  for peer in liger torchao-fp8; do
    timeout 400 "$PY" benchmarks/peers.py "$REQ" "$peer" --mbs "${PEER_MBS:-2,4,8}" --out "$OUT/$SHAPE/$peer.json" \
      > /dev/null 2>> "$OUT/$SHAPE/peers.err"
    echo "$peer: $("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["best"])' "$OUT/$SHAPE/$peer.json" 2>&1)" >&2
  done
fi
