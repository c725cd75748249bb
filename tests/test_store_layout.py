"""store/ keeps the SQL: one job a file, each small enough to read at once, and no SQL run
from the layers above (they call a store function instead)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600


def test_no_store_module_is_over_600_lines():
    long = {p.name: n for p in (ROOT / "store").glob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"store/ modules over {MAX_LINES} lines: {long}"


def _sql_calls(path: Path) -> list[str]:
    """Lines that open a SQLite connection or run a statement on one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, owner = node.func.attr, node.func.value
        if name in ("execute", "executemany", "executescript") or (
                name == "connect" and isinstance(owner, ast.Name) and owner.id == "sqlite3"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_sql_runs_only_in_store():
    outside = [hit for pkg in ("kvtop", "router") for p in sorted((ROOT / pkg).rglob("*.py"))
               for hit in _sql_calls(p)]
    assert not outside, f"SQL outside store/ (add a store function): {outside}"


def test_the_checker_sees_sql_calls():
    # It must find the calls it knows exist, or the test above proves nothing.
    assert any(h.startswith("store/recorded.py:") for h in _sql_calls(ROOT / "store" / "recorded.py"))
    assert any(h.startswith("store/reads.py:") for h in _sql_calls(ROOT / "store" / "reads.py"))
