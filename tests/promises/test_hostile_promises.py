"""README promises attacked as outside testers attack them (issue 43's held-out round): each test names the
sentence it holds the plugin to, and goes through the doors a user, a careless CI author or another user has."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}", "-p", "no:cacheprovider", *args,
        timeout=600,
    )  # fmt: skip


# ------------------------------------------------- --pd-require-kv-transfer under xdist: a green that lied

#: One module that moves KV through the proxy, one that passes without any: the second is what the option is for.
MOVES = """
from pytest_pdserve.prompts import prompt_with_tokens


def test_moves(pd_cluster):
    pd_cluster.complete(prompt_with_tokens(pd_cluster, 300), max_tokens=2)
"""
#: Decode primed directly, as vLLM's test_edge_cases does: its hits need no prefill, and no KV moves.
VACUOUS = """
def test_direct(pd_cluster):
    pd_cluster.decode[0].complete("the decode server alone", max_tokens=2)
"""


def test_require_kv_transfer_judges_the_last_module_before_its_teardown_stops_the_cluster(
    pytester: pytest.Pytester,
) -> None:
    """README: the terminal summary prints "per test module the KV moved from prefill to decode", and
    "`--pd-require-kv-transfer` fails the session when a module that passed moved none". The last test's teardown
    stops the session's clusters (the exported one too, once a test used `pd_cluster`): the last module was measured
    after that, on stopped servers, so it counted as unmeasured, never as vacuous, and the run passed."""
    pytester.makepyfile(test_moves=MOVES, test_vacuous=VACUOUS)  # test_vacuous.py runs last
    result = _run(pytester, "--pd-export-env", "--pd-require-kv-transfer")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines([
        "pdserve: during this session: *decode-0 prefix-cache hits * tokens, external_kv_transfer * tokens",
        "pdserve: KV moved prefill -> decode in test_moves.py: external_kv_transfer * tokens, NIXL * bytes",
        "pdserve: KV moved prefill -> decode in test_vacuous.py: external_kv_transfer 0 tokens, NIXL 0 bytes",
        "pdserve: no KV moved from prefill to decode in test_vacuous.py: *failing the session*",
    ])  # fmt: skip
    assert "in test_moves.py: external_kv_transfer 0 tokens" not in result.stdout.str()


@pytest.mark.parametrize(
    ("door", "args"),
    [
        ("argv", ("--pd-export-env", "--pd-require-kv-transfer")),
        ("preset", ("--pd-export-env", "--pd-preset=vllm-edge-case")),
    ],
)
def test_require_kv_transfer_fails_an_xdist_run_too(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, door: str, args: tuple[str, ...]
) -> None:
    """README: "`--pd-require-kv-transfer` (on under `--pd-preset`) fails the session when a module that passed
    moved none", and "Under pytest-xdist each worker starts and exports its own cluster". A worker's exit status
    and terminal summary reach no one (xdist's controller decides from test reports), so the run was green and
    silent."""
    pytest.importorskip("xdist")
    pytester.makepyfile(test_moves=MOVES, test_vacuous=VACUOUS)
    if door == "preset":  # a CI wrapper's PYTEST_ADDOPTS, as AMD's does for vLLM's modules
        monkeypatch.setenv("PYTEST_ADDOPTS", " ".join([os.environ.get("PYTEST_ADDOPTS", ""), *args]).strip())
        args = ()
    else:
        args = (*args,)
    result = _run(pytester, *args, "-n", "2", "--dist=loadfile")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(["[[]gw?[]] pdserve: no KV moved from prefill to decode in test_vacuous.py: *"])
    vacuous = [line for line in result.stdout.lines if "no KV moved from prefill to decode" in line]
    assert not any("test_moves.py" in line for line in vacuous), vacuous
    result.stdout.fnmatch_lines(["[[]gw?[]] pdserve: KV moved prefill -> decode in test_moves.py: *"])


# ------------------------------------------------- a relative cache dir and a test that changes directory

CHDIR_THEN_START = """
import os
from pytest_pdserve.spec import ClusterSpec


def test_elsewhere(pd_cluster_factory):
    os.chdir("elsewhere")  # a test (or monkeypatch.chdir) that forgets to go back
    assert pd_cluster_factory(ClusterSpec(name="late")).complete("hello", max_tokens=2)["choices"]
"""


def test_a_relative_cache_dir_keeps_its_clusters_where_pdserve_ls_finds_them(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: kept clusters' state lives in `--pd-reuse-dir` (default `${PDSERVE_CACHE_DIR:-...}/reuse`), checked
    as ours, and `pdserve ls` / `pdserve stop --all` see what was kept. `PDSERVE_CACHE_DIR=.cache` is relative:
    after a test's `os.chdir` the keeper wrote its state into `elsewhere/.cache/reuse`, a directory never checked,
    and `pdserve stop --all` from the project could not find (nor stop) the cluster."""
    from pytest_pdserve import cli
    from pytest_pdserve.reuse import dirs

    for var in dirs.CI_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", ".cache")
    (pytester.path / "elsewhere").mkdir()
    pytester.makepyfile(CHDIR_THEN_START)
    reuse = pytester.path / ".cache" / "reuse"
    strayed = pytester.path / "elsewhere" / ".cache" / "reuse"
    try:
        _run(pytester, "--pd-reuse").assert_outcomes(passed=1)
        assert not strayed.exists(), sorted(p.name for p in strayed.iterdir())
        assert [p.name for p in reuse.glob("late-*.json")], sorted(p.name for p in reuse.iterdir())
        monkeypatch.chdir(pytester.path)
        assert cli.main(["stop", "--all"]) == 0  # $PDSERVE_CACHE_DIR from where the run started
        assert not list(reuse.glob("late-*.json"))
    finally:
        for where in (reuse, strayed):
            if where.is_dir():
                cli.main(["--dir", str(where), "stop", "--all"])


# ------------------------------------------------- a session cluster that cannot start, under xdist

#: As vLLM's own modules do: the addresses are read at import.
READS_AT_IMPORT = """
import os

PREFILL_PORT = os.environ["PREFILL_PORT"]


def test_uses_it():
    assert PREFILL_PORT
"""


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one-process", "xdist"])
def test_a_session_cluster_that_cannot_start_stops_the_run_with_its_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: tuple[str, ...]
) -> None:
    """README: "A cluster that cannot start stops the run with one message before any module is imported." Under
    xdist a worker's `pytest.exit` is a crash: xdist restarted the worker (a cluster start each) up to its limit,
    printed "node down: Not properly terminated" each time, and ended "no tests ran", exit code 5, which CI
    scripts often take for success."""
    if workers:
        pytest.importorskip("xdist")
    monkeypatch.setenv("PDSERVE_SIM_CRASH_AT_STARTUP", "simulated: CUDA out of memory")  # the servers inherit it
    pytester.makepyfile(test_reads=READS_AT_IMPORT)
    result = _run(pytester, "--pd-export-env", *workers)
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out
    said = [line for line in out.splitlines() if "the session cluster for --pd-export-env did not start" in line]
    assert said
    if workers:
        assert len(said) == 2, said  # once per worker: none restarted
    assert "simulated: CUDA out of memory" in out
    for wrong in ("KeyError", "node down", "Not properly terminated", "Traceback"):
        assert wrong not in out, out


@pytest.mark.parametrize("door", ["argv", "env"])
def test_an_export_file_pdserve_did_not_write_is_one_usage_error_under_xdist(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, door: str
) -> None:
    """README: "a file that exists and was not written by pdserve is never overwritten (a usage error)". Under
    xdist only the workers looked: each raised it as a crash, restarted by xdist, hundreds of traceback lines, and
    the run ended "no tests ran" (exit code 5)."""
    pytest.importorskip("xdist")
    script = pytester.path / "env.sh"
    script.write_text("#!/bin/sh\nmy precious script\n")
    pytester.makepyfile(test_reads=READS_AT_IMPORT)
    if door == "env":
        monkeypatch.setenv("PDSERVE_EXPORT_ENV_FILE", str(script))
        result = _run(pytester, "-n", "2")
    else:
        result = _run(pytester, f"--pd-export-env-file={script}", "-n", "2")
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out
    source = "environment variable PDSERVE_EXPORT_ENV_FILE" if door == "env" else "--pd-export-env-file"
    assert f"export_env_file {script} (from {source}" in out
    assert "exists and was not written by pdserve" in out
    assert "node down" not in out, out
    assert "Traceback" not in out, out
    assert script.read_text() == "#!/bin/sh\nmy precious script\n"


# ------------------------------------------------- relative paths the user gave, after a test's chdir

#: A proxy script beside the tests, as README's `--pd-proxy-command="{python} toy_proxy_server.py ..."` has it: it
#: runs the built-in proxy with the ports it is given.
TOY_PROXY = """
import sys

from pytest_pdserve.proxy.__main__ import main

args = sys.argv[1:]
port, prefill, decode = (args[args.index(flag) + 1] for flag in ("--port", "--prefiller-port", "--decoder-port"))
sys.exit(main(["--port", port, "--prefill", f"http://127.0.0.1:{prefill}", "--decode", f"http://127.0.0.1:{decode}"]))
"""
PROXY_TEMPLATE = "{python} toy_proxy.py --port {port} --prefiller-port {prefill_ports} --decoder-port {decode_ports}"
CHDIR_THEN_PROXY = """
from pytest_pdserve.spec import ClusterSpec


def test_after_chdir(pd_cluster_factory, monkeypatch):
    monkeypatch.chdir("sub")  # an autouse fixture of many suites does this
    assert pd_cluster_factory(ClusterSpec(name="late")).complete("hello", max_tokens=2)["choices"]
"""


@pytest.mark.parametrize("door", ["argv", "ini"])
def test_a_relative_proxy_script_still_runs_after_a_test_changed_directory(
    pytester: pytest.Pytester, door: str
) -> None:
    """README: `--pd-proxy-command="{python} toy_proxy_server.py --port {port} ..."`, checked at start-up. The proxy
    (and the servers) started in whatever directory a test had `chdir`'ed to, so the script was not found there
    ("can't open file .../sub/toy_proxy.py") and every cluster started after it failed."""
    (pytester.path / "sub").mkdir()
    pytester.makepyfile(toy_proxy=TOY_PROXY, test_late=CHDIR_THEN_PROXY)
    if door == "ini":
        pytester.makeini(f"[pytest]\npdserve_proxy_command = {PROXY_TEMPLATE}\n")
        result = _run(pytester, "test_late.py")
    else:
        result = _run(pytester, f"--pd-proxy-command={PROXY_TEMPLATE}", "test_late.py")
    result.assert_outcomes(passed=1)


# ------------------------------------------------- a usage error that only an xdist worker can see


def test_a_bad_marker_argument_is_a_usage_error_naming_the_test_under_xdist(pytester: pytest.Pytester) -> None:
    """README: "a bad argument (`gpus("two")`, ...) is a usage error at collection naming the test". Under xdist only
    the workers collect: the error was a worker crash, shown as an INTERNALERROR from xdist's own code (exit 3)
    without pdserve's message."""
    pytest.importorskip("xdist")
    pytester.makepyfile(test_m='import pytest\n\n@pytest.mark.gpus("two")\ndef test_x():\n    pass\n')
    result = _run(pytester, "-n", "2")
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out
    result.stdout.fnmatch_lines([
        "[[]gw?, gw?[]] pdserve: bad marker arguments:",
        "  test_m.py::test_x: @pytest.mark.gpus('two'): the GPU count must be a whole number >= 1, got 'two'*",
    ])  # fmt: skip
    assert "INTERNALERROR" not in out, out
