"""``--pd-export-env`` is one plugin object (glue/export_env.py ``ExportEnvPlugin``), registered by plugin.py's
``pytest_configure`` only when the option is on, as ``ReusePlugin`` is: a run without it neither registers nor
imports it (docs/architecture.md, "plugin.py")."""

from __future__ import annotations

import pytest
from _pdsession import Inner

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

#: The inner conftest's report: whether the export module was imported by the end of the session.
LOADED = """
import sys

def pytest_sessionfinish(session):
    print("EXPORT_ENV_LOADED=" + str("pytest_pdserve.glue.export_env" in sys.modules))
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    return Inner(pytester, monkeypatch)


def test_the_export_env_plugin_is_registered_only_when_asked_for(inner: Inner) -> None:
    inner.pytester.makeconftest(inner.pytester.path.joinpath("conftest.py").read_text() + LOADED)
    inner.pytester.makepyfile("def test_nothing(): pass")
    plain = inner.run("-s", "--trace-config")
    plain.assert_outcomes(passed=1)
    assert "ExportEnvPlugin" not in plain.stdout.str()
    plain.stdout.fnmatch_lines(["*EXPORT_ENV_LOADED=False"])
    asked = inner.run("-s", "--trace-config", "--pd-export-env")
    asked.assert_outcomes(passed=1)
    asked.stdout.fnmatch_lines(
        [
            "*PLUGIN registered: <pytest_pdserve.glue.export_env.ExportEnvPlugin object*",
            "pdserve: exported: PREFILL_HOST=127.0.0.1 *",
        ]
    )
    inner.gone_within()


#: The inner conftest's report, from the controller and each xdist worker: which of worker_verdict's plugins it has.
VERDICT_PLUGINS = """
import os

from pytest_pdserve.glue import worker_verdict


def pytest_sessionfinish(session):
    pm = session.config.pluginmanager
    who = getattr(session.config, "workerinput", {}).get("workerid", "main")
    has = [name for name in (worker_verdict.WORKER, worker_verdict.CONTROLLER) if pm.get_plugin(name) is not None]
    with open(os.path.join(str(session.config.rootpath), "verdict-" + who), "w") as f:
        f.write(" ".join(has))
"""


def test_the_worker_verdict_plugins_are_registered_only_under_xdist_each_where_it_acts(inner: Inner) -> None:
    """glue/worker_verdict.py: ``WorkerVerdict`` in each xdist worker, ``ControllerVerdicts`` in the controller, and
    neither in a run without ``-n`` (or with ``-n 0``)."""
    root = inner.pytester.path
    inner.pytester.makeconftest(root.joinpath("conftest.py").read_text() + VERDICT_PLUGINS)
    inner.pytester.makepyfile("def test_nothing(): pass")
    for plain in ((), ("-n", "0")):
        inner.run(*plain).assert_outcomes(passed=1)
        assert sorted(p.name for p in root.glob("verdict-*")) == ["verdict-main"]
        assert root.joinpath("verdict-main").read_text() == ""
    inner.run("-n", "2").assert_outcomes(passed=1)
    assert root.joinpath("verdict-main").read_text() == "pdserve-controller-verdicts"
    for worker in ("gw0", "gw1"):
        assert root.joinpath(f"verdict-{worker}").read_text() == "pdserve-worker-verdict"
