"""Where the skill's data files are, the one place every reader asks.

In a checkout, schemas/ and templates/ sit at the repository's root (the folders SKILL.md and the
docs name); an installed package carries them inside itself (setup.py maps those two folders to
megatron_skill/schemas and megatron_skill/templates). The catalogs live in core/catalog/ either
way. The package is found through importlib.resources, so the answer follows the import, not
the working directory.
"""
from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

# The folders setup.py ships inside the package, by the name they have in a checkout.
DATA_FOLDERS = ("schemas", "templates")


@functools.lru_cache(maxsize=None)
def package_dir() -> Path:
    """The megatron_skill package's folder (the skill runs from files, never from a zip archive)."""
    here = resources.files(__package__)
    if not isinstance(here, Path):
        raise RuntimeError(f"megatron_skill is imported from {here}, not from a folder: install it as files")
    return here


@functools.lru_cache(maxsize=None)
def data_root() -> Path:
    """The folder holding schemas/ and templates/: the package itself once installed, else the
    repository the package sits in (tools/megatron_skill)."""
    package = package_dir()
    if all((package / name).is_dir() for name in DATA_FOLDERS):
        return package
    return package.parents[1]


def schema_dir() -> Path:
    return data_root() / "schemas"


def template_dir() -> Path:
    return data_root() / "templates"


def catalog_dir() -> Path:
    return package_dir() / "core" / "catalog"
