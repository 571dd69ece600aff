#!/usr/bin/env python3
"""Write catalog/megatron_flags.json: every flag of Megatron's pretrain_gpt.py parser.

Run with the megatron-core the skill targets installed:
    .venv/bin/python dev/gen_megatron_manifest.py
render and validate check flags against it where megatron-core is not importable; a test
regenerates it from the installed package and requires it to be identical.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from megatron_skill.adapter.flags import MANIFEST_PATH, build_manifest  # noqa: E402

if __name__ == "__main__":
    manifest = build_manifest()
    MANIFEST_PATH.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {MANIFEST_PATH} ({len(manifest['flags'])} flags, megatron-core {manifest['megatron_core']})",
          file=sys.stderr)
