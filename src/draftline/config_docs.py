"""The config's own words: the docstring under each field of a config dataclass, for ``--help``.

Python keeps no attribute docstrings at runtime (a string after ``name: int = 0`` is an expression
that is evaluated and dropped), so they are read from the class's source with ``ast``. Without
the source (a zipped install) every field reads as undocumented: the help then shows the field's
name and default only.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap


def _one_line(text: str) -> str:
    return " ".join(text.split())


@functools.lru_cache(maxsize=None)
def _class_node(section_class: type) -> ast.ClassDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(section_class))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, ast.ClassDef) else None


def field_docs(section_class: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass, each docstring on one line; a field without one is absent."""
    assert dataclasses.is_dataclass(section_class), section_class
    node = _class_node(section_class)
    if node is None:
        return {}
    docs = {}
    for statement, after in zip(node.body, node.body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[statement.target.id] = _one_line(after.value.value)
    return docs


def section_doc(section_class: type) -> str:
    """The class docstring of a config section as written, on one line ("" if it has none: not
    the signature that ``dataclass`` puts in ``__doc__`` instead)."""
    node = _class_node(section_class)
    return _one_line(ast.get_docstring(node) or "") if node is not None else ""
