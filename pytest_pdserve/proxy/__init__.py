"""Built-in P/D proxy: ``python -m pytest_pdserve.proxy --port P --prefill URL --decode URL``.

It follows the request flow of vLLM's ``toy_proxy_server.py`` (see :mod:`pytest_pdserve.proxy.app`)
and adds ``/health``, ``/v1/models``, ``/metrics``, error passthrough and a per-request log line.
"""

from __future__ import annotations

from pytest_pdserve.proxy.app import PREFILL_KV_TRANSFER_PARAMS, ProxyConfig, create_app, prefill_body

__all__ = ["PREFILL_KV_TRANSFER_PARAMS", "ProxyConfig", "create_app", "prefill_body"]
