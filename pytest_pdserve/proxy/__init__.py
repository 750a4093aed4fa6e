"""Built-in P/D proxy: ``python -m pytest_pdserve.proxy --port P --prefill URL --decode URL``.

It follows the request flow of vLLM's ``toy_proxy_server.py`` (see :mod:`pytest_pdserve.proxy.app`)
and adds ``/health``, ``/v1/models``, ``/metrics``, error passthrough and a per-request log line.

The names below are imported lazily: ``python -m pytest_pdserve.proxy`` imports this package before its
``__main__``, which imports the server stack the cheap way (``common/startup.py``: without the cyclic collector,
httpx without its command-line client); an eager import here would do it the dear way first.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PREFILL_KV_TRANSFER_PARAMS", "ProxyConfig", "create_app", "prefill_body"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'pytest_pdserve.proxy' has no attribute {name!r}")
    return getattr(importlib.import_module("pytest_pdserve.proxy.app"), name)
