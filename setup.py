"""The package's file list, which pyproject.toml alone cannot say: every package under tools/
(core/ and adapter/ are namespace packages, without an __init__.py), and the skill's schemas/ and
templates/ folders, kept at the repository's root where SKILL.md names them, shipped inside the
package as megatron_skill/schemas and megatron_skill/templates (megatron_skill.package_data finds
them in either place)."""
from setuptools import find_namespace_packages, setup

DATA_PACKAGES = {"megatron_skill.schemas": "schemas", "megatron_skill.templates": "templates"}

setup(
    packages=find_namespace_packages("tools", include=["megatron_skill", "megatron_skill.*"], exclude=["*.__pycache__"])
    + list(DATA_PACKAGES),
    package_dir={"": "tools", **DATA_PACKAGES},
    package_data={"megatron_skill.core.catalog": ["*.json"], "megatron_skill.schemas": ["*.json"],
                  "megatron_skill.templates": ["*.j2"]},
)
