"""Command line over the tools: `launch.py TOOL [flags | --request FILE | --request -]`."""
from __future__ import annotations

import json
import sys

from .contract import main_for, tools

USAGE = """usage: launch.py TOOL [flags | --request FILE | --request -]

Each tool prints one JSON object on stdout (progress goes to stderr) and exits non-zero
on error; `launch.py TOOL --help` lists its flags."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    registry = tools()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE + "\n\ntools:")
        for name, tool in registry.items():
            print(f"  {name:14s} {tool.summary}")
        return 0
    name = argv[0]
    if name not in registry:
        print(json.dumps({"ok": False, "tool": name, "error": {
            "code": "bad_request", "message": f"unknown tool {name!r}", "where": "argv[0]",
            "fix": f"one of: {', '.join(registry)}"}}))
        return 2
    return main_for(registry[name], argv[1:])
