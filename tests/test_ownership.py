"""Each object's state is written by its own module: no attribute of one module's object is set from another.

For the packages of the training line and the job (pipeline, distributed, checkpoint, monitor, evaluate,
sizing), every assignment to ``<something>.attr`` that is not ``self.attr`` (or ``cls.attr``) is read with
``ast``; it fails when ``attr`` belongs to a class of another draftline module (set as ``self.attr`` there,
or a field of it) and to none of the assigning module's own. The run's progress, the monitor's measured
acceptance and the schedule's clock are changed through their owners' methods instead.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "draftline"
CHECKED = ("pipeline", "distributed", "checkpoint", "monitor", "evaluate", "sizing")
NOT_OURS = {
    ("checkpoint/serving.py", "config.block_size"): "a transformers config the function builds itself",
    ("checkpoint/serving.py", "config.dflash_config"): "a transformers config the function builds itself",
}
"""Writes to objects of other libraries whose attribute names a draftline class also has."""


def _owned(tree: ast.Module) -> set[str]:
    """Attribute names the module's classes own: their fields, and what their methods set on ``self``."""
    names = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
            elif isinstance(item, ast.Assign):
                names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def _writes(tree: ast.Module) -> list[tuple[int, str, str]]:
    """``(line, target, attr)`` of every attribute set on something other than ``self``/``cls``."""
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and not (
                        isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")):
                    out.append((node.lineno, ast.unparse(sub), sub.attr))
    return out


def test_no_attribute_of_another_modules_object_is_written():
    trees = {path: ast.parse(path.read_text()) for path in sorted(SRC.rglob("*.py"))}
    owners: dict[str, set[Path]] = defaultdict(set)
    for path, tree in trees.items():
        for name in _owned(tree):
            owners[name].add(path)
    wrong = []
    for path, tree in trees.items():
        if path.relative_to(SRC).parts[0] not in CHECKED:
            continue
        for line, target, attr in _writes(tree):
            if owners.get(attr) and path not in owners[attr] and (str(path.relative_to(SRC)), target) not in NOT_OURS:
                others = ", ".join(sorted(str(p.relative_to(SRC)) for p in owners[attr]))
                wrong.append(f"{path.relative_to(SRC.parent.parent)}:{line}: {target} = ... (owned in {others})")
    assert not wrong, "attributes written from outside their module:\n" + "\n".join(wrong)


def test_the_check_sees_a_write_through_another_object(tmp_path):
    tree = ast.parse("def f(worker, monitor):\n    worker.scheduler.clock = 1\n    monitor.measured += 2\n    self.x = 3\n")
    assert [(line, attr) for line, _, attr in _writes(tree)] == [(2, "clock"), (3, "measured")]
