"""A cluster the fixtures handed out is stopped after its last user, before the next one starts (glue/last_user.py).

Real pytest sessions on the simulator; orderings, not times: each inner test records the servers' pids of the
cluster it got, and a later test checks in /proc whether they still run.
"""

from __future__ import annotations

import pytest
from _pdsession import INNER_CONFTEST, Inner

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

HELPERS = """
import json, os
from pathlib import Path

def _record(name, cluster):
    pids = [s.process.pid for s in cluster.servers]
    Path(os.environ["PDINFO_DIR"], name + ".pids").write_text(json.dumps(pids))

def _running(name):
    pids = json.loads(Path(os.environ["PDINFO_DIR"], name + ".pids").read_text())
    def up(pid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] not in "ZX"
    return [p for p in pids if up(p)]
"""

FIRST = """
from _pids import _record, _running
import pytest
from pytest_pdserve.spec import ClusterSpec


@pytest.fixture(scope="module")
def a(pd_cluster_factory):
    return pd_cluster_factory(ClusterSpec(name="a", env={"WHICH": "a"}))


def test_1(a):
    _record("a", a)


def test_2(a):
    assert len(_running("a")) == 3  # prefill, decode, proxy: still up for its second user


def test_3(pd_cluster_factory):
    assert _running("a") == []  # test_2 was its last user: stopped before this test, and before b starts
    _record("b", pd_cluster_factory(ClusterSpec(name="b", env={"WHICH": "b"})))


def test_4(pd_cluster_factory):
    assert len(_running("b")) == 3  # asked for by a test body: up while tests of its module remain
"""

SECOND = """
from _pids import _record, _running
def test_5(pd_cluster):
    assert _running("b") == []  # the module that asked for it in a test body ended
    _record("pd", pd_cluster)


def test_6():
    assert _running("pd") == []  # test_5 was pd_cluster's last user
"""


def test_a_cluster_is_stopped_after_its_last_user_and_before_the_next_starts(inner: Inner) -> None:
    inner.pytester.makepyfile(_pids=HELPERS, test_m1=FIRST, test_m2=SECOND)
    result = inner.run("-v", "-p", "no:randomly")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines([
        "*test_m1.py::test_2 PASSED*",
        "*pdserve: stopping cluster a: no remaining test uses it (its last user was test_m1.py::test_2)*",
        "*cluster b (sim, 1P x 1D) ready in*",
        "*pdserve: stopping cluster b: no remaining test uses it (its last user was test_m1.py::test_4)*",
        "*cluster pd (sim, 1P x 1D) ready in*",
        "*pdserve: stopping cluster pd: no remaining test uses it (its last user was test_m2.py::test_5)*",
    ])  # fmt: skip


PARAMETRISED = """
from _pids import _record, _running
import pytest
from pytest_pdserve.spec import ClusterSpec


@pytest.fixture(scope="module", params=["x", "y"])
def c(request, pd_cluster_factory):
    return pd_cluster_factory(ClusterSpec(name=request.param, env={"WHICH": request.param}))


def test_up(c):
    _record(c.spec.name, c)
    if c.spec.name == "y":
        assert _running("x") == []  # x's tests are done before y's start (pytest groups them by parameter)
"""


def test_a_parametrised_fixtures_cluster_stops_after_its_own_parameters_tests(inner: Inner) -> None:
    inner.pytester.makepyfile(_pids=HELPERS, test_p=PARAMETRISED)
    result = inner.run("-v", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["*stopping cluster x: no remaining test uses it (its last user was test_p.py::test_up[[]x])*"]
    )


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    return Inner(pytester, monkeypatch)


SIDE_BY_SIDE_CONFTEST = """
from pytest_pdserve.glue import last_user

# The rule is for real vLLM on CPU (~3 GB a server); the simulator stands in for it here.
last_user.SIDE_BY_SIDE_ENGINES = frozenset({"vllm", "sim"})
"""

SIDE_BY_SIDE = """
from _pids import _record, _running
from pytest_pdserve.spec import ClusterSpec

A = ClusterSpec(name="a", env={"WHICH": "a"})
B = ClusterSpec(name="b", env={"WHICH": "b"})


def test_1(pd_cluster_factory):
    _record("a", pd_cluster_factory(A))


def test_2(pd_cluster_factory):
    assert len(_running("a")) == 3
    _record("b", pd_cluster_factory(B))
    assert _running("a") == []  # stopped before b started: test_2 does not use it


def test_3(pd_cluster_factory):
    _record("a", pd_cluster_factory(A))  # started again for its next user
    _record("b", pd_cluster_factory(B))
    assert len(_running("a")) == 3 and len(_running("b")) == 3  # this test uses both: both stay up
"""


def test_on_cpu_a_real_cluster_the_running_test_does_not_use_stops_before_another_starts(inner: Inner) -> None:
    inner.pytester.makeconftest(INNER_CONFTEST + SIDE_BY_SIDE_CONFTEST)
    inner.pytester.makepyfile(_pids=HELPERS, test_s=SIDE_BY_SIDE)
    result = inner.run("-v", "-p", "no:randomly")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([
        "*test_s.py::test_1 PASSED*",
        "*pdserve: stopping cluster a: cluster b (sim) starts next on CPU and test_s.py::test_2 does not use this one*",
        "*cluster b (sim, 1P x 1D) ready in*",
        "*test_s.py::test_2 PASSED*",
        "*pdserve: stopping cluster b: cluster a (sim) starts next on CPU and test_s.py::test_3 does not use this one*",
        "*cluster a (sim, 1P x 1D) ready in*",
        "*cluster b (sim, 1P x 1D) ready in*",
        "*test_s.py::test_3 PASSED*",
    ])  # fmt: skip


OVERRIDDEN = """
import pytest
from pytest_pdserve.spec import ClusterSpec

# A project's own cluster fixture (vLLM's suites write them in conftest.py): a spec of its own.
@pytest.fixture(scope="session")
def FIXTURE(pd_cluster_factory):
    return pd_cluster_factory(ClusterSpec(name="mine", env={"WHICH": "mine"}))
"""

OVERRIDDEN_TESTS = """
from _pids import _record, _running
from pytest_pdserve.spec import ClusterSpec


def test_1(FIXTURE):
    _record("mine", FIXTURE)


def test_2(pd_cluster_factory):
    pd_cluster_factory(ClusterSpec(name="other", env={"WHICH": "other"}))
    assert _running("mine") == []  # stopped to make room: test_2 does not use it


def test_3(FIXTURE):
    assert FIXTURE.spec.name == "mine"
    assert len(_running("mine")) == 0  # the pids recorded by test_1 are gone ...
    _record("mine", FIXTURE)
    assert len(_running("mine")) == 3  # ... and pytest handed out a fresh cluster, not the stopped one
    assert FIXTURE.complete("a b c", max_tokens=1)["choices"]
"""


@pytest.mark.parametrize("fixture", ["pd_cluster", "mine_cluster"])
def test_a_conftests_own_cluster_fixture_stopped_early_is_started_afresh_for_its_next_user(
    inner: Inner, fixture: str
) -> None:
    """Every early stop goes through the manager, whose listener makes pytest forget every cached fixture value
    that is the stopped cluster: a conftest's override of `pd_cluster`, or a fixture of its own name (under xdist,
    tests/conftest.py's `real_pd_cluster` was handed out stopped), here stopped by the side-by-side rule."""
    inner.pytester.makeconftest(INNER_CONFTEST + SIDE_BY_SIDE_CONFTEST + OVERRIDDEN.replace("FIXTURE", fixture))
    inner.pytester.makepyfile(_pids=HELPERS, test_o=OVERRIDDEN_TESTS.replace("FIXTURE", fixture))
    result = inner.run("-v", "-p", "no:randomly")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([
        "*pdserve: stopping cluster mine: cluster other (sim) starts next on CPU and test_o.py::test_2 does not use*",
        "*test_o.py::test_2 PASSED*",
        "*cluster mine (sim, 1P x 1D) ready in*",
        "*test_o.py::test_3 PASSED*",
    ])  # fmt: skip


OUT_OF_ORDER_CONFTEST = """
import pytest
from pytest_pdserve.spec import ClusterSpec


@pytest.fixture(scope="session")
def shared(pd_cluster_factory):
    return pd_cluster_factory(ClusterSpec(name="shared", env={"WHICH": "shared"}))


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    # What an xdist worker does with --dist loadfile: it runs the files in the order they are sent, here the
    # second collected file first.
    items = sorted(session.items, key=lambda item: 0 if "test_b.py" in item.nodeid else 1)
    for i, item in enumerate(items):
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=items[i + 1] if i + 1 < len(items) else None)
    return True
"""


def test_a_cluster_is_kept_for_an_earlier_collected_test_that_runs_later(inner: Inner) -> None:
    """The remaining tests are those this process has not run, not those collected after this one."""
    inner.pytester.makeconftest(INNER_CONFTEST + OUT_OF_ORDER_CONFTEST)
    inner.pytester.makepyfile(
        test_a="def test_a(shared):\n    assert shared.complete('a b', max_tokens=1)['choices']\n",
        test_b="def test_b(shared):\n    assert shared.complete('a b', max_tokens=1)['choices']\n",
    )
    result = inner.run("-v", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_b.py::test_b PASSED*", "*test_a.py::test_a PASSED*"])
    out = result.stdout.str()
    assert "its last user was test_b.py::test_b" not in out  # test_a, collected first, had not run yet
    assert out.count("cluster shared (sim, 1P x 1D) ready in") == 1, "started twice"
