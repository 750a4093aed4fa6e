"""Benchmark probe: records the moment a uvicorn server starts answering, in every process that inherits it.

Active only when ``PDSERVE_BENCH_READY_DIR`` is set (the benchmarks put this directory on PYTHONPATH for
the servers they start). It wraps ``uvicorn.Server.startup`` when ``uvicorn.server`` is first imported;
right after startup returns the listening socket accepts and the event loop starts answering, which is
"the moment the server answers /health". The record carries ``time.monotonic()`` (CLOCK_MONOTONIC,
one clock for all processes on Linux) and ``time.time()``.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("PDSERVE_BENCH_READY_DIR")

if _DIR:
    import importlib.abc
    import importlib.machinery
    import json
    import sys
    import time
    from types import ModuleType
    from typing import Any

    def _patch(module: ModuleType) -> None:
        original = module.Server.startup

        async def startup(self: Any, sockets: Any = None) -> None:
            await original(self, sockets=sockets)
            if getattr(self, "started", False):
                rec = {"pid": os.getpid(), "mono": time.monotonic(), "wall": time.time(), "argv": sys.argv}
                tmp = os.path.join(str(_DIR), f".{os.getpid()}.tmp")
                with open(tmp, "w") as fh:
                    json.dump(rec, fh)
                os.replace(tmp, os.path.join(str(_DIR), f"{os.getpid()}.json"))

        module.Server.startup = startup

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != "uvicorn.server":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            exec_module = loader.exec_module

            def patched_exec(module: ModuleType) -> None:
                exec_module(module)
                _patch(module)

            loader.exec_module = patched_exec  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Finder())
