"""Kubernetes training manifests as validate reads them: the job step each pod runs, with the
pods' environment and the job's GPU count, so that the step is checked like any launch script.

A Kubeflow PyTorchJob (the manifests render writes, and others of that kind): the container
named "pytorch" of the Master replica (else the first), a `bash -c` / `sh -c` script in its
command or args, its env values, and nprocPerNode x the replicas of all roles as the world.
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import ToolError

LOOKS_LIKE = re.compile(r"^\s*kind:\s*PyTorchJob\s*$", re.M)


def is_manifest(text: str) -> bool:
    return bool(LOOKS_LIKE.search(text)) and bool(re.search(r"^\s*apiVersion:\s*kubeflow\.org/", text, re.M))


def job_step(text: str) -> dict[str, Any]:
    """{"script", "env", "num_gpus", "role", "name"} of the first PyTorchJob in text."""
    try:
        import yaml
    except ImportError:
        raise ToolError("environment", "reading a Kubernetes manifest needs PyYAML", where="/script",
                        fix="pip install pyyaml (tools/setup.sh's .venv has it), or validate the pod's script itself"
                        ) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    except yaml.YAMLError as e:
        raise ToolError("bad_request", f"the manifest is not YAML: {e}".splitlines()[0], where="/script",
                        fix="give the manifest as kubectl would read it") from None
    job = next((d for d in docs if d.get("kind") == "PyTorchJob"), None)
    specs = ((job or {}).get("spec") or {}).get("pytorchReplicaSpecs") or {}
    if not isinstance(specs, dict) or not specs:
        raise ToolError("invalid_script", "a PyTorchJob without pytorchReplicaSpecs", where="/script",
                        fix="give a PyTorchJob with Master (and Worker) replica specs")
    role = "Master" if "Master" in specs else next(iter(specs))
    pod = ((specs[role] or {}).get("template") or {}).get("spec") or {}
    containers = pod.get("containers") or []
    container = next((c for c in containers if c.get("name") == "pytorch"), containers[0] if containers else None)
    if not container:
        raise ToolError("invalid_script", f"the {role} replica has no container", where="/script",
                        fix="the training operator runs the container named pytorch")
    words = [str(w) for w in (container.get("command") or []) + (container.get("args") or [])]
    shell = next((i for i, w in enumerate(words[:-1]) if w.split("/")[-1] in ("bash", "sh") and words[i + 1] == "-c"),
                 None)
    if shell is None or shell + 2 >= len(words):
        # No shell script: the command itself is the launch (torchrun ... entry.py args).
        script = " ".join(_quote(w) for w in words)
    else:
        script = words[shell + 2]
    env = {e["name"]: str(e["value"]) for e in container.get("env") or []
           if isinstance(e, dict) and "name" in e and "value" in e}
    replicas = sum(int((s or {}).get("replicas") or 1) for s in specs.values())
    nproc = str(job["spec"].get("nprocPerNode", ""))
    num_gpus = replicas * int(nproc) if nproc.isdigit() else None
    return {"script": script, "env": env, "num_gpus": num_gpus, "role": role,
            "name": ((job.get("metadata") or {}).get("name")), "replicas": replicas}


def _quote(word: str) -> str:
    import shlex

    return shlex.quote(word)
