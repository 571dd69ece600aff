"""A new user's machine: any Python finds the right interpreter, answers name real flags,
the terminal stays quiet, --help explains every option, nothing runs long without saying so."""
import ast
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli

from megatron_skill.contract import build_parser, call, tools

LAUNCH = str(ROOT / "tools" / "launch.py")
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


def _python_without_the_runtime() -> str:
    """A Python other than this one that lacks torch (the system's), or skip."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "python3.11", "python3"):
        proc = subprocess.run([candidate, "-c", "import sys, importlib.util as u; "
                               "sys.exit(0 if sys.version_info >= (3, 10) and not u.find_spec('torch') else 1)"],
                              capture_output=True) if _exists(candidate) else None
        if proc is not None and proc.returncode == 0:
            return candidate
    pytest.skip("no second Python without torch on this machine")


def _exists(cmd: str) -> bool:
    from shutil import which
    return which(cmd) is not None


def test_any_python_runs_a_training_tool_through_the_venv(tmp_path):
    if not VENV_PYTHON.exists():
        pytest.skip("no .venv: run tools/setup.sh")
    python = _python_without_the_runtime()
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_SKILL_NO_REEXEC"}
    proc = subprocess.run([python, LAUNCH, "train", "--model", "tiny-gpt", "--backend", "cpu", "--dry-run",
                           "--runs-root", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["ok"], proc.stderr[-2000:]
    assert out["result"]["train_iters"] == 50  # the CPU default: about a minute


def test_without_the_runtime_train_is_an_environment_error_with_the_setup_fix(tmp_path):
    python = _python_without_the_runtime()
    # As on a machine without .venv: the re-run is switched off.
    proc = subprocess.run([python, LAUNCH, "train", "--model", "tiny-gpt", "--dry-run", "--runs-root",
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEGATRON_SKILL_NO_REEXEC": "1"})
    out = json.loads(proc.stdout)
    assert proc.returncode == 5 and out["error"]["code"] == "environment"
    assert "tools/setup.sh" in out["error"]["fix"] and not list(tmp_path.iterdir())


def test_train_checks_the_jobs_python_before_anything_dry_run_included(tmp_path):
    python = _python_without_the_runtime()
    env = call("train", {"model": "tiny-gpt", "backend": "gpu", "gpu": "h100-sxm", "num_gpus": 1,
                         "python": python, "dry_run": True, "runs_root": str(tmp_path)})
    assert not env["ok"] and env["error"]["code"] == "environment" and env["error"]["where"] == "/python"
    assert "tools/setup.sh" in env["error"]["fix"] and not list(tmp_path.iterdir())


def test_a_cpu_dry_run_states_iterations_and_time(tmp_path):
    env = call("train", {"model": "tiny-gpt", "backend": "cpu", "dry_run": True, "runs_root": str(tmp_path)})
    res = env["result"]
    # About a minute by default (measured: 65.7 s for these 50 iterations on 2 cores).
    assert res["train_iters"] == 50 and 30 < res["estimated_seconds"] < 120 and res["start"] == "new"
    longer = call("train", {"model": "tiny-gpt", "backend": "cpu", "dry_run": True, "runs_root": str(tmp_path),
                            "training": {"train_iters": 1000}})["result"]
    assert longer["train_iters"] == 1000 and longer["estimated_seconds"] > 10 * res["estimated_seconds"]


@pytest.mark.slow
def test_library_warnings_stay_off_the_terminal_unless_asked(tmp_path):
    args = ["render", "--model", "llama3.2-1b", "--num-gpus", "8", "--output-dir", str(tmp_path / "r")]
    rc, out, err = run_cli(*args)
    assert rc == 0 and out["ok"]
    assert "Warning" not in err and "No CUDA runtime" not in err and err.strip().startswith("render:")
    rc, _, debug = run_cli(*args, "--dry-run", env={"MEGATRON_SKILL_DEBUG": "1",
                                                    "MEGATRON_SKILL_CACHE": str(tmp_path / "cache")})
    assert rc == 0 and "Warning" in debug  # Megatron's own, when its parser is imported


def test_help_describes_every_option_and_lists_the_catalog():
    for name, tool in tools().items():
        parser = build_parser(tool)
        for action in parser._actions:
            assert (action.help or "").strip(), f"{name} {action.option_strings} has no help"
    rc = subprocess.run([sys.executable, LAUNCH, "plan", "--help"], capture_output=True, text=True, timeout=60)
    assert "llama3-70b" in rc.stdout and "h100-sxm" in rc.stdout and "fields: tp, pp" in rc.stdout


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _fix_texts():
    """Every fix text an error path can answer with, as written in the source: the fix= of
    each ToolError, the fix of each validate finding, the rule fixes and the log hints."""
    out = []
    for path in sorted((ROOT / "tools" / "megatron_skill").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "ToolError":
                parts = [kw.value for kw in node.keywords if kw.arg == "fix"]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_finding" and len(node.args) >= 3:
                parts = [node.args[2]]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Rule" and len(node.args) >= 2:
                parts = [node.args[1]]   # a rule's fix (core/layout.py)
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "FAILURES" for t in node.targets):
                parts = [node.value]
            else:
                continue
            for part in parts:
                out += [(path.name, c.value) for c in ast.walk(part)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return out


def test_every_flag_a_fix_names_exists():
    import argparse

    from megatron_skill.adapter import flags as megatron_flags
    from megatron_skill.adapter.skill_flags import add_skill_arguments
    ours = {"--request", "--pretty", "--help"}
    for tool in tools().values():
        ours |= {o for a in build_parser(tool)._actions for o in a.option_strings}
    skill = argparse.ArgumentParser(add_help=False)
    add_skill_arguments(skill)
    megatron = {o for a in megatron_flags.manifest_parser()._actions for o in a.option_strings}
    megatron |= {o for a in skill._actions for o in a.option_strings}
    texts = _fix_texts()
    assert len(texts) > 50
    unknown = sorted({(where, flag) for where, text in texts for flag in FLAG.findall(text)
                      if flag not in ours | megatron})
    assert unknown == []


def test_bench_without_a_gpu_names_a_command_that_exists(tmp_path):
    env = call("bench", {"model": "llama3.2-1b", "runs_root": str(tmp_path)})
    assert env["error"]["code"] == "environment"
    fix = env["error"]["fix"]
    assert "train --backend cpu --model tiny-gpt" in fix
    dry = call("train", {"backend": "cpu", "model": "tiny-gpt", "dry_run": True, "runs_root": str(tmp_path)})
    assert dry["ok"]


def test_a_missing_system_tool_skips_here_and_fails_in_ci(monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "REQUIRE_ALL", False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install nothing"):
        conftest.system_tool("no-such-tool-here", "apt-get install nothing")
    monkeypatch.setattr(conftest, "REQUIRE_ALL", True)
    with pytest.raises(pytest.fail.Exception, match="required"):
        conftest.system_tool("no-such-tool-here", "apt-get install nothing")


@pytest.mark.slow
def test_the_suite_collects_without_torch_or_megatron():
    """The planning-only install: test modules that need the runtime skip themselves instead of
    failing at import (run with torch, numpy and megatron made unimportable)."""
    code = ("import sys; [sys.modules.__setitem__(m, None) for m in ('torch', 'numpy', 'megatron', 'megatron.core')];"
            "import pytest; sys.exit(pytest.main(['--collect-only', '-q', '-n', '0', '-p', 'no:cacheprovider', sys.argv[1]]))")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "MEGATRON_SKILL_REQUIRE_SYSTEM": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "error" not in proc.stdout.lower().split("collected")[-1]


@pytest.mark.slow
def test_quickstart_says_what_it_trained_and_where_its_answers_are(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "tools" / "quickstart.sh"), str(tmp_path / "qs")], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("files:") and "plan.json" in lines[0]
    assert any(ln.startswith("train:  tiny-gpt on cpu") for ln in lines), proc.stdout
    assert "training the catalog's tiny-gpt" in proc.stderr
