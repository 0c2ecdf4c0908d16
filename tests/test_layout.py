"""The package's layout keeps its promises: no import cycle, imports one way, a lazy top level."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "llama_index_crag"
#: The layers of the package, bottom first (docs/layout.md): a module imports only its own layer and those before
#: it here. A module's layer is its first name under the package (``core`` for ``llama_index_crag.core.engine``);
#: the package's own ``__init__`` (its public names) is the top.
LAYERS = (
    "errors",
    "_lazy",
    "deadline",
    "settings_sources",
    "templates",
    "text",
    "scope",
    "datasets",
    "local",
    "scorers",
    "stores",
    "web",
    "presets",
    "answers",
    "core",
    "arguments",
    "calibration",
    "evaluation",
    "server",
    "cli",
    "llama_index_crag",
)


def _modules() -> Dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, modules: Dict[str, Path], package: str) -> Set[str]:
    """Every package module ``tree`` imports when it runs, at module level or inside functions (not under
    ``TYPE_CHECKING``): each target, and the packages above it that importing it runs."""
    targets: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets.add(node.module)
            targets.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    edges: Set[str] = set()
    for target in targets:
        parts = target.split(".")
        for i in range(2, len(parts) + 1):
            name = ".".join(parts[:i])
            # A package above the importer is already running; the top level is lazy (checked below).
            if name in modules and not package.startswith(name + ".") and name != package:
                edges.add(name)
    return edges


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = _imports(ast.parse(path.read_text(encoding="utf-8")), modules, package + ".x") - {name}
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _wrong_way(graph: Dict[str, Set[str]]) -> List[str]:
    """Every import of a later layer than the importer's (``LAYERS``), and every module in no layer."""

    def layer(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    found = []
    for module, targets in sorted(graph.items()):
        if layer(module) not in LAYERS:
            found.append(f"{module} is in no layer: place it in LAYERS and docs/layout.md")
            continue
        below = LAYERS.index(layer(module))
        found.extend(f"{module} imports {target}" for target in sorted(targets) if LAYERS.index(layer(target)) > below)
    return found


def test_no_import_cycle_inside_the_package_at_module_or_function_level() -> None:
    graph = _graph()
    assert "llama_index_crag.core.engine" in graph["llama_index_crag.core.persisted"], "the graph sees imports"
    assert "llama_index_crag.stores.memory" in graph["llama_index_crag.stores.folder"], "and those inside functions"
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_goes_down_the_layers_at_module_or_function_level() -> None:
    assert _wrong_way(_graph()) == []


def test_the_layer_check_finds_an_import_against_the_order() -> None:
    graph = {
        "llama_index_crag.scorers.reader": {"llama_index_crag.calibration.training", "llama_index_crag.errors"},
        "llama_index_crag.core.engine": {"llama_index_crag.core.grader", "llama_index_crag.scorers.base"},
        "llama_index_crag.misc": set(),
    }
    assert _wrong_way(graph) == [
        "llama_index_crag.misc is in no layer: place it in LAYERS and docs/layout.md",
        "llama_index_crag.scorers.reader imports llama_index_crag.calibration.training",
    ]


def test_importing_a_submodule_does_not_load_the_engine_or_torch() -> None:
    code = (
        "import sys, llama_index_crag, llama_index_crag.errors, llama_index_crag.cli\n"
        "loaded = [m for m in ('torch', 'llama_index_crag.core.engine', 'fastapi') if m in sys.modules]\n"
        "print(','.join(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_every_public_name_of_the_top_level_resolves() -> None:
    import llama_index_crag

    for name in llama_index_crag.__all__:
        assert getattr(llama_index_crag, name).__name__ == name
    with pytest.raises(AttributeError):
        llama_index_crag.NoSuchThing  # noqa: B018
