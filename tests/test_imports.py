"""Imports go one way: no cycles in ``pipeline`` or ``partitioner``, and the layers stay apart.

Every import statement counts, wherever it sits: at module level, inside a
function, or under ``if TYPE_CHECKING:``. The graph is read from the source
(``ast``), so nothing is imported to build it:

    module --import--> module     one edge per imported module (``from pkg import mod`` -> pkg.mod,
                                  ``from pkg import name`` -> pkg, relative forms resolved)

A parent package's ``__init__`` that Python runs on the way to a submodule is
not an edge: only what the code names.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "partitioner")


def _module_name(root: Path, path: Path) -> tuple[str, bool]:
    """(dotted name, is a package) of a source file under ``root``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> Iterable[tuple[str, int]]:
    """(imported module, line) for every import statement in ``tree``, at any depth."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from ..a import b
                parent = package[: len(package) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                # our modules are known; an outside name may be a module (torch.distributed): keep it whole
                inside = base.split(".")[0] in {k.split(".")[0] for k in known}
                yield (candidate if candidate in known or not inside else base), node.lineno


def import_graph(root: Path, packages: Sequence[str]) -> nx.DiGraph:
    """Modules of ``packages`` (folders under ``root``) and what they import; edges carry ``lines``."""
    files = sorted(f for pkg in packages for f in (root / pkg).rglob("*.py"))
    names = {f: _module_name(root, f) for f in files}
    known = {name for name, _ in names.values()}
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for f, (name, is_package) in names.items():
        tree = ast.parse(f.read_text(), filename=str(f))
        for target, line in _imported(tree, name, is_package, known):
            if target == name:
                continue
            if graph.has_edge(name, target):
                graph.edges[name, target]["lines"].append(line)
            else:
                graph.add_edge(name, target, lines=[line])
    return graph


def _describe(graph: nx.DiGraph, path: Sequence[str]) -> str:
    steps = [f"{a} (line {graph.edges[a, b]['lines'][0]}) -> " for a, b in itertools.pairwise(path)]
    return "".join(steps) + path[-1]


def import_cycles(graph: nx.DiGraph, packages: Sequence[str]) -> list[str]:
    """One cycle per strongly connected group of the packages' modules, as 'a (line n) -> b -> a'."""
    ours = graph.subgraph(n for n in graph if n.split(".")[0] in packages)
    found = []
    for group in nx.strongly_connected_components(ours):
        if len(group) > 1:
            cycle = [a for a, _ in nx.find_cycle(ours.subgraph(group))]
            first = cycle.index(min(cycle))  # start at the smallest name: a stable report
            cycle = cycle[first:] + cycle[:first]
            found.append(_describe(graph, [*cycle, cycle[0]]))
    return sorted(found)


def _matches(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def forbidden_imports(graph: nx.DiGraph, sources: Sequence[str], forbidden: Sequence[str]) -> list[str]:
    """Import chains from a module under ``sources`` to one under ``forbidden``, direct or through others."""
    found = []
    for source in sorted(n for n in graph if _matches(n, sources)):
        reached = nx.single_source_shortest_path(graph, source)
        for target, path in sorted(reached.items()):
            if _matches(target, forbidden) and not _matches(target, sources):
                found.append(_describe(graph, path))
    return found


def _script_modules() -> list[str]:
    """How scripts can be imported: ``scripts.x``, or ``x`` with scripts/ on the path."""
    return ["scripts", *(f.stem for f in (ROOT / "scripts").glob("*.py"))]


# ---- the checkers fail when they should (a tiny package written for the purpose)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


_CYCLE = {
    "pkg/__init__.py": "",
    "pkg/a.py": "def f():\n    from . import b\n    return b\n",  # function level, relative
    "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n",
    "pkg/c.py": "import os\n\nimport pkg.a\n\nclass C: ...\n",
    "pkg/sub/__init__.py": "from ..c import C\n",  # relative from a package: pkg.c, no cycle
}


def test_checker_reports_a_cycle_through_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    _write(tmp_path, _CYCLE)
    graph = import_graph(tmp_path, ["pkg"])
    assert graph.has_edge("pkg.sub", "pkg.c") and graph.has_edge("pkg.c", "os")
    assert import_cycles(graph, ["pkg"]) == ["pkg.a (line 2) -> pkg.b (line 3) -> pkg.c (line 3) -> pkg.a"]

    _write(tmp_path, {"pkg/c.py": "class C: ...\n"})  # break it
    assert import_cycles(import_graph(tmp_path, ["pkg"]), ["pkg"]) == []


def test_layering_checker_follows_chains_and_from_imports(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/ir/__init__.py": "",
            "pkg/ir/x.py": "from pkg import helper\n",  # helper is a module: pkg.helper
            "pkg/helper.py": "def g():\n    from torch import distributed\n",
            "pkg/ir/y.py": "from pkg.ir import x\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert forbidden_imports(graph, ["pkg.ir"], ["torch.distributed"]) == [
        "pkg.ir.x (line 1) -> pkg.helper (line 2) -> torch.distributed",
        "pkg.ir.y (line 1) -> pkg.ir.x (line 1) -> pkg.helper (line 2) -> torch.distributed",
    ]
    assert forbidden_imports(graph, ["pkg.ir"], ["pkg.runtime"]) == []


# ---- the real packages


def test_no_import_cycles() -> None:
    cycles = import_cycles(import_graph(ROOT, PACKAGES), PACKAGES)
    assert not cycles, "import cycles (every import counts, function-level too):\n" + "\n".join(cycles)


def test_layers_import_one_way() -> None:
    graph = import_graph(ROOT, PACKAGES)
    rules = [
        (["pipeline"], ["partitioner", *_script_modules()]),
        (
            ["pipeline.schedules"],
            ["pipeline.runtime", "pipeline.launch", "pipeline.checkpointing", "torch.distributed"],
        ),
        (["partitioner"], _script_modules()),
    ]
    broken = [chain for sources, forbidden in rules for chain in forbidden_imports(graph, sources, forbidden)]
    more = f"\n... and {len(broken) - 20} more" if len(broken) > 20 else ""
    assert not broken, "imports against the layering:\n" + "\n".join(broken[:20]) + more


def room_edges(graph: nx.DiGraph, rule: dict[str, tuple[str, ...]]) -> list[str]:
    """Imports between ``pipeline.runtime``'s rooms that ``rule`` (room -> rooms it may import) does
    not allow: a back edge, or one between rooms side by side."""
    found = []
    for a, b in sorted(graph.edges):
        ra, rb = _room(a, rule), _room(b, rule)
        if ra and rb and ra != rb and rb not in rule[ra]:
            found.append(f"{a} (room {ra}, line {graph.edges[a, b]['lines'][0]}) -> {b} (room {rb})")
    return found


def _room(module: str, rule: dict[str, tuple[str, ...]]) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["pipeline", "runtime"] and len(parts) > 2 and parts[2] in rule:
        return parts[2]
    return None


def test_the_runtime_rooms_import_downwards_only() -> None:
    from pipeline.runtime import MAY_IMPORT

    rooms = {p.name for p in (ROOT / "pipeline" / "runtime").iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(MAY_IMPORT)  # every room has its rule, and each rule its room
    order = list(MAY_IMPORT)  # a room may import only rooms listed before it: no cycle among rooms
    assert all(set(MAY_IMPORT[r]) <= set(order[: order.index(r)]) for r in order)
    broken = room_edges(import_graph(ROOT, PACKAGES), MAY_IMPORT)
    assert not broken, "imports between rooms against pipeline.runtime.MAY_IMPORT:\n" + "\n".join(broken)
    # the checker itself: a back edge is reported
    planted = nx.DiGraph()
    planted.add_edge("pipeline.runtime.comm.p2p", "pipeline.runtime.step.stage", lines=[7])
    assert room_edges(planted, MAY_IMPORT) == [
        "pipeline.runtime.comm.p2p (room comm, line 7) -> pipeline.runtime.step.stage (room step)"
    ]


def test_the_schedule_ir_loads_without_torch_or_the_runtime() -> None:
    # pipeline/__init__ loads the runtime lazily: the IR is plain data that tools can import alone
    code = (
        "import sys; import pipeline.schedules.schedule, pipeline.schedules.simulate, "
        "pipeline.schedules.trace; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pipeline.runtime')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_public_names_resolve() -> None:
    import pipeline

    for name in pipeline.__all__:
        assert getattr(pipeline, name) is not None, name


def test_pipeline_launch_stays_the_function_after_its_module_is_imported() -> None:
    # importing pipeline/launch.py sets the package attribute to the module unless the package keeps it
    code = "import pipeline.launch; from pipeline import launch; print(callable(launch), launch.__module__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "pipeline.launch"]
