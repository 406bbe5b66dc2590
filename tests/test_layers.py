"""The layer order of docs/ARCHITECTURE.md, enforced: no import runs back up, visible or hidden.

Every ``import`` and ``from ... import`` of src/draftline is read with ``ast``: at module level, inside
functions and under ``if TYPE_CHECKING`` alike. A module may import its own layer and the layers below;
no two packages may import each other, directly or round a longer cycle. A failure names the file and
line of each import that breaks the order.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "draftline"

LAYERS: list[set[str]] = [
    {"__init__", "errors", "cores", "compile_clock", "files", "run_files", "config", "config_options", "config_io", "config_flags", "config_docs"},
    {"data"},
    {"model"},
    {"objective"},
    {"checkpoint"},
    {"distributed"},
    {"sizing"},
    {"monitor"},
    {"evaluate"},
    {"methods"},
    {"pipeline"},
    {"demo", "commands", "cli", "__main__"},
]
"""Low to high, as docs/ARCHITECTURE.md draws them (its table "Layers")."""

LAYER = {package: index for index, layer in enumerate(LAYERS) for package in layer}


def package_of(module: str) -> str:
    """``draftline.pipeline.loop`` -> ``pipeline``; ``draftline.errors`` -> ``errors``; ``draftline`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every draftline module ``path`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from draftline import pipeline``: the name imported is a package of its own.
            names = [f"{module}.{alias.name}" for alias in node.names] if module == "draftline" else [module]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, str(node.args[0].value)))
    return [(line, name) for line, name in found if name == "draftline" or name.startswith("draftline.")]


def sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def package_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Package -> the packages it imports, and one ``file:line`` of each such edge."""
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for path in sources():
        source = package_of(module_name(path))
        for line, module in imports(path):
            target = package_of(module)
            if target != source:
                graph.setdefault(source, set()).add(target)
                where.setdefault((source, target), f"{path.relative_to(SRC.parent.parent)}:{line}")
    return graph, where


def test_every_package_has_a_layer():
    packages = {package_of(module_name(path)) for path in sources()}
    missing = sorted(packages - set(LAYER))
    assert not missing, f"packages without a layer (add them to docs/ARCHITECTURE.md and LAYERS): {missing}"


def test_no_import_runs_back_up():
    wrong = []
    for path in sources():
        source = package_of(module_name(path))
        for line, module in imports(path):
            target = package_of(module)
            if LAYER.get(target, -1) > LAYER.get(source, len(LAYERS)):
                wrong.append(f"{path.relative_to(SRC.parent.parent)}:{line}: {source} (layer {LAYER[source]}) "
                             f"imports {module} (layer {LAYER[target]})")
    assert not wrong, "imports that run back up the layers:\n" + "\n".join(wrong)


def test_no_cycle_between_packages():
    graph, where = package_graph()
    cycles = []
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    cycles.append(path + [start])
                elif nxt not in path and nxt > start:  # each cycle once, from its smallest package
                    stack.append((nxt, path + [nxt]))
    described = [" -> ".join(cycle) + " (" + ", ".join(where[(a, b)] for a, b in zip(cycle, cycle[1:])) + ")"
                 for cycle in cycles]
    assert not described, "packages that import each other:\n" + "\n".join(described)


@pytest.mark.parametrize("source, expected", [
    ("from draftline.distributed.shard import DrafterGroup\n", "draftline.distributed.shard"),
    ("def f():\n    from draftline.pipeline import loop\n", "draftline.pipeline"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import draftline.monitor.live\n", "draftline.monitor.live"),
    ("import importlib\nm = importlib.import_module('draftline.commands.train')\n", "draftline.commands.train"),
    ("from . import spec\n", "draftline.checkpoint"),
])
def test_hidden_imports_are_seen(tmp_path, monkeypatch, source, expected):
    """An import inside a function, under TYPE_CHECKING, by importlib or relative counts like any other."""
    fake = tmp_path / "draftline" / "checkpoint"
    fake.mkdir(parents=True)
    path = fake / "state.py"
    path.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "draftline")
    assert [module for _, module in imports(path)] == [expected]
