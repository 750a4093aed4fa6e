"""Planting an entry (a FIFO, a symbolic link) in an inner run's own log directory before any cluster starts.

That directory is new for each run (``<log dir>/<time>-<pid>``), so it cannot be planted in beforehand: the
inner session's conftest does it, from an autouse session fixture (those come before ``pd_cluster``).
"""

from __future__ import annotations

import pytest

#: The inner conftest: plants what $PDSERVE_TEST_PLANT says (``kind:name:target``) in the run's own log directory.
PLANT_CONFTEST = """
import os

import pytest

from pytest_pdserve.glue.fixtures import log_dir


@pytest.fixture(autouse=True, scope="session")
def _planted(request, tmp_path_factory):
    kind, name, target = os.environ["PDSERVE_TEST_PLANT"].split(":", 2)
    path = log_dir(request.config, tmp_path_factory) / name
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(target)
"""


def plant_in_run_logs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, kind: str, name: str, target: str = ""
) -> None:
    """Make the inner run plant a ``kind`` ("fifo" or "link" to ``target``) named ``name`` in its log directory."""
    pytester.makeconftest(PLANT_CONFTEST)
    monkeypatch.setenv("PDSERVE_TEST_PLANT", f"{kind}:{name}:{target}")
