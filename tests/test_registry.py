"""The tools' registry: each name leads to the module whose tool has that name, and a call
imports its own tool only (a cold call of one tool does not pay for the other ten's imports)."""
import subprocess
import sys

from conftest import ROOT

from megatron_skill.contract import get_tool, tool_names, tools
from megatron_skill.tools import MODULES


def test_every_name_leads_to_the_tool_of_that_name():
    assert tool_names() == list(MODULES)
    for name, each in tools().items():
        assert each.name == name and get_tool(name) is each


def test_a_call_imports_its_own_tool_only():
    code = ("import sys; sys.path.insert(0, 'tools'); from megatron_skill.contract import get_tool; "
            "get_tool('plan'); print(sorted(m for m in sys.modules if m.startswith('megatron_skill.tools.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['megatron_skill.tools.plan']"
