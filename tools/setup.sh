#!/usr/bin/env bash
# Set up the skill in ./.venv: the planning tools, the training runtime (torch, megatron-core)
# and the test tools. Idempotent: a second run only checks. Needs Python 3.12 (Megatron-Core 0.19).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for candidate in "${PYTHON:-}" python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python) || { echo "setup: Python 3.12 not found (Megatron-Core 0.19 needs it); set PYTHON=/path/to/python3.12" >&2; exit 5; }
  echo "setup: creating .venv with $py" >&2
  "$py" -m venv .venv
fi
if ! .venv/bin/python -c 'import megatron.core, torch, jinja2, jsonschema, pytest, hypothesis, tokenizers' 2>/dev/null; then
  echo "setup: installing torch, megatron-core and test tools (several GB the first time)" >&2
  .venv/bin/python -m pip install -q --upgrade pip >&2
  .venv/bin/python -m pip install -q -e ".[train,test]" >&2
fi
echo "setup: ready ($(.venv/bin/python -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)'))" >&2
