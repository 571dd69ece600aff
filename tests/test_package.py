"""The skill as a package: the AgentSkills validators accept it, SKILL.md's links resolve and its
first screen says how to install and call a tool."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, system_tool

NAME = "megatron-core-training"
NOT_PACKAGED = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".hypothesis", "build"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The skill as a user installs it: the repository in a folder named after the skill."""
    dest = tmp_path_factory.mktemp("skills") / NAME
    shutil.copytree(ROOT, dest, ignore=lambda _, names: [n for n in names if n in NOT_PACKAGED or
                                                          n.endswith(".egg-info")])
    return dest


def _frontmatter(text: str) -> str:
    return text.split("---", 2)[1]


def test_the_reference_validator_accepts_the_skill(installed):
    tool = system_tool("agentskills", "pip install skills-ref (tools/setup.sh installs it)")
    proc = subprocess.run([tool, "validate", str(installed)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_reference_validator_refuses_a_folder_of_another_name(installed, tmp_path):
    tool = system_tool("agentskills", "pip install skills-ref (tools/setup.sh installs it)")
    other = tmp_path / "megatron-skill"
    other.mkdir()
    shutil.copy(installed / "SKILL.md", other / "SKILL.md")
    proc = subprocess.run([tool, "validate", str(other)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "must match skill name" in proc.stdout + proc.stderr


def test_skillsaw_finds_no_error_or_warning(installed):
    tool = system_tool("skillsaw", "pip install skillsaw (tools/setup.sh installs it)")
    proc = subprocess.run([tool, "lint", "--strict", "--no-color", "--no-progress", str(installed)],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"Errors:\s+0\b", out) and re.search(r"Warnings:\s+0\b", out), out


def test_frontmatter_says_what_the_tools_really_need():
    front = _frontmatter((ROOT / "SKILL.md").read_text())
    assert re.search(r"^license: MIT$", front, flags=re.M)  # top level, as the spec has it
    compat = re.search(r"^compatibility: (.*)$", front, flags=re.M).group(1)
    assert len(compat) <= 500
    for need in ("Python 3.10", "jinja2", "jsonschema", "Python 3.12", "torch", "megatron-core", "tools/setup.sh"):
        assert need in compat, need
    if "fine-tune" in front:  # only with what is behind it: weights in, chat data, weights out
        from megatron_skill.contract import load_schema, tools
        assert {"import-hf", "export-hf"} <= set(tools())
        assert "chat" in load_schema("prepare-data", "request")["properties"]["format"]["enum"]


def test_skill_md_first_screen_installs_and_calls_a_tool_by_json():
    text = (ROOT / "SKILL.md").read_text()
    body = text.split("---", 2)[2]
    first = "\n".join(body.splitlines()[:40])
    assert "tools/setup.sh" in first and "--request -" in first
    piped = re.search(r"^echo '(\{.*\})' \| python tools/launch.py (\w+) --request -$", body, flags=re.M)
    assert piped, "SKILL.md shows one JSON request through --request -"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), piped.group(2), "--request", "-"],
                          input=piped.group(1), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for tool in ("bench", "train"):
        row = next(ln for ln in body.splitlines() if ln.startswith(f"| `{tool}`"))
        assert "GPU" in row, row  # which tools need a GPU is on the first screen


def test_every_markdown_link_resolves():
    docs = [ROOT / "SKILL.md", ROOT / "README.md", ROOT / "instructions.md", *sorted((ROOT / "references").glob("*.md"))]
    checked = 0
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            assert (doc.parent / target).exists(), f"{doc.name}: {target}"
            checked += 1
    assert checked >= 8


# ---- the package as pip installs it ------------------------------------------------------
def _installed_wheel(tmp: Path) -> Path:
    """The skill's wheel built here and installed into a fresh virtual environment, offline; the
    planning tools' own dependencies (jinja2, jsonschema) come from this test's environment.
    Returns the environment's megatron-skill command."""
    import jinja2
    import jsonschema

    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "wheel"), "-q"], check=True, capture_output=True, timeout=600, cwd=tmp)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = sorted({str(Path(m.__file__).resolve().parents[1]) for m in (jinja2, jsonschema)})
    (Path(site) / "planning_dependencies.pth").write_text("\n".join(deps) + "\n")
    wheel = next((tmp / "wheel").glob("*.whl"))
    subprocess.run([python, "-m", "pip", "install", "--no-index", "--no-deps", "-q", str(wheel)], check=True,
                   capture_output=True, timeout=600)
    return venv / "bin" / "megatron-skill"


def _answer(command: list[str], cwd: Path) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRON_SKILL_HOME")}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    out = json.loads(proc.stdout)
    assert out["ok"], (command, out, proc.stderr[-2000:])
    return out["result"]


@pytest.mark.slow
def test_the_installed_package_runs_the_planning_tools_from_anywhere(tmp_path):
    tool = _installed_wheel(tmp_path)
    away = tmp_path / "elsewhere"
    away.mkdir()
    where = subprocess.run([tool.parent / "python", "-c", "import megatron_skill; print(megatron_skill.__file__)"],
                           capture_output=True, text=True, cwd=away, check=True).stdout
    assert str(tmp_path / "venv") in where and str(ROOT) not in where   # the installed copy, not this checkout
    plan = _answer([str(tool), "plan", "--model", "llama3-8b", "--num-gpus", "8"], away)
    assert plan["plans"]
    rendered = _answer([str(tool), "render", "--model", "llama3-8b", "--num-gpus", "8", "--launcher", "torchrun",
                        "--output-dir", str(away / "job")], away)
    script = Path(rendered["files"][0]["path"])
    assert script.is_file() and "--tensor-model-parallel-size" in script.read_text()
    checked = _answer([str(tool), "validate", "--script", str(script)], away)
    assert checked["valid"] is True, checked
    logs = _answer([str(tool), "logs", "--log", str(ROOT / "tests" / "fixtures" / "logs" / "h200-kill-resume.log"),
                    "--gpu", "h200", "--seq-length", "4096"], away)
    assert logs["last_iteration"] and logs["final_loss"] is not None
