"""Command line over the tools: `launch.py TOOL [flags | --request FILE | --request -]`."""
from __future__ import annotations

import io
import json
import sys

from .contract import get_tool, main_for, tool_names, tools

USAGE = """usage: launch.py TOOL [flags | --request FILE | --request -]

Each tool prints one JSON object on stdout (progress goes to stderr) and exits non-zero
on error; `launch.py TOOL --help` lists its flags."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE + "\n\ntools:")
        for name, each in tools().items():
            print(f"  {name:14s} {each.summary}")
        return 0
    name = argv[0]
    if name not in tool_names():
        print(json.dumps({"ok": False, "tool": name, "error": {
            "code": "bad_request", "message": f"unknown tool {name!r}", "where": "argv[0]",
            "fix": f"one of: {', '.join(tool_names())}"}}))
        return 2
    if name in SUMMARIES and "--help" not in argv and "-h" not in argv:
        return _with_summary(lambda: main_for(get_tool(name), argv[1:]), SUMMARIES[name]())
    return main_for(get_tool(name), argv[1:])


def _plan_summary():
    from .tools.plan import summary

    return summary


# Tools whose answer a person at the terminal also gets in a few lines on stderr.
SUMMARIES = {"plan": _plan_summary}


def _with_summary(run, summarize) -> int:
    """Run a tool's command line; its stdout (the one JSON answer) goes out unchanged, and a
    summary of that answer for a person goes to stderr."""
    real, sys.stdout = sys.stdout, io.StringIO()
    try:
        code = run()
        text = sys.stdout.getvalue()
    finally:
        sys.stdout = real
    try:
        real.write(text)
        real.flush()
    except BrokenPipeError:  # the reader stopped early (| head): not our error
        sys.stdout = open("/dev/null", "w")
    try:
        envelope = json.loads(text)
    except ValueError:
        return code
    print(summarize(envelope), file=sys.stderr, flush=True)
    return code
