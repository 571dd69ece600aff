"""The package's import graph, read with ast (every import, a function's own included): no module
reaches itself through its imports, and no tool module imports another tool (what tools share
lives in a module that is not a tool)."""
import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "tools" / "megatron_skill"
# Imports left out of the cycle search, each with why.
CYCLE_EDGES_ALLOWED = {
    ("megatron_skill.contract", "megatron_skill.tools"):
        "contract.tools() looks the registry up when a request is made: every tool is built on the contract",
}
def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that the file imports, anywhere in it."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) for p in files}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _without_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Without a module's import of its own package (the package's __init__ runs first: how a
package is made, not a cycle) and the allowed edges."""
    return {m: {t for t in deps if not m.startswith(t + ".") and (m, t) not in CYCLE_EDGES_ALLOWED}
            for m, deps in graph.items()}


def test_no_module_imports_itself_in_a_circle():
    graph = _without_packages(_graph())
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_tool_imports_another_tool():
    prefix = "megatron_skill.tools."
    graph = _graph()
    found = {(m[len(prefix):], t[len(prefix):]) for m, deps in graph.items() if m.startswith(prefix)
             for t in deps if t.startswith(prefix)}
    assert not found, f"tool modules importing another tool (move what they share out of tools/): {sorted(found)}"


def test_the_graph_sees_the_imports():
    graph = _graph()
    assert "megatron_skill.core.layout" in graph["megatron_skill.runtime.cpu_run"]
    assert "megatron_skill.errors" in graph["megatron_skill.convert.checkpoint"]   # a function's own import
