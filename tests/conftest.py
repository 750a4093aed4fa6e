"""Shared test helpers. ``pytester`` comes from ``-p pytester`` in pyproject's addopts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

# Variables that change what the plugin resolves or detects; tests that run an inner pytest start
# from none of them, whatever the developer's shell or the CI job exported.
PDSERVE_ENV_VARS = (
    "ATTENTION_BACKEND",
    "VLLM_SERVE_EXTRA_ARGS",
    "PREFILL_GPU_ID",
    "DECODE_GPU_ID",
    "GPU_MEMORY_UTILIZATION",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
)


@pytest.fixture
def data_dir() -> Path:
    """Directory of recorded tool outputs (tests/data)."""
    return DATA


@pytest.fixture
def clean_pdserve_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every PDSERVE_* variable and vLLM-script variable the plugin reads."""
    for name in list(os.environ):
        if name.startswith("PDSERVE_") or name in PDSERVE_ENV_VARS:
            monkeypatch.delenv(name)
