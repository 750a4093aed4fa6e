"""The classes of the pytest_pdserve package, read from its source (ast, nothing imported)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest_pdserve

PACKAGE = Path(pytest_pdserve.__file__).parent

_BUILTIN_EXCEPTIONS = {
    name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
}


def _base_name(base: ast.expr) -> str:
    """``ValueError`` -> ValueError, ``httpx.HTTPError`` -> HTTPError, ``Generic[T]`` -> Generic."""
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Attribute):
        return base.attr
    return base.id if isinstance(base, ast.Name) else ""


def classes(package: Path = PACKAGE) -> list[tuple[str, str, list[str]]]:
    """(path relative to the package, class name, base names) of every class in the package, nested ones too."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found.append((path.relative_to(package).as_posix(), node.name, [_base_name(b) for b in node.bases]))
    return found


def exception_classes(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(path, name) -> bases, for every class that derives from an exception (fixpoint over the package)."""
    found_classes = classes(package)
    known = set(_BUILTIN_EXCEPTIONS)
    result: dict[tuple[str, str], list[str]] = {}
    for _ in range(len(found_classes) + 1):  # each round adds at least one class, or the walk is done
        added = False
        for path, name, bases in found_classes:
            third_party = any(b.endswith(("Error", "Exception")) for b in bases)  # httpx.HTTPError, ...
            if (path, name) not in result and (third_party or known.intersection(bases)):
                result[path, name] = bases
                known.add(name)
                added = True
        if not added:
            break
    return result
