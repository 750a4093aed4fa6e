"""pytest fixtures for vLLM prefill/decode (P/D) disaggregated clusters.

The public names below are imported lazily: loading the plugin during collection must not import httpx,
starlette or anything heavier (and never torch or vllm).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "ClusterSpec": "pytest_pdserve.spec",
    "SessionEngine": "pytest_pdserve.glue.session_engine",
    "session_engine": "pytest_pdserve.glue.session_engine",
    "PDCluster": "pytest_pdserve.cluster",
    "ServerHandle": "pytest_pdserve.cluster",
    "MetricsSnapshot": "pytest_pdserve.metrics",
    "MetricsDelta": "pytest_pdserve.metrics",
    "scrape": "pytest_pdserve.metrics",
    "wait_settled": "pytest_pdserve.metrics",
    "assert_deterministic": "pytest_pdserve.assertions",
    "assert_pd_matches_single": "pytest_pdserve.assertions",
    "assert_cold_warm_match": "pytest_pdserve.assertions",
    "assert_prefix_cache_hit": "pytest_pdserve.assertions",
    "assert_kv_transferred": "pytest_pdserve.assertions",
    "assert_transfer_shrinks": "pytest_pdserve.assertions",
    "assert_prompt_token_sources": "pytest_pdserve.assertions",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_pdserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
