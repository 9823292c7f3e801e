"""The package's shape: no import cycle among jaxtrain's modules (imports inside functions included), and no module
over 500 lines outside kernels/ (a module that grows past that holds more than one concern)."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "jaxtrain")
MAX_LINES = 500


def _modules() -> dict[str, str]:
    """Module name -> path, for every module of the jaxtrain package."""
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    """The jaxtrain modules ``name`` imports anywhere in its file (``from jaxtrain import x`` names module x)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in known:
                found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    found.discard(name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    modules = _modules()
    # The package's __init__ and the CLI entry point sit above everything; a package imports its own modules.
    graph = {name: {m for m in _imports(name, path, set(modules)) if not name.startswith(m + ".") and m != "jaxtrain"}
             for name, path in modules.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_module_over_500_lines_outside_kernels():
    long = {os.path.relpath(p, REPO): n for p in _modules().values() if (n := len(open(p).readlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
