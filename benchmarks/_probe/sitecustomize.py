"""Benchmark probe: records the moment a uvicorn server starts answering, in every process that inherits it.

Inert unless ``PDSERVE_BENCH_READY_DIR`` or ``PDSERVE_BENCH_SIM_NODELAY`` is set (the benchmarks put this
directory on PYTHONPATH for the servers they start). It wraps ``uvicorn.Server.startup`` when
``uvicorn.server`` is first imported; right after startup returns the listening socket accepts and the
event loop starts answering, which is "the moment the server answers /health". The record carries
``time.monotonic()`` (CLOCK_MONOTONIC, one clock for all processes on Linux) and ``time.time()``.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("PDSERVE_BENCH_READY_DIR")
#: ``1``: set TCP_NODELAY on sockets handed to uvicorn pre-bound (see docs/benchmarks.md, "sim Nagle").
_NODELAY = os.environ.get("PDSERVE_BENCH_SIM_NODELAY") == "1"

if _DIR or _NODELAY:
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
            if _NODELAY:
                import socket

                for sock in sockets or ():
                    # A socket made with proto 0 keeps asyncio from setting TCP_NODELAY on accepted
                    # connections; Linux copies the listener's TCP_NODELAY to them.
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await original(self, sockets=sockets)
            if _DIR and getattr(self, "started", False):
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
