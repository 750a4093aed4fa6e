"""Issue 43, class 5: unique per run means unique across containers.

Two runs with pytest as PID 1 in two PID namespaces, given the same ``--pd-log-dir`` in the same second, got one
run directory (``<time>-<pid>``) and wrote into each other's logs. A run's directory is now made by the run itself,
with a random part in its name (``common/created.make_unique_dir``: ``mkdir`` decides, another name if taken), and a
kept cluster's state names its keeper's PID namespace (a pid means nothing in another one). The runs here are real
PID namespaces (``unshare --pid --fork --mount-proc``: pytest is PID 1 in each) with a frozen clock, given the log
dir through each door.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_pdserve.common import created

from .test_shared_log_dir import VIAS, log_dir_setting

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

#: Both runs believe it is the same second (two containers started together); the conftest freezes the clock pytest
#: and pdserve read names from.
FROZEN_CLOCK = """
import time

_strftime = time.strftime


def _same_second(fmt, t=None):
    return _strftime(fmt, time.localtime(1767225600))


time.strftime = _same_second
"""

#: Each run fails on purpose, so that its report carries its servers' log sections. (The runs start together, but
#: need not meet: with one pid and a frozen clock, a run after the other would have hit the same name too.)
MEETING_TEST = """
import os

def test_meet(pd_cluster):
    assert pd_cluster.complete("a b c", max_tokens=1)
    raise AssertionError(f"fail on purpose, pid {os.getpid()}")
"""


def _namespace_prefix() -> list[str]:
    """How to start a process as PID 1 of a new PID namespace here (root, or an unprivileged user namespace)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) here: two PID namespaces cannot be made")
    for prefix in ([unshare, "--pid", "--fork", "--mount-proc"],
                   [unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]):  # fmt: skip
        probe = subprocess.run([*prefix, sys.executable, "-c", "import os; print(os.getpid())"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == "1":
            return prefix
    pytest.skip(f"cannot make a PID namespace here (unshare: {probe.stderr.strip()[:200]})")


@pytest.mark.parametrize("via", VIAS)
def test_two_runs_as_pid_1_in_two_namespaces_in_one_second_get_two_run_dirs(
    pytester: pytest.Pytester, via: str
) -> None:
    prefix = _namespace_prefix()
    logs = pytester.path / "shared-logs"
    args, env = log_dir_setting(logs, via, pytester)
    pytester.makeconftest(FROZEN_CLOCK)
    pytester.makepyfile(test_meet=MEETING_TEST)
    env = {**os.environ, **env}
    argv = [*prefix, sys.executable, "-m", "pytest", "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}",
            "-p", "no:cacheprovider", *args]  # fmt: skip
    runs = [
        subprocess.Popen(argv, cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(2)
    ]
    outs = [run.communicate(timeout=600)[0].decode(errors="replace") for run in runs]
    for out in outs:
        assert "fail on purpose, pid 1" in out, out[-3000:]  # pytest was PID 1 in each
    run_dirs = sorted(p for p in logs.iterdir() if p.is_dir())
    assert len(run_dirs) == 2, (run_dirs, [o[-2000:] for o in outs])
    assert run_dirs[0].name.rsplit("-", 1)[0] == run_dirs[1].name.rsplit("-", 1)[0]  # same second, same pid
    for run_dir in run_dirs:
        assert created.manifest(run_dir, created.RUN_LOGS) is not None  # made by its run
        log = (run_dir / "pd-1-prefill-0.log").read_text()
        assert log.count("pdserve: starting prefill-0") == 1, log[:2000]  # one run's server, not two
    for out in outs:
        [mine] = [d for d in run_dirs if f"pdserve prefill-0 log ({d / 'pd-1-prefill-0.log'})" in out]
        [other] = [d for d in run_dirs if d != mine]
        assert str(other) not in out, out[-3000:]


def test_a_run_dir_name_someone_else_holds_is_never_shared(tmp_path: Path) -> None:
    """The name is a proposal, the ``mkdir`` decides: every name already taken (by a run in another container, by
    anyone) is passed over, and what is made is this process's own, marked."""
    stem = "20260101-000000-1"
    made = {created.make_unique_dir(tmp_path, stem, 0o700, created.RUN_LOGS) for _ in range(64)}
    assert len(made) == 64
    taken = tmp_path / "taken"
    taken.mkdir()
    for name in ("a", "b"):  # a name held by someone: FileExistsError, not theirs to share
        (taken / name).mkdir()
        with pytest.raises(FileExistsError):
            created.make_dir(taken / name, 0o700, created.RUN_LOGS)
        assert created.manifest(taken / name) is None


def test_a_kept_cluster_of_another_pid_namespace_is_left_to_it(tmp_path: Path) -> None:
    """A reuse dir shared by two containers: a state whose keeper runs in another PID namespace names a pid that
    means nothing here (or someone else). It is neither listed, nor swept, nor removed."""
    from pytest_pdserve.common.logfile import write_replace
    from pytest_pdserve.reuse import client, dirs

    reuse = dirs.ensure_reuse_dir(tmp_path / "reuse")
    server = {"pid": 1, "pgid": 1, "starttime": 1, "token": f"none-{os.getpid()}", "url": "http://127.0.0.1:9",
              "name": "prefill-0", "role": "prefill"}  # fmt: skip
    state = {"id": "pd-1-bbbbbb", "spec_name": "pd", "created": 0, "fingerprint": {}, "servers": [server],
             "proxy": {**server, "name": "proxy", "role": "proxy"},
             "keeper": {"pid": 1, "starttime": 1, "socket": "theirs", "ttl": 900, "since": 0,
                        "pidns": "pid:[1]"}}  # fmt: skip
    write_replace(reuse / "pd-1-bbbbbb.json", json.dumps(state).encode())
    said: list[str] = []
    assert client.list_kept(reuse, report=said.append) == []
    assert (reuse / "pd-1-bbbbbb.json").exists(), said
    assert said == []
