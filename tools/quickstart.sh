#!/usr/bin/env bash
# The embedded default, end to end: plan Llama-3 8B on 8 x H100 at sequence 8192, render its
# Slurm script, then train for 20 steps here: Llama-3.2 1B on the GPUs present (mock data), or
# the tiny model on CPU (a real Megatron-Core run with gloo) on the repo's sample corpus,
# tokenized by prepare-data, where there is no GPU.
#   bash tools/quickstart.sh [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/quickstart}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT"
"$PY" tools/launch.py plan --model llama3-8b --gpu h100-sxm --num-gpus 8 --seq-length 8192 --top 3 > "$OUT/plan.json"
"$PY" tools/launch.py render --model llama3-8b --gpu h100-sxm --num-gpus 8 --seq-length 8192 --launcher slurm \
  --output-dir "$OUT/llama3-8b" > "$OUT/render.json"
echo "quickstart: plan and render Llama-3 8B for 8 x H100 (seq 8192); then train here" >&2
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "quickstart: a GPU is here: training Llama-3.2 1B for 20 steps on mock data" >&2
  "$PY" tools/launch.py train --model llama3.2-1b --seq-length 4096 --global-batch-size 16 --runs-root "$OUT/runs" \
    --training '{"train_iters": 20, "log_interval": 5, "checkpoint": false, "eval_iters": 0, "mock_data": true}' > "$OUT/train.json"
else
  # Real text: the sample corpus made in this repo, tokenized byte-level by prepare-data.
  echo "quickstart: no GPU here: training the catalog's tiny-gpt (a real Megatron-Core GPTModel) on CPU for 20 steps, on the sample corpus" >&2
  "$PY" tools/launch.py prepare-data --input data/sample/corpus.jsonl --output-prefix "$OUT/corpus" > "$OUT/data.json"
  "$PY" tools/launch.py train --model tiny-gpt --runs-root "$OUT/runs" \
    --training "{\"train_iters\": 20, \"log_interval\": 5, \"save_interval\": 20, \"data_path\": [\"$OUT/corpus\"]}" \
    > "$OUT/train.json"
fi
"$PY" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
plan = json.load(open(f"{out}/plan.json"))["result"]
best = plan["plans"][0]
render = json.load(open(f"{out}/render.json"))["result"]
train = json.load(open(f"{out}/train.json"))
print(f"files:  {out}/plan.json, render.json, train.json (each one tool's JSON answer)")
print(f"plan:   llama3-8b on 8 x h100-sxm, seq 8192: {best['label']}, predicted {best['memory']['peak_gib']} GiB/GPU, "
      f"{best['tokens_per_s']:,} tokens/s, MFU {best['mfu']:.1%} ({plan['feasible']} feasible layouts)")
print(f"render: {render['files'][0]['path']} ({render['parser_check']} accepted {len(render['megatron_args'])} args)")
if train["ok"]:
    s = train["result"]["summary"]
    model = "llama3.2-1b" if train["result"]["backend"] == "gpu" else "tiny-gpt"
    print(f"train:  {model} on {train['result']['backend']}, run {train['result']['run_id']} in "
          f"{train['result']['run_dir']}: loss {s.get('first_loss')} -> "
          f"{s.get('final_loss')} over {s.get('last_iteration')} steps, {s.get('tokens_per_s')} tokens/s")
else:
    print("train:  failed:", train["error"]["message"], "->", train["error"].get("fix"))
    sys.exit(1)
PY
