"""The tools, one module each; this package lists them. A tool module imports the contract and
never this package, so nothing imports in a circle; the contract finds the tools here when a
request is made (contract.call)."""
from . import bench, doctor, export_hf, import_hf, logs, on_event, plan, prepare_data, render, train, validate

TOOLS = {m.TOOL.name: m.TOOL for m in (plan, render, validate, train, bench, doctor, logs, prepare_data,
                                          on_event, import_hf, export_hf)}
