#!/usr/bin/env bash
# Measure what the planner's calibration of this GPU rests on, and the planner's first layout for
# each single-GPU benchmark request against what it predicts:
#   bash benchmarks/calibrate_card.sh OUTDIR [LEVER ...]
# 1. bench --calibrate: GEMM (BF16, FP8), causal attention and HBM rates (OUTDIR/calibrate.json);
# 2. each lever of benchmarks/requests/levers.json named (default: the planner's first layout for
#    the 1B, 3B and Qwen2.5-1.5B shapes, BF16 and FP8, with a kernel profile of one iteration);
# 3. OUTDIR/results.tgz: every answer, log and profile, packed after each step (a run cut short
#    still leaves what it finished).
# benchmarks/fit_calibration.py OUTDIR turns them into the GPU's entry of catalog/calibration.json.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${1:?usage: calibrate_card.sh OUTDIR [LEVER ...]}
shift
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
LEVERS=("$@")
[ ${#LEVERS[@]} -gt 0 ] || LEVERS=(1b-planned-profile 1b-fp8-planned-profile 3b-planned-profile
                                   qwen1.5b-planned-profile qwen1.5b-fp8-planned-profile 3b-fp8-planned)
mkdir -p "$OUT"
pack() { tar czf "$OUT/results.tgz.tmp" -C "$WORK" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; }
if [ -z "${SKIP_CALIBRATE:-}" ]; then
  echo "== calibrate" >&2
  timeout 300 "$PY" tools/launch.py bench --calibrate --runs-root "$WORK/runs" > "$WORK/calibrate.json" 2> "$WORK/calibrate.err"
  echo "   rc=$?" >&2
  pack
fi
for lever in "${LEVERS[@]}"; do
  PYTHON="$PY" timeout 400 "$PY" benchmarks/run_levers.py "$WORK/levers" "$lever" >> "$WORK/levers.md" 2>> "$WORK/levers.err"
  tail -1 "$WORK/levers.md" >&2
  pack
done
