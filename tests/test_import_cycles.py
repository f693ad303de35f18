"""The package's module-level import graph has no cycle.

Top-level imports only: a function-level import runs after every module has loaded, and a
``TYPE_CHECKING`` block never runs, so neither can make a half-initialised module visible.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "python"
PACKAGE = "pcie_a2a"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking_block(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def top_level_imports(tree: ast.Module):
    """Import statements that run at import time: module body, plus if/try/with blocks in it."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif is_type_checking_block(node):
            pending.extend(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    pending.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])


def imported_modules(name: str, is_package: bool, node: ast.stmt, known: set[str]) -> set[str]:
    """Package modules ``node`` makes Python import, resolving relative imports against ``name``."""
    if isinstance(node, ast.Import):
        bases = [alias.name for alias in node.names]
        return {module for module in bases if module in known}
    if node.level:
        anchor = name.split(".")
        drop = node.level - 1 if is_package else node.level
        anchor = anchor[: len(anchor) - drop]
        base = ".".join(anchor + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    submodules = {f"{base}.{alias.name}" for alias in node.names} & known
    # A module's ancestor packages are already in sys.modules (initialising) when it runs, so
    # ``from <ancestor> import <submodule>`` only waits on the submodule; taking a name that
    # the ancestor's ``__init__`` defines needs that ``__init__`` to have got that far.
    is_ancestor = name.startswith(base + ".")
    takes_attribute = len(submodules) < len(node.names)
    found = {base} if base in known and (takes_attribute or not is_ancestor) else set()
    return found | submodules


def import_graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(path): path for path in (root / PACKAGE).rglob("*.py")}
    known = set(files)
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in top_level_imports(tree):
            edges |= imported_modules(name, path.name == "__init__.py", node, known)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state = dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                return [*path[path.index(nxt) :], nxt]
            if state[nxt] == 0 and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if state[start] == 0 and (cycle := visit(start)):
            return cycle
    return None


CYCLE_CASES = [
    ("no_edges", {"a": set(), "b": set()}, False),
    ("chain", {"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ("two_cycle", {"a": {"b"}, "b": {"a"}}, True),
    ("three_cycle", {"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
]


@pytest.mark.parametrize(
    ("graph", "has_cycle"), [c[1:] for c in CYCLE_CASES], ids=[c[0] for c in CYCLE_CASES]
)
def test_find_cycle_detects_cycles(graph, has_cycle):
    assert (find_cycle(graph) is not None) == has_cycle


def test_import_graph_reads_relative_and_guarded_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pcie_a2a import a\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .sub import b\nif TYPE_CHECKING:\n    from . import c\n"
        "def f():\n    from pcie_a2a import c\n"
    )
    (pkg / "c.py").write_text("from pcie_a2a import a, VERSION\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("try:\n    from .. import a\nexcept ImportError:\n    pass\n")
    global PACKAGE_ROOT
    saved, PACKAGE_ROOT = PACKAGE_ROOT, tmp_path
    try:
        graph = import_graph(tmp_path)
    finally:
        PACKAGE_ROOT = saved
    assert graph["pcie_a2a.a"] == {"pcie_a2a.sub", "pcie_a2a.sub.b"}
    # Only the submodule: the ancestor package is already initialising when b runs.
    assert graph["pcie_a2a.sub.b"] == {"pcie_a2a.a"}
    # A name the ancestor's __init__ defines makes c wait on that __init__.
    assert graph["pcie_a2a.c"] == {"pcie_a2a", "pcie_a2a.a"}
    assert find_cycle(graph) is not None


def test_package_has_no_import_cycle():
    cycle = find_cycle(import_graph(PACKAGE_ROOT))
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)
