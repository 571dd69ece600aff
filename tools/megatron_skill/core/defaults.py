"""Defaults of the request's option objects (runtime, moe, kubernetes, ...), read from the request
schema (schemas/common.json, `$defs`): the one place they are written."""
from __future__ import annotations

import functools
import json
from typing import Any

from ..package_data import schema_dir

COMMON_SCHEMA = schema_dir() / "common.json"


@functools.lru_cache(maxsize=None)
def _defs() -> dict[str, Any]:
    return json.loads(COMMON_SCHEMA.read_text())["$defs"]


def schema_defaults(name: str) -> dict[str, Any]:
    """Every field of the options object `name`, with its default (None where it has none)."""
    return {k: p.get("default") for k, p in _defs()[name]["properties"].items()}
