"""Running inside a vLLM checkout: keep pytest away from vLLM's ``tests/conftest.py`` when it cannot load.

vLLM's ``tests/conftest.py`` imports torch and vllm at module level. On a machine (or venv) without them,
``pytest tests/v1/kv_connector/nixl_integration/test_edge_cases.py`` fails while loading that conftest, before
any of our hooks run, although the P/D modules themselves need neither. ``pytest_load_initial_conftests``
runs just before: when the given test paths lie under such a checkout and torch or vllm is not importable,
pdserve sets ``--confcutdir`` to the directory of the test paths (only when the user gave none) and says so
in the report header.

pytest-free apart from the hook glue in plugin.py.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

__all__ = ["confcutdir_for"]

#: What vLLM's tests/conftest.py imports at module level (read in vLLM 0.32.0 / 0.33.0).
_HEAVY = ("torch", "vllm")


def _missing_modules() -> list[str]:
    missing = []
    for name in _HEAVY:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _vllm_tests_root(path: Path) -> Path | None:
    """The ``tests`` directory of the vLLM checkout holding ``path``, if its conftest imports torch/vllm."""
    for parent in [path, *path.parents]:
        if parent.name != "tests":
            continue
        conftest = parent / "conftest.py"
        if not conftest.is_file() or not (parent.parent / "vllm").is_dir():
            continue
        try:
            text = conftest.read_text(errors="replace")
        except OSError:
            return None
        if any(f"import {m}" in text or f"from {m}" in text for m in _HEAVY):
            return parent
    return None


def confcutdir_for(args: Sequence[str], invocation_dir: Path, explicit: bool) -> tuple[Path, str] | None:
    """``(confcutdir, message)`` when pytest should not load vLLM's ``tests/conftest.py``; else None.

    :param args: pytest's positional args (options are skipped; ``file.py::test`` is cut at ``::``).
    :param explicit: the user gave ``--confcutdir`` (or ``--noconftest``): then only tell, never set.
    """
    paths = []
    for arg in args:
        if arg.startswith("-"):
            continue
        path = Path(arg.split("::", 1)[0])
        path = path if path.is_absolute() else invocation_dir / path
        if path.exists():
            paths.append(path.resolve())
    roots = {root for p in paths if (root := _vllm_tests_root(p)) is not None}
    if not roots:
        return None
    missing = _missing_modules()
    if not missing:
        return None
    root = sorted(roots)[0]
    dirs = [p if p.is_dir() else p.parent for p in paths]
    target = dirs[0]
    for d in dirs[1:]:  # the deepest directory holding every test path, but below vLLM's tests/
        while target != root and target not in (d, *d.parents):
            target = target.parent
    if target == root:
        return None  # the paths span tests/ itself: nothing to cut without hiding conftests they need
    why = f"{root / 'conftest.py'} imports {' and '.join(_HEAVY)}, and {', '.join(missing)} is not importable here"
    if explicit:
        return target, f"pdserve: {why}; if collection fails there, pass --confcutdir={target}"
    return target, f"pdserve: {why}: --confcutdir set to {target} (pass --confcutdir yourself to choose)"
