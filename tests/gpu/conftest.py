"""Real-GPU proofs: assignment, visibility, markers, release gate, orphans, xdist (docs/hardware.md).

Every test here carries the plugin's ``cuda`` marker, so a machine without CUDA GPUs (CI) skips them with the
plugin's own reason ("needs platform cuda, this machine is cpu (...)"); a test that needs more GPUs than are
visible is skipped by ``gpus(n)`` with the plugin's count reason. We chose the markers over an opt-in variable
(``PDSERVE_GPU_TESTS=1``) because the tests are cheap where GPUs exist (16 MiB per server, about two minutes)
and a suite that only runs when someone remembers a variable rots; the tests also dogfood the markers.

Two more skips live here, because the platform marker cannot see them: a *simulated* inventory
(``--pd-simulate-gpus``; its GPUs have no UUIDs a server could report) and an interpreter without ``torch``
(the simulator's GPU mode, ``PDSERVE_SIM_GPU=1``, imports it). scripts/gpu-proof.sh runs this directory on a
device machine, or against tests/gpu/fake (a stand-in nvidia-smi and torch) with ``--fake``.

Each test drives an inner pytest (``pytester``) whose conftest is :data:`INNER_CONFTEST`; what the inner test
saw is written as JSON to ``$PROOF_DIR``. Evidence goes to ``$PDSERVE_GPU_PROOF_DIR`` (``evidence.jsonl``,
``inner-runs.log``, server logs under ``logs/``) when set, else to a temporary directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_pdserve.glue.session_inventory import get_inventory

from .gpuproof import Inner, PhysicalGpus

HERE = Path(__file__).parent
PROOF_DIR_ENV = "PDSERVE_GPU_PROOF_DIR"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this directory on a simulated inventory or without torch (the ``cuda`` marker covers CPU machines)."""
    mine = [item for item in items if HERE in Path(str(item.path)).parents]
    if not mine:
        return
    inv = get_inventory(config)
    if inv.platform != "cuda":
        return  # the cuda marker skips them, with the plugin's reason
    reason = None
    if inv.simulated:
        reason = f"needs real CUDA GPUs, the inventory is simulated ({inv.source}; drop --pd-simulate-gpus)"
    elif importlib.util.find_spec("torch") is None:
        reason = f"needs torch in {sys.executable} (PDSERVE_SIM_GPU=1 imports it to hold memory on the GPU)"
    if reason is not None:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def physical_gpus() -> PhysicalGpus:
    """The machine's GPUs by index, read straight from nvidia-smi (not through the plugin)."""
    raw = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    rows = [[f.strip() for f in line.split(",")] for line in raw.splitlines() if line.strip()]
    return PhysicalGpus(raw, [uuid for _, uuid in sorted((int(i), u) for i, u in rows)])


@pytest.fixture(scope="session")
def proof_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where evidence and kept logs go: ``$PDSERVE_GPU_PROOF_DIR`` or a temporary directory."""
    given = os.environ.get(PROOF_DIR_ENV)
    path = Path(given) if given else tmp_path_factory.mktemp("gpu-proof")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def evidence(request: pytest.FixtureRequest, proof_dir: Path) -> Callable[..., None]:
    """``evidence(**facts)`` appends one JSON line (test id, UTC time, facts) to ``evidence.jsonl``."""

    def write(**facts: Any) -> None:
        line = {"test": request.node.nodeid, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **facts}
        with (proof_dir / "evidence.jsonl").open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")

    return write


@pytest.fixture
def inner(
    request: pytest.FixtureRequest, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, proof_dir: Path
) -> Inner:
    """An :class:`Inner` session builder for this test (pdserve env variables of the outer shell removed)."""
    for name in list(os.environ):
        if name.startswith("PDSERVE_") and name != PROOF_DIR_ENV:
            monkeypatch.delenv(name)
    for name in ("PREFILL_GPU_ID", "DECODE_GPU_ID", "VLLM_SERVE_EXTRA_ARGS", "ATTENTION_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:60]
    return Inner(pytester, monkeypatch, proof_dir, label)
