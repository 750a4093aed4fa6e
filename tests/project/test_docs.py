"""docs/architecture.md is the module map a newcomer reads first: every module of the package is on it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest_pdserve

PACKAGE = Path(pytest_pdserve.__file__).resolve().parent
ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _tree_and_sections() -> tuple[str, list[str]]:
    """The ```pytest_pdserve/ ...``` tree, and the doc split at its headings."""
    text = ARCHITECTURE.read_text()
    start = text.index("```\npytest_pdserve/\n")
    tree = text[start : text.index("\n```", start + 4)]
    return tree, re.split(r"\n(?=#+ )", text)


def test_every_module_is_on_the_architecture_map() -> None:
    """A top-level module has its own line in the tree (`  name.py  what it does`); a module of a subpackage has
    one under its package in the tree, or is named in the section about that package (`### ... (`sim/`)`)."""
    tree, sections = _tree_and_sections()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:
            if not re.search(rf"^  {re.escape(rel.name)}\s", tree, re.M):
                missing.append(rel.as_posix())
            continue
        package = rel.parts[0]
        if not re.search(rf"^  {re.escape(package)}/\s", tree, re.M):
            missing.append(f"{package}/")
        if rel.name in ("__init__.py", "__main__.py"):
            continue  # the package's line says what it is and how it runs
        in_tree = re.search(rf"^    {re.escape(rel.name)}\s", tree, re.M)
        about = [s for s in sections if s.startswith("#") and f"`{package}/`" in s.splitlines()[0]]
        if not in_tree and not any(f"`{rel.stem}`" in s for s in about):
            missing.append(rel.as_posix())
    assert not missing, f"docs/architecture.md does not list: {', '.join(sorted(set(missing)))}"
