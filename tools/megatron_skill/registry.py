"""Imports every tool module so that each registers itself with the contract."""
from . import plan  # noqa: F401
from . import render  # noqa: F401
