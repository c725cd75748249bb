"""The layering rule, checked on the source: kvtop -> router -> store, and no import cycles.

Every ``import`` counts, module-level or inside a function: a lazy import that closes a
circle is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("store", "router", "kvtop")
RANK = {"store": 0, "router": 1, "kvtop": 2}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                # the longest known module the name refers to (a package's attribute is the package)
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def test_imports_point_down_only():
    bad = [(m, t) for m, targets in import_graph().items() for t in targets
           if RANK[t.split(".")[0]] > RANK[m.split(".")[0]]]
    assert not bad, f"upward imports (kvtop -> router -> store only): {sorted(bad)}"


def test_no_module_imports_another_in_a_circle():
    graph = import_graph()
    # a package's __init__ importing its own submodules is not a cycle worth reporting
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    seen: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        seen[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if seen.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in seen:
                visit(t, stack)
        stack.pop()
        seen[m] = 2

    for m in sorted(edges):
        if m not in seen:
            visit(m, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_graph_sees_real_imports():
    """The checker itself: it must find edges it knows exist, or the tests above prove nothing."""
    graph = import_graph()
    assert "router.pipeline" in graph["kvtop.simulate"]
    assert "store.writer" in graph["router.state"]
    assert "router.control" in graph["router.app"]


#: Issue 31: the router's and the store's modules stay small enough to read whole.
MAX_LINES = 600
STATE_NAMES = {"state", "st", "tel"}


def test_no_router_or_store_module_is_over_the_line_bound():
    long = {str(p.relative_to(ROOT)): n for pkg in ("router", "store") for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_the_router_state_is_never_an_untyped_parameter():
    """A function taking the router's state (``state``/``st``) or telemetry (``tel``) names its
    type: ``Any`` there hides which object a handler may touch."""
    untyped = []
    for pkg in ("router", "store"):
        for p in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for a in node.args.args + node.args.kwonlyargs:
                        if a.arg in STATE_NAMES and (a.annotation is None and a.arg != "self"
                                                     or isinstance(a.annotation, ast.Name) and a.annotation.id == "Any"):
                            untyped.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}({a.arg})")
    assert not untyped, untyped
