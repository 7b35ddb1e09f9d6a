"""The package's layering: what the physics layer imports, no import cycle
among the package's modules, and no module reaching for another's private
names. Read from the source (``ast``) or in a fresh interpreter, so that
nothing imported by the test run itself hides a violation.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sweep

PACKAGE = Path(sweep.__file__).parent
PHYSICS = ("sweep.model.params", "sweep.model.precision", "sweep.model.roofline",
           "sweep.model.cost",
           "sweep.model.batching", "sweep.model.point", "sweep.grid.evaluate",
           "sweep.search.pareto")


def test_physics_layer_imports_neither_hydra_nor_omegaconf():
    code = (f"import sys\nimport {', '.join(PHYSICS)}\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} "
            "& {'omegaconf', 'hydra'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, check=True, timeout=300)
    assert proc.stdout.strip() == "[]", f"importing {PHYSICS} loaded {proc.stdout}"


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


def _imports(tree: ast.Module, modules) -> dict[str, set[str]]:
    """``{imported sweep module: names taken from it}``, function-level
    imports included (a lazy import still ties the two modules)."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    out.setdefault(a.name, set())
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in modules:  # ``from sweep import grid``: the module
                    out.setdefault(sub, set())
                elif node.module in modules:
                    out.setdefault(node.module, set()).add(a.name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_the_package_modules():
    modules = _modules()
    graph = {m: set(_imports(tree, modules)) - {m} for m, tree in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_lazy_cycle():
    # the check itself: a function-level import back is a cycle
    mods = {"sweep.a": ast.parse("from sweep import b\n"),
            "sweep.b": ast.parse("def f():\n    from sweep.a import x\n")}
    graph = {m: set(_imports(t, mods)) - {m} for m, t in mods.items()}
    assert _cycles(graph) == [["sweep.a", "sweep.b"]]


def test_no_module_uses_another_modules_private_names():
    modules = _modules()
    bad = []
    for name, tree in modules.items():
        imports = _imports(tree, modules)
        bad += [f"{name}: from {m} import {n}" for m, names in imports.items()
                for n in names if n.startswith("_") and not n.startswith("__")]
        # ``module._name`` through a module bound by ``from sweep import module``
        bound = {a.asname or a.name for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module == "sweep"
                 for a in node.names if f"sweep.{a.name}" in modules}
        bad += [f"{name}: {n.value.id}.{n.attr}" for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                and n.value.id in bound and n.attr.startswith("_")
                and not n.attr.startswith("__")]
    assert bad == []
