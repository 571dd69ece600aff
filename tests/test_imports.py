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


# Every tool module stays thin: a tool's functions read its request and call what lies below
# (core, adapter, runtime, data, convert). The longest a function of tools/ may be, def to last line:
MAX_TOOL_FUNCTION_LINES = 60
# Tool functions still longer, each with why; the list only shrinks (an entry that fits is an error too).
LONG_TOOL_FUNCTIONS_ALLOWED: dict[str, str] = {}


def _function_lines(tree: ast.AST, prefix: str) -> dict[str, int]:
    """Lines of every function in tree (methods and nested functions too), by dotted name."""
    found = {}
    for node in ast.iter_child_nodes(tree):
        name = f"{prefix}.{node.name}" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else prefix
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[name] = node.end_lineno - node.lineno + 1
        found |= _function_lines(node, name)
    return found


def _tool_function_lines() -> dict[str, int]:
    lines = {}
    for path in sorted((PACKAGE / "tools").glob("*.py")):
        lines |= _function_lines(ast.parse(path.read_text()), path.stem)
    return lines


def test_every_tool_function_is_short():
    lines = _tool_function_lines()
    long = {name: n for name, n in lines.items() if n > MAX_TOOL_FUNCTION_LINES}
    unexplained = {name: n for name, n in long.items() if name not in LONG_TOOL_FUNCTIONS_ALLOWED}
    assert not unexplained, (f"tool functions over {MAX_TOOL_FUNCTION_LINES} lines (split them into named steps, "
                             f"or move the work below tools/): {unexplained}")
    fitting = sorted(set(LONG_TOOL_FUNCTIONS_ALLOWED) - set(long))
    assert not fitting, f"these fit in {MAX_TOOL_FUNCTION_LINES} lines now (or are gone): drop them from the list: {fitting}"


def test_function_lines_are_counted_def_to_end():
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n\n\ndef h():\n    pass\n")
    assert _function_lines(tree, "m") == {"m.A.f": 4, "m.A.f.g": 2, "m.h": 2}
    assert {"render.build", "validate._FlagReader.flag"} <= set(_tool_function_lines())
