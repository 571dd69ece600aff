"""Megatron-Core training skill: plan, render, validate, train, bench and more.

Each tool is a function taking a JSON-able request dict and returning a JSON-able
response dict; ``tools/launch.py`` is the command line over the same functions.
"""
__version__ = "0.1.0"
