#!/usr/bin/env python3
"""The skill's one entry point: `python tools/launch.py TOOL [flags | --request FILE | --request -]`.

Run it without arguments for the list of tools, and `TOOL --help` for a tool's flags.
Any Python >= 3.10 will do: a tool that needs what only the skill's .venv has (torch,
megatron-core) runs itself again under .venv/bin/python; where neither has it, the answer
is one JSON environment error whose fix is the set-up command.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_PYTHON = HERE.parent / ".venv" / "bin" / "python"
PLANNING = ("jinja2", "jsonschema")
TRAINING = PLANNING + ("numpy", "torch", "megatron.core")
# What each tool cannot run without; render and validate run Megatron's own parser where it is
# installed (without it they check against the stored flag manifest and say so).
CONVERSION = TRAINING + ("safetensors",)
NEEDS = {"train": TRAINING, "bench": TRAINING, "prepare-data": TRAINING,
         # a dry run too: it reads the safetensors headers and Megatron's checkpoint metadata
         "import-hf": CONVERSION, "export-hf": CONVERSION}
PREFERS = {"render": TRAINING, "validate": TRAINING, "doctor": TRAINING}


def _missing(modules):
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def _in_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV_PYTHON.parent.parent.resolve()


def _environment(tool: str) -> None:
    """Re-run under .venv when this Python lacks what the tool needs; or answer exit 5."""
    needed = NEEDS.get(tool, PLANNING)
    missing = _missing(needed)
    wants_more = bool(_missing(PREFERS.get(tool, ())))
    if (missing or wants_more) and VENV_PYTHON.exists() and not _in_venv() \
            and not os.environ.get("MEGATRON_SKILL_NO_REEXEC"):
        os.environ["MEGATRON_SKILL_NO_REEXEC"] = "1"  # once: never a loop
        os.environ["PYTHONUTF8"] = "1"
        sys.stdout.flush()
        os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), str(Path(__file__).resolve()), *sys.argv[1:]])
    if missing:
        planning_only = not set(missing) - set(PLANNING)
        fix = ("pip install jinja2 jsonschema (the planning tools), or tools/setup.sh for everything"
               if planning_only else "tools/setup.sh (a Python 3.12 .venv with torch and megatron-core; "
               "launch.py then uses it by itself)")
        print(json.dumps({"ok": False, "tool": tool, "error": {
            "code": "environment", "message": f"{sys.executable} cannot import {', '.join(missing)}, which "
            f"{tool} needs" + ("" if VENV_PYTHON.exists() else "; there is no .venv here"),
            "where": "python", "fix": fix}}))
        sys.exit(5)


def _streams() -> None:
    """stdin, stdout and stderr as the contract needs them, whatever the caller left:
    - a standard descriptor the caller closed (`2>&-`, a daemon's closed fds) is opened on
      /dev/null, so that no file the tool opens later takes its number (the answer, or a library's
      print, would then be written into that file) and print(file=sys.stderr) does not fall back
      to stdout;
    - the answer is JSON, which is UTF-8 (RFC 8259): stdout and stderr are UTF-8 whatever
      PYTHONIOENCODING or the locale say (an ASCII locale raised on the first non-ASCII path in a
      progress line; PYTHONIOENCODING=utf-16 made stdout no JSON a reader could parse)."""
    for fd, mode in ((0, os.O_RDONLY), (1, os.O_WRONLY), (2, os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, mode)
            if opened != fd:  # the lowest free number is fd itself; this is a guard only
                os.dup2(opened, fd)
                os.close(opened)
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None:  # closed at start: Python set it to None
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", encoding="utf-8", closefd=False,
                                    errors="strict" if fd == 0 else "backslashreplace"))
        elif fd and hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict")
    os.environ["PYTHONIOENCODING"] = "utf-8"  # child processes too (the trainer's log, a hook's output)
    sys.stderr = _Shown(sys.stderr)


class _Shown:
    """stderr with the control characters of what is written escaped (tab, newline and carriage
    return aside): a progress line, a summary or a warning that quotes a request's text (a path or
    a name holding an escape sequence) never recolours, retitles or clears the terminal."""

    TABLE = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), 0x0b, 0x0c, *range(0x0e, 0x20), 0x7f,
                                         *range(0x80, 0xa0))}

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._stream.write(text.translate(self.TABLE) if isinstance(text, str) else text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _utf8_mode() -> None:
    """Paths are text in requests and in answers: under an ASCII locale with Python's locale
    coercion and UTF-8 mode off (LANG=C PYTHONCOERCECLOCALE=0 PYTHONUTF8=0), the first non-ASCII
    name raised UnicodeEncodeError deep in a tool. Run again once in UTF-8 mode, where a path is
    encoded as the UTF-8 the request spelled."""
    if sys.flags.utf8_mode or sys.getfilesystemencoding().lower().replace("-", "") == "utf8":
        return
    if os.environ.get("MEGATRON_SKILL_UTF8_REEXEC"):
        return  # once: never a loop
    os.environ["MEGATRON_SKILL_UTF8_REEXEC"] = "1"
    os.environ["PYTHONUTF8"] = "1"
    os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]])


def _working_folder(tool: str) -> None:
    """The folder the tool runs in must exist: relative paths resolve there, and torch's own
    libraries fail to load without it (the process died in oneMKL with nothing on stdout). A shell
    whose folder another removed gets one environment error at once."""
    try:
        os.getcwd()
    except OSError as e:
        print(json.dumps({"ok": False, "tool": tool, "error": {
            "code": "environment", "message": f"the working folder is gone ({e.strerror}): it was removed after "
            "this shell entered it", "where": "cwd", "fix": "cd to an existing folder and run it again"}}))
        sys.stdout.flush()
        os._exit(5)


def _quiet() -> None:
    """Library warnings (Megatron's 'TE / apex not installed', torch's 'No CUDA runtime') stay
    off the terminal, here and in child processes; MEGATRON_SKILL_DEBUG=1 shows them. A
    training run keeps its own in its log file."""
    import logging
    import warnings

    if os.environ.get("MEGATRON_SKILL_DEBUG"):
        os.environ["PYTHONWARNINGS"] = "default"
        warnings.simplefilter("default")
        return

    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.simplefilter("ignore")
    for name in ("torch.utils.cpp_extension", "torch.distributed", "megatron"):
        logging.getLogger(name).setLevel(logging.ERROR)


if __name__ == "__main__":
    _utf8_mode()
    _streams()
    tool = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "help"
    _working_folder(tool)
    _environment(tool)
    _quiet()
    sys.path.insert(0, str(HERE))
    from megatron_skill.cli import main

    code = main()
    # The answer is printed and every file the tool wrote is closed: leave without the
    # interpreter's teardown, which takes over a second once torch and Megatron are imported.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
