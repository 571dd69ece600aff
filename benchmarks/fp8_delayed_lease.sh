#!/usr/bin/env bash
# FP8 delayed scaling (runtime.fp8_scaling "delayed", runtime/fp8_delayed.py) against current
# scaling, on one GPU:
#   bash benchmarks/fp8_delayed_lease.sh OUTDIR speed    # kernel check; each lever, then its -delayed twin; BF16 1B
#   bash benchmarks/fp8_delayed_lease.sh OUTDIR parity   # FP8 delayed against BF16 on real text; a profile of 1B
# LEVERS (env, default "1b-fp8-planned 3b-fp8-planned") and BF16_LEVERS (default "1b-planned", the
# ratio's baseline in the same lease) name levers of benchmarks/requests/levers.json; each FP8
# lever has a twin named LEVER-delayed there.
# Results: OUTDIR/<current|delayed|bf16>/LEVER.json, OUTDIR/levers.md, OUTDIR/kernel-check.txt, OUTDIR/parity/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${1:?usage: fp8_delayed_lease.sh OUTDIR speed|parity}
PHASE=${2:?usage: fp8_delayed_lease.sh OUTDIR speed|parity}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/tools${PYTHONPATH:+:$PYTHONPATH}"
if [ "$PHASE" = speed ]; then
  # the Triton kernel against torch's own operations, bit for bit, before any timing
  timeout 120 "$PY" - > "$OUT/kernel-check.txt" 2>&1 <<'PY'
import torch
from megatron_skill.runtime import fp8_delayed
from megatron_skill.runtime.fp8_linear import E4M3, E5M2
torch.manual_seed(7)
for m, n in ((32768, 2048), (32768, 8192), (1000, 200)):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 3
    prev = x.float().abs().amax() * 0.5
    for dtype in (E4M3, E5M2):
        got = fp8_delayed._cast_transpose_amax_triton(x, prev, dtype)
        want = fp8_delayed.cast_transpose_amax(x.cpu(), prev.cpu(), dtype)
        same = all(torch.equal(a.float().cpu(), b.float()) for a, b in zip(got, want))
        print(m, n, dtype, "identical" if same else "DIFFERENT")
PY
  cat "$OUT/kernel-check.txt" >&2
  for lever in ${LEVERS:-1b-fp8-planned 3b-fp8-planned}; do
    timeout 400 "$PY" benchmarks/run_levers.py "$OUT/current" "$lever" >> "$OUT/levers.md" 2>> "$OUT/levers.err"
    timeout 400 "$PY" benchmarks/run_levers.py "$OUT/delayed" "$lever-delayed" >> "$OUT/levers.md" 2>> "$OUT/levers.err"
    tail -2 "$OUT/levers.md" >&2
  done
  for lever in ${BF16_LEVERS-1b-planned}; do
    timeout 400 "$PY" benchmarks/run_levers.py "$OUT/bf16" "$lever" >> "$OUT/levers.md" 2>> "$OUT/levers.err"
    tail -1 "$OUT/levers.md" >&2
  done
else
  timeout 420 "$PY" benchmarks/run_fp8_parity.py "$OUT/parity" --iters 300 --fp8-scaling delayed \
    > "$OUT/parity.out" 2> "$OUT/parity.err"
  tail -5 "$OUT/parity.out" >&2
  timeout 150 "$PY" benchmarks/run_levers.py "$OUT/delayed-profile" 1b-fp8-planned-delayed-profile \
    >> "$OUT/levers.md" 2>> "$OUT/levers.err"
  tail -1 "$OUT/levers.md" >&2
fi
