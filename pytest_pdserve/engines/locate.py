"""Which program serves a cluster, decided without importing vllm: ``resolve_engine``. [pytest-free]

Apart from `engine.py` (which re-exports it) because the settings resolve the engine when the plugin is configured,
and engine.py's other work (versions, flags, the tiny model) needs the cluster-description modules and packaging,
which a run that starts no cluster never loads.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["VLLM_MODULE_ENTRYPOINT", "resolve_engine"]

VLLM_MODULE_ENTRYPOINT = ("-m", "vllm.entrypoints.cli.main")
"""``python -m`` target used when the vllm package is importable but no ``vllm`` script is found."""


def resolve_engine(
    engine: str,
    vllm_executable: str,
    *,
    which: Callable[[str], str | None] = shutil.which,
    has_module: Callable[[str], bool] | None = None,
    python: str = sys.executable,
) -> tuple[str, str, tuple[str, ...]]:
    """Decide the engine without importing vllm.

    :returns: ``(resolved_engine, reason, vllm_argv)``; vllm_argv is empty when vLLM is not found.
    """
    if engine == "sim":
        return "sim", "sim: requested", ()
    argv: tuple[str, ...] = ()
    found = ""
    exe = Path(vllm_executable).expanduser()
    if os.sep in vllm_executable or exe.is_absolute():
        if exe.is_file() and os.access(exe, os.X_OK):
            argv, found = (str(exe.resolve()),), f"vllm executable {exe}"
    else:
        beside = Path(python).parent / vllm_executable
        if beside.is_file() and os.access(beside, os.X_OK):
            argv, found = (str(beside),), f"vllm executable found at {beside}"
        elif (on_path := which(vllm_executable)) is not None:
            argv, found = (on_path,), f"vllm executable found at {on_path}"
    if not argv:
        check = has_module or _has_module
        if check("vllm"):
            argv, found = (python, *VLLM_MODULE_ENTRYPOINT), f"vllm package importable by {python}"
    if engine == "vllm":
        return "vllm", f"vllm: requested; {found}" if found else "vllm: requested", argv
    if argv:
        return "vllm", f"auto: {found}", argv
    return "sim", "auto: no vllm executable on PATH or next to python; using the simulator", ()


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
