"""The tools, one module each; this package names them. A tool module imports the contract and
never this package, so nothing imports in a circle. A tool's module is imported when that tool is
asked for (contract.call, the command line): a call pays for its own tool's imports, not for the
other ten's (numpy, the events, the script reader: about 0.4 s of a cold call)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..contract import Tool

# tool name -> its module in this package, in the order --help lists them
MODULES = {"plan": "plan", "render": "render", "validate": "validate", "train": "train", "bench": "bench",
           "doctor": "doctor", "logs": "logs", "prepare-data": "prepare_data", "on-event": "on_event",
           "import-hf": "import_hf", "export-hf": "export_hf"}
TOOLS: dict[str, Tool] = {}   # the tools imported so far, by name


def get(name: str) -> Tool:
    """The tool of that name (KeyError for a name not in MODULES), its module imported once."""
    if name not in TOOLS:
        TOOLS[name] = importlib.import_module(f"{__name__}.{MODULES[name]}").TOOL
    return TOOLS[name]
