import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
os.environ.setdefault("PYTHONWARNINGS", "ignore")

# Property tests are derandomised (the same examples every run) so that a submission never
# fails by chance; HYPOTHESIS_PROFILE=wide searches further at random, outside CI.
settings.register_profile("fixed", derandomize=True, print_blob=True)
settings.register_profile("wide", max_examples=1000, derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

# Every answer any test gets from a tool is checked against the tool's response schema
# (schemas/<tool>.response.json, which holds its error envelope too), whatever else the test
# asserts: each contract.call in this process, and each answer launch.py prints (run_cli's
# processes, run_inproc's command lines, whose argument errors never reach contract.call).
_ANSWER_VALIDATORS: dict = {}
# What launch.py answers for a tool it does not know: an error envelope with no tool schema of its own.
_UNKNOWN_TOOL_ANSWER = {"type": "object", "required": ["ok", "tool", "error"],
                        "properties": {"ok": {"const": False}, "tool": {"type": "string"},
                                       "error": {"$ref": "common.json#/$defs/error"}}}


def check_answer(answer, tool: str | None = None) -> None:
    """A tool's JSON answer (success or error) against its response schema; text (--help) and
    anything else that is no envelope is left alone. tool: the tool asked, else the answer's own."""
    if not isinstance(answer, dict) or "ok" not in answer:
        return
    from megatron_skill import contract

    name = str(tool or answer.get("tool"))
    if name not in _ANSWER_VALIDATORS:
        known = "/" not in name and (contract.SCHEMA_DIR / f"{name}.response.json").is_file()
        _ANSWER_VALIDATORS[name] = (
            contract.validator(contract.load_schema(name, "response") if known else _UNKNOWN_TOOL_ANSWER),
            f"schemas/{name}.response.json" if known else "the error envelope (schemas/common.json)")
    checker, schema = _ANSWER_VALIDATORS[name]
    errors = sorted(checker.iter_errors(answer), key=lambda e: list(e.absolute_path))
    assert not errors, (f"{name}'s answer breaks {schema} at "
                        f"/{'/'.join(map(str, errors[0].absolute_path))}: {errors[0].message}")


def _check_every_response() -> None:
    from megatron_skill import contract

    real = contract.call

    def checked(tool_name, request, ctx=None):
        env = real(tool_name, request, ctx)
        check_answer(env, tool_name)
        return env

    contract.call = checked


_check_every_response()

# The inner loop (`pytest tests -m "unit and not slow"`): the unit tests of core, adapter, the
# contract and the guards, files that neither train nor start a process of their own for long.
UNIT_FILES = {"test_core.py", "test_rules.py", "test_memory_model.py", "test_moe_options.py", "test_script_reading.py",
              "test_mutant_guards.py", "test_registry.py", "test_attention_kernels.py", "test_imports.py",
              "test_evidence.py", "test_catalog.py", "test_planner_truth.py", "test_megatron_options.py",
              "test_pipeline_split.py", "test_answer_schemas.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in UNIT_FILES:
            item.add_marker(pytest.mark.unit)

# CI sets this: a test that would be skipped for a missing system component fails instead,
# so that coverage is never lost quietly there.
REQUIRE_ALL = os.environ.get("MEGATRON_SKILL_REQUIRE_SYSTEM") == "1"


def missing(what: str, how: str) -> None:
    """Skip (or, in CI, fail) a test that needs something this machine lacks, saying how to get it."""
    message = f"{what} is not installed here: {how}"
    if REQUIRE_ALL:
        pytest.fail(message + " (MEGATRON_SKILL_REQUIRE_SYSTEM=1: required)")
    pytest.skip(message)


def system_tool(name: str, how: str) -> str:
    """The path of a program, looked up in the venv's bin (shellcheck comes from PyPI) and PATH."""
    path = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if path is None:
        missing(name, how)
    return path


def require_modules(*names: str) -> None:
    """For a test module that needs the training runtime: skip it where it is absent (the
    planning-only install), so that collection never fails."""
    import importlib.util

    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            if REQUIRE_ALL:
                raise RuntimeError(f"{name} is required here (MEGATRON_SKILL_REQUIRE_SYSTEM=1)")
            pytest.skip(f"{name} is not installed: run tools/setup.sh", allow_module_level=True)


def run_cli(*args: str, stdin: str | None = None, timeout: int = 600, env: dict | None = None):
    """Run tools/launch.py as a user would; returns (exit code, parsed stdout JSON, stderr)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    try:
        out = json.loads(proc.stdout) if proc.stdout.strip() else None
    except json.JSONDecodeError:
        out = proc.stdout
    check_answer(out)
    return proc.returncode, out, proc.stderr


def run_inproc(*args: str, stdin: str | None = None, timeout: int = 600, env: dict | None = None):
    """launch.py's command line, run in this process (the same argument parsing, envelope,
    stdout and exit code, without the seconds a new interpreter spends importing Megatron):
    what most tests need. run_cli is for what needs a process of its own (kills, the
    interpreter switch, the terminal's warnings)."""
    import io
    import tempfile

    from megatron_skill.cli import main

    saved_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    cwd, saved_streams = os.getcwd(), (sys.stdin, sys.stdout, sys.stderr)
    out_file, err_file = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    sys.stdout.flush(), sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    try:
        os.chdir(ROOT)
        os.dup2(out_file.fileno(), 1)
        os.dup2(err_file.fileno(), 2)
        # Python's streams on the descriptors themselves, as in a process of its own (pytest's
        # capture replaces them with its own files, which would bypass the tool's fd redirection).
        sys.stdin = io.StringIO(stdin or "")
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        code = main(list(args))
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        os.dup2(saved_out, 1), os.dup2(saved_err, 2)
        os.close(saved_out), os.close(saved_err)
        os.chdir(cwd)
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    out_file.seek(0), err_file.seek(0)
    stdout, stderr = out_file.read(), err_file.read()
    try:
        out = json.loads(stdout) if stdout.strip() else None
    except json.JSONDecodeError:
        out = stdout
    check_answer(out)
    return code, out, stderr


def wait_until(predicate, timeout: float, what: str, every: float = 0.3):
    """predicate's first true value within timeout seconds, polled every `every` seconds."""
    end = time.time() + timeout
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def cli():
    return run_inproc


# One Slurm test at a time over all xdist workers, and one start of the cluster: a file lock, since
# xdist's loadgroup (the tests' xdist_group("slurm") marks) does not keep a group on one worker with
# pytest 9.2 and xdist 3.8 (seen: the six tests of a group spread over three workers).
SLURM_LOCK = Path(tempfile.gettempdir()) / "megatron-skill-tests-slurm.lock"


@contextlib.contextmanager
def slurm_lock():
    with open(SLURM_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A one-node Slurm cluster on this machine (tests/slurm_cluster.sh), started once."""
    for name in ("sbatch", "slurmctld", "slurmd", "munged"):
        system_tool(name, "tools/setup.sh installs Slurm as root with apt (apt-get install slurmctld slurmd munge)")
    with slurm_lock():
        subprocess.run([str(ROOT / "tests" / "slurm_cluster.sh"), "start"], check=True, timeout=120)
    return True


@pytest.fixture
def slurm(slurm_cluster):
    """The cluster, to this test alone while it runs."""
    with slurm_lock():
        yield True
