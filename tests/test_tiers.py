"""The test tiers: pyproject's markers ``vllm`` and ``gpu``, set by tests/conftest.py from what a test uses.

README "Development" runs each tier by its marker (``pytest -m "not vllm"`` is the simulator tier), so a real-vLLM
test the marker missed would run in the simulator tier and skip there, run by no tier. Until the markers, the
real-vLLM tests were told apart by their skip when vLLM is missing ("real vLLM not installed", the plugin's "real
vLLM is not installed here", "no (real) vLLM venv at"): the checks below hold the markers to that. The converse (no
test of the simulator tier skips for want of vLLM) is checked on every CI run: `.ci/run` fails on such a skip.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: Writes the selected items' node ids and marker names as JSON (a plugin the inner sessions load with -p).
PROBE = """
import json, os, pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    with open(os.environ["TIERS_OUT"], "w") as f:
        json.dump({i.nodeid: sorted({m.name for m in i.iter_markers()}) for i in session.items}, f)
"""
REAL_VLLM_SKIP = re.compile(r"real vLLM (is )?not installed|no (real )?vLLM venv at")


@pytest.fixture
def suite(pytester: pytest.Pytester, clean_pdserve_env: None, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """An inner session over this repository's own tests/, with real vLLM hidden from it."""
    pytester.makepyfile(tiers_probe=PROBE)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # and PDSERVE_VLLM_EXECUTABLE unset: `vllm` is looked up on PATH
    monkeypatch.setenv("PDSERVE_VLLM_VENV", str(pytester.path / "no-vllm"))
    monkeypatch.setenv("TIERS_OUT", str(pytester.path / "tiers.json"))
    return pytester


def select(suite: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict[str, list[str]]]:
    """Run the inner session; the selected items with their markers, as the probe wrote them."""
    result = suite.runpytest_subprocess(
        str(REPO / "tests"), f"--rootdir={REPO}", "-c", str(REPO / "pyproject.toml"), "-p", "tiers_probe", *args
    )
    items: dict[str, list[str]] = json.loads((suite.path / "tiers.json").read_text())
    return result, items


@pytest.mark.timeout(600)
def test_the_vllm_tier_is_the_tests_that_skip_without_real_vllm(suite: pytest.Pytester) -> None:
    result, items = select(suite, "-m", "vllm", "-rs")
    # 13 contract[vllm] + reuse + differential + examples + 4 of vLLM's modules + 4 that run the vLLM venv's python
    assert len(items) >= 24, sorted(items)
    result.assert_outcomes(skipped=len(items))
    skips = [line for line in result.stdout.lines if line.startswith("SKIPPED")]
    assert skips, result.stdout.str()
    assert all(REAL_VLLM_SKIP.search(line) for line in skips), "\n".join(skips)
    assert all("vllm" in marks for marks in items.values())


@pytest.mark.timeout(600)
def test_the_simulator_tier_is_everything_else(suite: pytest.Pytester) -> None:
    everything, all_items = select(suite, "--collect-only", "-q")
    result, sim_items = select(suite, "--collect-only", "-q", "-m", "not vllm")
    assert everything.ret == result.ret == pytest.ExitCode.OK
    real = {nodeid for nodeid, marks in all_items.items() if "vllm" in marks}
    assert len(real) >= 24
    assert set(sim_items) == set(all_items) - real
    # The engine parametrisation is how a module runs one script on both engines: its vllm half is the vllm tier.
    assert not [nodeid for nodeid in sim_items if nodeid.endswith("[vllm]")]
    assert [nodeid for nodeid in sim_items if nodeid.endswith("[sim]")]
    gpu = {nodeid for nodeid, marks in all_items.items() if "gpu" in marks}
    assert gpu == {nodeid for nodeid in all_items if nodeid.startswith("tests/gpu/")}
    assert gpu


def test_inner_sessions_load_neither_hypothesis_nor_anyio(pytester: pytest.Pytester) -> None:
    """tests/conftest.py keeps both plugins out of every inner session (about 0.5 s of CPU each); pytester unsets
    PYTEST_ADDOPTS when it is set up, which undid that for every pytester session until 2026-12-04."""
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess()
    [plugins] = [line for line in result.outlines if line.startswith("plugins:")]
    assert "pdserve" in plugins
    assert "hypothesis" not in plugins, plugins
    assert "anyio" not in plugins, plugins
