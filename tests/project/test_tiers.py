"""The test tiers: pyproject's markers ``vllm`` and ``gpu``, set by tests/conftest.py from what a test uses.

README "Development" runs each tier by its marker (``pytest -m "not vllm"`` is the simulator tier), so a real-vLLM
test the marker missed would run in the simulator tier and skip there, run by no tier. Until the markers, the
real-vLLM tests were told apart by their skip when vLLM is missing ("real vLLM not installed", the plugin's "real
vLLM is not installed here", "no (real) vLLM venv at"): the checks below hold the markers to that. The converse (no
test of the simulator tier skips for want of vLLM) is checked on every CI run: `.ci/run` fails on such a skip.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.timeout(600)
def test_the_unit_tier_is_the_tests_that_start_no_process(suite: pytest.Pytester) -> None:
    """``-m unit`` (README "Development"): no real-vLLM or GPU test, no test that asks for pytester or a cluster,
    none of the files whose every test starts a process; and a good share of the suite."""
    result, unit = select(suite, "--collect-only", "-q", "-m", "unit")
    _, everything = select(suite, "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK
    assert len(unit) >= 400, len(unit)
    assert all("unit" in marks and not {"vllm", "gpu"} & set(marks) for marks in unit.values())
    assert {nodeid for nodeid, marks in everything.items() if "unit" in marks} == set(unit)
    processes = ("tests/running/test_watchdog.py", "tests/glue/test_lifecycle.py", "tests/promises/test_reliability.py")
    for starts_processes in processes:
        assert not [nodeid for nodeid in unit if nodeid.startswith(starts_processes)], starts_processes
    assert [nodeid for nodeid in unit if nodeid.startswith("tests/config/test_settings.py")] == [], "pytester sessions"
    assert [nodeid for nodeid in unit if nodeid.startswith("tests/common/test_exposition.py")], "a pure module left out"


#: A module the classification reads (tests/_tiers.py): which of its tests start a process, and through what.
CLASSIFIED = """
import os
import subprocess
import pytest

HELPER_ARGV = ["true"]

def _deep():
    return subprocess.run(HELPER_ARGV, check=True)

def _helper():
    return _deep()

class Holder:
    def start(self):
        return _helper()

def _pure(x):
    return x + 1

@pytest.fixture
def holder():
    return Holder()

def test_through_two_helpers():
    _helper()

def test_through_a_class():
    Holder().start()

def test_through_a_fixture(holder):
    pass

def test_forks():
    os.fork()

def test_by_name(request):
    request.getfixturevalue("pd_cluster")

def test_pure():
    assert _pure(1) == 2
"""


def test_the_classification_reads_what_a_test_runs(tmp_path: Path) -> None:
    import _tiers

    path = tmp_path / "test_classified.py"
    path.write_text(CLASSIFIED)
    module = _tiers._Module(path)  # noqa: SLF001 (the reading under test)
    reasons = {
        name: _tiers._reason_in_code([(module, module.defs[name])])  # noqa: SLF001
        for name in ("test_through_two_helpers", "test_through_a_class", "test_forks", "test_by_name", "test_pure")
    }
    reasons["test_through_a_fixture"] = _tiers._reason_in_code(  # noqa: SLF001
        [(module, module.defs["test_through_a_fixture"]), (module, module.defs["holder"])]
    )
    assert reasons.pop("test_pure") is None
    assert all(reason is not None for reason in reasons.values()), reasons
    assert reasons["test_forks"].startswith("fork ")  # type: ignore[union-attr]
    assert reasons["test_by_name"].startswith("pd_cluster ")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "start",
    [
        lambda: subprocess.run(["true"], check=False),
        lambda: os.fork(),
        lambda: os.system("true"),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        lambda: asyncio.run(asyncio.create_subprocess_exec("true")),
    ],
    ids=["subprocess", "fork", "system", "multiprocessing-spawn", "asyncio"],
)
def test_the_tripwire_fails_a_unit_test_that_starts_a_process(
    monkeypatch: pytest.MonkeyPatch, start: Callable[[], object]
) -> None:
    """What tests/conftest.py installs for every unit-tier test: each way of starting a process fails the test
    (pytest's Failed is no Exception: code under test that catches errors cannot swallow it)."""
    import _tiers

    _tiers.forbid_processes(monkeypatch, "tests/test_x.py::test_y")
    with pytest.raises(pytest.fail.Exception, match="is in the unit tier .* but it started one"):
        start()
