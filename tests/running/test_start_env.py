"""What is checked and fingerprinted is what the servers get (issue 43, class 2; running/start_env.py).

pytest's environment changes after the plugin configured: a ``conftest.py`` in a sub-directory is imported during
collection, a fixture sets a variable before it asks for a cluster, a test calls ``monkeypatch.setenv``, a plugin
registered after ours sets one in its ``pytest_configure``. Each is a door here, against each rule: the keep-alive
refusal (VLLM_HTTP_TIMEOUT_KEEP_ALIVE=1 reached the servers past the configure-time check), a setting's variable
(resolved at configure: refused, named, when it would now resolve differently), and a kept cluster's fingerprint
under ``--pd-reuse`` (taken from the configure-time copy while the servers got the later one, so the next run reused
a cluster with another environment). Inner sessions run the simulator, as users do.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _hostile import hostile_server
from _pdsession import Inner
from _reuse import UP, inner, reuse_dir, run_reuse, states, stop_all

__all__ = ["inner", "reuse_dir"]  # fixtures, imported from _reuse

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

#: Each door sets the variables (``{sets}``: one ``os.environ[name] = value`` line each, at the door's indentation)
#: after the plugin configured; the inner test then needs a cluster.
DOORS = {
    "subdir-conftest": {
        "sub/conftest.py": "import os\n{sets}\n",
        "sub/test_it.py": "def test_it(pd_cluster):\n    pass\n",
    },
    "fixture": {
        "test_it.py": """
import os
import pytest

@pytest.fixture
def late(request):
    {sets}
    return request.getfixturevalue("pd_cluster")

def test_it(late):
    pass
""",
    },
    "monkeypatch": {
        "test_it.py": """
import os

def test_it(monkeypatch, pd_cluster_factory):
    {sets}
    pd_cluster_factory()
""",
    },
    "later-plugin-configure": {
        "conftest.py": "import os\n\ndef pytest_configure(config):\n    {sets}\n",
        "test_it.py": "def test_it(pd_cluster):\n    pass\n",
    },
}


def _plant(inner: Inner, door: str, variables: dict[str, str]) -> None:
    for rel, text in DOORS[door].items():
        path = inner.pytester.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        indent = text[: text.find("{sets}")].rsplit("\n", 1)[-1] if "{sets}" in text else ""
        setter = "monkeypatch.setenv({!r}, {!r})" if door == "monkeypatch" else "os.environ[{!r}] = {!r}"
        sets = f"\n{indent}".join(setter.format(name, value) for name, value in variables.items())
        source = text.format(sets=sets)
        if rel == "conftest.py":  # beside the inner sessions' own helper conftest
            source = path.read_text() + "\n" + source
        path.write_text(source)


@pytest.mark.parametrize("door", DOORS)
def test_a_late_keepalive_and_a_late_setting_are_refused_before_any_server_starts(inner: Inner, door: str) -> None:
    """Both rules through each door, in one session: VLLM_HTTP_TIMEOUT_KEEP_ALIVE=1 (the servers would inherit it)
    and PDSERVE_SEED (a setting resolved at configure, which the header, the servers' flags and a fingerprint use,
    whose variable now says otherwise), each named with its value, rather than silently used by some and not
    others."""
    _plant(inner, door, {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "1", "PDSERVE_SEED": "7"})
    result = inner.run("-p", "no:randomly")
    result.assert_outcomes(**({"failed": 1} if door == "monkeypatch" else {"errors": 1}))
    result.stdout.fnmatch_lines(
        ["*EnvironmentRefused: pdserve: a cluster cannot start: the environment changed after pytest configured: "
         "PDSERVE_SEED='7' now, unset when pytest configured (setting seed; also --pd-seed / ini pdserve_seed)*"
         "; and VLLM_HTTP_TIMEOUT_KEEP_ALIVE='1' is below 2 s*(in the environment the servers would inherit, as it "
         "is now)*"]
    )  # fmt: skip
    assert not list(inner.log_dir.rglob("*-prefill-0.log")), "a server was started"
    inner.assert_nothing_left()


@pytest.mark.parametrize("via", ["argv", "PYTEST_ADDOPTS", "ini"])
def test_precedence_decides_what_is_held(inner: Inner, monkeypatch: pytest.MonkeyPatch, via: str) -> None:
    """The command line (argv or PYTEST_ADDOPTS) beats the variable at configure and now: its late change changes
    nothing. An ini key loses to the variable: the late value would win, so it is refused like an unset one."""
    _plant(inner, "subdir-conftest", {"PDSERVE_SEED": "7"})
    args: list[str] = []
    if via == "argv":
        args = ["--pd-seed=3"]
    elif via == "PYTEST_ADDOPTS":
        monkeypatch.setenv("PYTEST_ADDOPTS", f"{os.environ.get('PYTEST_ADDOPTS', '')} --pd-seed=3")
    else:
        (inner.pytester.path / "pytest.ini").write_text("[pytest]\npdserve_seed = 3\n")
    result = inner.run(*args)
    if via == "ini":
        result.assert_outcomes(errors=1)
        result.stdout.fnmatch_lines(["*PDSERVE_SEED='7' now, unset when pytest configured (setting seed;*"])
    else:
        result.assert_outcomes(passed=1)


def test_a_variable_put_back_before_the_start_is_no_change(inner: Inner) -> None:
    """The refusal is not remembered: once a monkeypatch is undone, the next test starts the cluster."""
    inner.pytester.makepyfile(
        """
        import pytest
        from pytest_pdserve.errors import EnvironmentRefused

        def test_changed(monkeypatch, pd_cluster_factory):
            monkeypatch.setenv("ATTENTION_BACKEND", "TRITON_ATTN")
            with pytest.raises(EnvironmentRefused, match="ATTENTION_BACKEND='TRITON_ATTN' now, unset when"):
                pd_cluster_factory()

        def test_back(pd_cluster):
            assert pd_cluster.complete("hi", max_tokens=1)["choices"]
        """
    )
    inner.run().assert_outcomes(passed=2)


def test_the_servers_get_the_environment_of_their_start(inner: Inner) -> None:
    """A variable the settings do not read is honoured as it is when the start is decided: the servers get it."""
    inner.pytester.makepyfile(
        test_it="""
import os
import pytest
from pathlib import Path

@pytest.fixture
def late(request):
    os.environ["VLLM_PDSERVE_LATE_MARK"] = "set-by-a-fixture"
    return request.getfixturevalue("pd_cluster")

def test_it(late):
    for s in late.servers:
        environ = Path(f"/proc/{s.process.pid}/environ").read_bytes().split(b"\\0")
        assert b"VLLM_PDSERVE_LATE_MARK=set-by-a-fixture" in environ, s.name
"""
    )
    inner.run().assert_outcomes(passed=1)


def test_attach_mode_holds_its_settings_too(inner: Inner) -> None:
    """Attach mode starts no server (no keep-alive rule) but resolves its settings at configure all the same."""
    _plant(inner, "subdir-conftest", {"PDSERVE_MODEL": "another-model"})
    with hostile_server({}) as deployment:
        result = inner.run(f"--pd-prefill-url={deployment.url}", f"--pd-decode-url={deployment.url}")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*PDSERVE_MODEL='another-model' now, unset when pytest configured*"])
    assert deployment.requests["/health"] == 0, "the attach check ran with a configuration it was not given"


# ------------------------------------------------------------------------------------------------ --pd-reuse


def _late_var(inner: Inner, value: str | None) -> None:
    """A sub-directory conftest that sets VLLM_PDSERVE_LATE (or none), beside the reuse runs' test. pytest imports it
    while collecting, after configure (named on the command line, ``sub`` would make it an initial conftest)."""
    sub = inner.pytester.path / "sub"
    sub.mkdir(exist_ok=True)
    (sub / "test_up.py").write_text(UP)
    conftest = sub / "conftest.py"
    conftest.write_text("" if value is None else f"import os\nos.environ['VLLM_PDSERVE_LATE'] = {value!r}\n")


def test_a_kept_cluster_is_fingerprinted_with_what_its_servers_got(inner: Inner, reuse_dir: Path) -> None:
    """The held-out worst case: the servers got a variable set after configure, the fingerprint did not, and the
    next run (without it) reused them."""
    _late_var(inner, "1")
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    [kept] = states(reuse_dir)
    _late_var(inner, None)
    result = run_reuse(inner, reuse_dir)
    result.assert_outcomes(passed=1)
    fresh = f"*starting a fresh cluster: kept cluster {kept['id']} differs in env.VLLM_PDSERVE_LATE"
    result.stdout.fnmatch_lines([fresh])
    _late_var(inner, "1")  # set the same late way again: the cluster kept with it is the one reused
    run_reuse(inner, reuse_dir).stdout.fnmatch_lines([f"*reused kept cluster {kept['id']}*"])
    stop_all(reuse_dir, inner)
