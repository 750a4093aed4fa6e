"""Issue 25, class 5: a log directory two runs share, and one removed under a run.

Two runs given the same ``pdserve_log_dir`` wrote into the same ``pd-1-*`` files, so each report carried the other
run's log lines: each run now writes into a directory of its own under it (``<time>-<pid>``). A log directory
removed mid-run came back 0755 (a plain ``mkdir``): it is made again private, 0700, like the first time.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

#: Both runs are inside their test at once (each waits for the other's "up" file), then fail on purpose so that
#: the report carries their servers' log sections.
MEETING_TEST = """
import os, time
from pathlib import Path

def test_meet(pd_cluster):
    here = Path(os.environ["MEET_DIR"])
    (here / f"up-{os.getpid()}").touch()
    deadline = time.monotonic() + 240  # the other run's start, on a loaded machine too
    while len(list(here.glob("up-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(here.glob("up-*"))) == 2, "the other run never came"
    assert pd_cluster.complete("a b c", max_tokens=1)
    raise AssertionError("fail on purpose")
"""


def log_dir_setting(path: Path, via: str, pytester: pytest.Pytester) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) giving the log dir ``path`` through ``via``."""
    if via == "argv":
        return [f"--pd-log-dir={path}"], {}
    if via == "PYTEST_ADDOPTS":
        return [], {"PYTEST_ADDOPTS": f"--pd-log-dir={path}"}
    if via == "ini":
        pytester.makeini(f"[pytest]\npdserve_log_dir = {path}\n")
        return [], {}
    return [], {"PDSERVE_LOG_DIR": str(path)}


VIAS = ["argv", "PYTEST_ADDOPTS", "ini", "env"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("via", VIAS)
def test_two_runs_sharing_a_log_dir_each_write_and_report_their_own_logs(pytester: pytest.Pytester, via: str) -> None:
    logs = pytester.path / "shared-logs"
    args, env = log_dir_setting(logs, via, pytester)
    pytester.makepyfile(test_meet=MEETING_TEST)
    env = {**os.environ, **env, "MEET_DIR": str(pytester.path)}
    argv = [sys.executable, "-m", "pytest", "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}",
            "-p", "no:cacheprovider", *args]  # fmt: skip
    runs = [
        subprocess.Popen(argv, cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(2)
    ]
    outs = [run.communicate(timeout=400)[0].decode(errors="replace") for run in runs]
    run_dirs = sorted(p for p in logs.iterdir() if p.is_dir())
    assert len(run_dirs) == 2, (run_dirs, outs)
    for run_dir in run_dirs:
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        log = (run_dir / "pd-1-prefill-0.log").read_text()
        assert log.count("pdserve: starting prefill-0") == 1, log[:2000]  # one run's server, not two
    for run, out in zip(runs, outs, strict=True):
        assert run.returncode == 1, out
        assert "fail on purpose" in out
        [mine] = [d for d in run_dirs if f"-{run.pid}" in d.name]  # <time>-<pid>
        [other] = [d for d in run_dirs if d != mine]
        assert f"pdserve prefill-0 log ({mine / 'pd-1-prefill-0.log'})" in out, out
        assert str(other) not in out, out


REMOVING_TESTS = """
import os, shutil
from pathlib import Path

def test_a(pd_cluster_factory):
    run_dir = pd_cluster_factory().prefill[0].log_path.parent
    (Path(os.environ["OUT_DIR"]) / "run-dir").write_text(str(run_dir))
    shutil.rmtree(run_dir.parent)  # the whole --pd-log-dir, as a cleanup job in another terminal does

def test_b(pd_cluster_factory):
    assert pd_cluster_factory(block_size=16).complete("a b c", max_tokens=1)
"""


@pytest.mark.parametrize("via", VIAS)
def test_a_log_dir_removed_mid_run_comes_back_private(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    logs = pytester.path / "ci-logs"
    args, env = log_dir_setting(logs, via, pytester)
    for key, value in {**env, "OUT_DIR": str(pytester.path)}.items():
        monkeypatch.setenv(key, value)
    pytester.makepyfile(REMOVING_TESTS)
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}", "-p", "no:cacheprovider", *args, timeout=120
    )
    result.assert_outcomes(passed=2)
    run_dir = Path((pytester.path / "run-dir").read_text())
    assert run_dir.parent == logs
    assert (run_dir / "pd-2-prefill-0.log").is_file()  # the second cluster's log, in the directory made again
    assert [stat.S_IMODE(p.stat().st_mode) for p in (logs, run_dir)] == [0o700, 0o700]
