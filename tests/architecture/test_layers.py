"""The import layers of ``docs/architecture.md``, enforced: the core (``diag/``) never
imports ``checks`` or ``repro``, ``checks`` never imports ``repro``, and the import graph
between sub-packages has no cycle — counting imports inside functions too, since those
run as surely as the others. The front ends (the ``gpudiag.cli`` package, ``gpudiag.testing``,
``python -m gpudiag``) may import anything; ``gpudiag`` itself holds only the version and
a table of lazy names.

The graph is read from the source with ``ast``, not by importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

FOLDERS = {"gpudiag": ROOT / "diag", "gpudiag.checks": ROOT / "checks", "gpudiag.repro": ROOT / "repro"}
FRONT_ENDS = {"gpudiag.cli", "gpudiag.testing", "gpudiag.__main__"}  # (and the modules of gpudiag.cli)
#: Layers, bottom up: a unit may import its own layer's units and the ones below.
LAYERS = {"core": 0, "checks": 1, "repro": 2}


def modules() -> dict[str, Path]:
    """Every module of the package by its import name."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            if package == "gpudiag" and parts and parts[0] in ("examples",):
                continue
            found[".".join([package, *parts])] = path
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The gpudiag modules ``name`` imports anywhere in its source (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {m for m in out if m == "gpudiag" or m.startswith("gpudiag.")}


def unit(module: str) -> str:
    """The sub-package (or top-level module) a module belongs to: ``runtime``, ``checks``…"""
    parts = module.split(".")
    if len(parts) == 1:
        return "gpudiag"
    return parts[1]


def layer(unit_name: str) -> int:
    return LAYERS.get(unit_name, LAYERS["core"])


def edges() -> dict[tuple[str, str], str]:
    """Unit → unit import edges (front ends left out), each with one example."""
    mods = modules()
    out: dict[tuple[str, str], str] = {}
    for name, path in mods.items():
        if name in FRONT_ENDS or name.startswith("gpudiag.cli.") or name == "gpudiag":
            continue
        for target in imported(name, path, set(mods)):
            if target == "gpudiag":
                continue  # the version (the package's lazy names are strings, not imports)
            a, b = unit(name), unit(target)
            if a != b:
                out.setdefault((a, b), f"{name} imports {target}")
    return out


def problems(graph: dict[tuple[str, str], str]) -> list[str]:
    """Upward edges and cycles of a unit graph, in words."""
    found = [f"upward: {why}" for (a, b), why in graph.items() if layer(b) > layer(a)]
    nodes = sorted({u for edge in graph for u in edge})
    reach = {u: {b for (a, b) in graph if a == u} for u in nodes}
    for _ in nodes:  # transitive closure (a handful of units)
        for u in nodes:
            reach[u] |= {w for v in reach[u] for w in reach[v]}
    for (a, b), why in sorted(graph.items()):
        if a in reach[b]:
            found.append(f"cycle {a} <-> {b}: {why}")
    return found


def test_layers_point_one_way_and_have_no_cycle() -> None:
    assert problems(edges()) == []


def test_a_deliberate_bad_import_is_caught() -> None:
    graph = edges()
    upward = {**graph, ("render", "repro"): "gpudiag.render.text imports gpudiag.repro.report"}
    assert any(p.startswith("upward: gpudiag.render.text") for p in problems(upward))
    looping = {**graph, ("topology", "hw"): "gpudiag.topology.model imports gpudiag.hw.nvml"}
    assert any("cycle" in p and "topology" in p for p in problems(looping))
    checks_up = {**graph, ("checks", "repro"): "gpudiag.checks.suite imports gpudiag.repro.env"}
    assert problems(checks_up)


def test_the_graph_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from gpudiag.repro.report import Report\n    from . import sibling\n")
    assert imported("gpudiag.render.lazy", source, {"gpudiag.render.sibling"}) == {
        "gpudiag.repro.report",
        "gpudiag.render.sibling",
    }


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other round a circle (strongly connected components of
    more than one module), however deep the import: each is one way of reading the code
    that cannot start anywhere."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def module_graph() -> dict[str, set[str]]:
    """Module → the gpudiag modules it imports (anywhere in its source)."""
    mods = modules()
    return {name: imported(name, path, set(mods)) & set(mods) - {name} for name, path in mods.items()}


def test_no_two_modules_import_each_other_round_a_circle() -> None:
    assert module_cycles(module_graph()) == []


def test_a_planted_circle_of_modules_is_caught() -> None:
    graph = module_graph()
    planted = {**graph, "gpudiag.render.text": graph["gpudiag.render.text"] | {"gpudiag.render.markdown"}}
    assert any({"gpudiag.render.markdown", "gpudiag.render.text"} <= set(c) for c in module_cycles(planted))
