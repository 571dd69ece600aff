#!/usr/bin/env python3
"""The skill's one entry point: `python tools/launch.py TOOL [flags | --request FILE | --request -]`.

Run it without arguments for the list of tools, and `TOOL --help` for a tool's flags.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from megatron_skill.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
