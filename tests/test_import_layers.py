"""hetfl's layers, one direction (issue 28; docs/architecture.md, "Layers"): the import graph of ``src/hetfl``,
every import counted (module level, inside functions, under ``TYPE_CHECKING``, ``importlib.import_module`` with a
literal name), has no circle; and the import-linter contracts of pyproject.toml (``lint-imports``, run by
``.ci/run``) hold, and fail when a forbidden import is added to a copy of the package."""

from __future__ import annotations

import ast
import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import pythonpath_before
from tests.helpers.imports import import_statements

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


# ------------------------------------------------------------------ the import graph
def module_files(src: Path) -> dict[str, Path]:
    """Every module of the packages under ``src``, by dotted name (a package by its own name: ``hetfl.engine``)."""
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_modules(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree`` of a module in ``modules``, wherever it stands: ``import a.b``
    gives ``a.b``; ``from a import b`` gives the module ``a.b`` where that is one, else ``a`` (``b`` is a name
    in it); relative imports are made absolute; ``importlib.import_module("a.b")`` and ``__import__("a.b")``
    with a literal name count. The implicit import of a parent package (Python runs ``a/__init__`` before
    ``a.b``) is not counted: a package that imports its own submodules (a registry) is no circle with them."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for line, base, names in import_statements(tree, package):
        found += [(line, f"{base}.{n}" if f"{base}.{n}" in modules else base) for n in names] or [(line, base)]
    return [(line, name) for line, name in found if name in modules and name != module]


def import_graph(src: Path, root: str = "hetfl") -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line}, for the modules of package ``root`` under ``src``."""
    files = {name: path for name, path in module_files(src).items() if name == root or name.startswith(root + ".")}
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        for line, name in imported_modules(ast.parse(path.read_text()), module, path.name == "__init__.py",
                                           set(files)):
            edges[name] = min(line, edges.get(name, line))
        graph[module] = edges
    return graph


def find_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle (``a -> b -> ... -> a``) through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [circle_in(graph, set(group)) for group in groups]


def circle_in(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """A path from the group's first module back to it, inside the group (breadth first: a shortest one)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return [*paths[v], start]
                if w in group and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return sorted(group)


def shown(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    return " -> ".join(f"{a}:{graph[a][b]}" for a, b in itertools.pairwise(circle)) + f" -> {circle[-1]}"


def test_the_import_graph_of_hetfl_has_no_circle():
    graph = import_graph(SRC)
    assert len(graph) > 100 and sum(map(len, graph.values())) > 350  # the package and its imports were found
    circles = find_circles(graph)
    assert circles == [], "import circles (module:line -> imported module):\n" + "\n".join(
        shown(graph, c) for c in circles)


@pytest.mark.parametrize(("files", "circle"), [
    ({"a.py": "def f():\n    from p import b\n", "b.py": "from p.a import f\n"}, ["p.a", "p.b", "p.a"]),
    ({"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import x\n",
      "b.py": "import p.a\n"}, ["p.a", "p.b", "p.a"]),
    ({"a.py": "import importlib\nimportlib.import_module('p.b')\n", "b.py": "from . import a\n"},
     ["p.a", "p.b", "p.a"]),
    ({"__init__.py": "from p.a import x\n", "a.py": "from p import y\n"}, ["p", "p.a", "p"]),
])
def test_the_graph_sees_lazy_type_checking_and_dynamic_imports(tmp_path, files, circle):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / "p" / name).write_text(text)
    assert find_circles(import_graph(tmp_path, "p")) == [circle]


def test_a_package_importing_its_submodules_is_no_circle(tmp_path):
    """``from p import a`` in ``p.b`` names the module ``p.a``, not ``p``: a package that imports its own
    submodules (a registry) makes no circle with them."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("from p.b import g\n")
    (tmp_path / "p" / "a.py").write_text("x = 1\n")
    (tmp_path / "p" / "b.py").write_text("from p import a\n\ndef g():\n    return a.x\n")
    assert find_circles(import_graph(tmp_path, "p")) == []


# ------------------------------------------------------------------ the contracts (lint-imports)
def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the contracts of ``root``/pyproject.toml on the package under ``root``/src."""
    env = {**os.environ, "PYTHONPATH": pythonpath_before(root / "src")}  # this copy before the installed one
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())", "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory) -> Path:
    pytest.importorskip("importlinter", reason="the layer contracts need import-linter (part of the test extra)")
    root = tmp_path_factory.mktemp("layers")
    shutil.copytree(SRC / "hetfl", root / "src" / "hetfl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def test_the_contracts_hold(package_copy):
    result = lint_imports(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout and "layers, top to bottom KEPT" in result.stdout


@pytest.mark.parametrize(("module", "line", "broken"), [
    ("api.py", "from hetfl.cli import make_console", ["layers", "command line"]),
    ("algorithms/fedavg.py", "from hetfl.engine import resources", ["layers", "methods import nothing"]),
    ("algorithms/base.py", "def _late():\n    from hetfl.engine.experiment import Experiment", ["layers", "methods"]),
    ("config.py", "def _presets():\n    from hetfl.reproduce import PRESET_DIR", ["layers", "presets"]),
    ("engine/experiment.py", "from hetfl import tracking", ["layers", "the engine is handed"]),
    ("engine/federation.py", "import flwr", ["the engine is handed"]),
    ("sweeps.py", "from hetfl.api import make_config", ["layers"]),
])
def test_a_forbidden_import_breaks_the_contracts(package_copy, module, line, broken):
    """The import added to a copy of the package (at the end of ``module``, inside a function where it says so)
    makes ``lint-imports`` fail, naming the contracts it breaks; the copy is restored after."""
    path = package_copy / "src" / "hetfl" / module
    original = path.read_text()
    try:
        path.write_text(original + "\n\n" + line + "  # noqa\n")
        result = lint_imports(package_copy)
    finally:
        path.write_text(original)
    assert result.returncode != 0, result.stdout
    failed = [row for row in result.stdout.splitlines() if row.endswith("BROKEN")]
    for words in broken:
        assert any(words in row for row in failed), (words, failed)
