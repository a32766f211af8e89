"""Imports in partitioner go one way: no cycle among its modules, function-level imports included,
and pipeline never imports partitioner (partitioner -> pipeline only)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (inside functions and TYPE_CHECKING too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _graph(package: str) -> nx.DiGraph:
    files = {_module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        for target in _imports(path):
            if target in files and target != name:
                graph.add_edge(name, target)
    return graph


def test_partitioner_has_no_import_cycle() -> None:
    graph = _graph("partitioner")
    assert "partitioner.graph" in graph and "partitioner.profile" in graph
    assert ("partitioner.profile", "partitioner.graph") in graph.edges  # the profiler builds the graph
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], f"import cycles in partitioner: {cycles}"


def test_pipeline_never_imports_partitioner() -> None:
    for path in (ROOT / "pipeline").rglob("*.py"):
        wrong = sorted(t for t in _imports(path) if t == "partitioner" or t.startswith("partitioner."))
        assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}: pipeline must not depend on partitioner"


def test_the_finder_sees_function_level_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from partitioner.profile import profile\n    import partitioner.graph\n")
    assert {"partitioner.profile", "partitioner.graph"} <= _imports(source)
