"""``--pd-reuse`` attacked as careless CI authors and hostile local users would: real inner pytest sessions
against real simulator processes (the helpers are tests/reuse/test_reuse.py's and tests/_pdsession.py's).

Each case names the promise of README's "Keep a cluster between runs" or docs/reuse.md it attacks: a reuse dir
that is a user's directory, a stopped (SIGSTOP) keeper, `pdserve stop --all` checked at once, pytest SIGKILLed
during the hand-over, the TTL of a later run, secrets, a test path after an optional-value flag, bad settings,
junk and FIFOs in the reuse dir, absurd or planted state files naming bystanders, env changes, a kept server
killed or frozen, two runs at once, `pdserve` on bad dirs, and pruning the logs of a run still going.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import _reuse
import pytest
from _children import die_with_parent
from _pdsession import GONE_WITHIN_S, INNER_CONFTEST, Inner, live_procs, unheld_locks, wait_for
from _reuse import UP, claimed_run, kept_one, run_reuse, states

from pytest_pdserve import cli
from pytest_pdserve.common import created
from pytest_pdserve.common.logfile import write_replace
from pytest_pdserve.reuse import client, dirs, handover
from pytest_pdserve.running.proctree import alive_as, read_stat

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

# The shared fixtures (tests/_reuse.py): one copy, bound here so pytest finds them.
inner = _reuse.inner
reuse_dir = _reuse.reuse_dir


def _pdserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_pdserve.cli", *args], capture_output=True, text=True, timeout=60,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


# ------------------------------------------------------------------------------ a reuse dir that is not one


def _project_like(path: Path) -> list[Path]:
    """A directory that holds a user's files, as ~ or a project root does: JSON that is no state, old logs."""
    path.mkdir(mode=0o700)
    (path / "package.json").write_text(json.dumps({"name": "mine"}))
    (path / "notes.json").write_text("[1, 2, 3]")
    old_logs = []
    for i in range(8):
        run = path / "logs" / f"2020010{i}-build"
        run.mkdir(parents=True)
        (run / "build.log").write_text("keep me")
        os.utime(run, (0, 0))
        old_logs.append(run)
    return [path / "package.json", path / "notes.json", *old_logs]


def test_a_reuse_dir_with_a_users_files_loses_none_of_them(inner: Inner, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--pd-reuse-dir=.` or `PDSERVE_REUSE_DIR=$HOME`: pdserve removes stale state files and old run logs in its
    reuse dir, so a directory holding a user's files is refused, never cleaned (it removed package.json and old
    logs/ directories). The error names the path, what is in it and where the setting came from."""
    home = inner.pytester.path / "home"
    mine = _project_like(home)
    inner.pytester.makepyfile(UP)
    monkeypatch.setenv("PDSERVE_REUSE_DIR", str(home))
    result = inner.run("--pd-reuse")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    result.stderr.fnmatch_lines(
        [f"*--pd-reuse: reuse directory {home} holds files pdserve did not put there (logs, notes.json, package.json,"
         " ...)*a directory of its own*(reuse_dir from environment variable PDSERVE_REUSE_DIR; set --pd-reuse-dir*"]
    )  # fmt: skip
    for args in (["ls"], ["ls", "--json"], ["stop", "--all"], ["stop", "pd-1-abcdef"]):
        out = _pdserve(*args)  # $PDSERVE_REUSE_DIR, as the plugin read it
        assert out.returncode == 2, (args, out)
        assert f"pdserve: reuse directory {home} holds files pdserve did not put there" in out.stderr, out
    assert [p for p in mine if not p.exists()] == []
    assert not (home / created.MARKER).exists()


def test_an_empty_reuse_dir_is_used_and_marked(inner: Inner, reuse_dir: Path) -> None:
    reuse_dir.mkdir(mode=0o700)
    inner.pytester.makepyfile(UP)
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    assert created.manifest(reuse_dir, created.REUSE) is not None  # marked as pdserve's, bound to this directory
    run_reuse(inner, reuse_dir).stdout.fnmatch_lines(["*reused kept cluster*"])  # marked: full of its own files, fine
    assert _pdserve("--dir", str(reuse_dir), "stop", "--all").returncode == 0
    inner.gone_within()


# ---------------------------------------------------------------------------------------- a stopped keeper


def test_a_stopped_keeper_is_named_and_waited_for_by_nobody(inner: Inner, reuse_dir: Path) -> None:
    """SIGSTOP the keeper (Ctrl-Z on a debugger, a frozen cgroup): the next run must not wait 20 s on its claim
    and then blame "another run", and `pdserve stop --all` must not wait a minute per cluster: both say the
    keeper is stopped and how to go on."""
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    pid = state["keeper"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        # The run names the stopped keeper instead of waiting on its claim and blaming "another run" (the message
        # is the proof: the waiting path ends with the other one; a bound on the run's time was its start's too).
        second = run_reuse(inner, reuse_dir)
        second.assert_outcomes(passed=1)
        why = f"kept cluster {state['id']}: its keeper (pid {pid}) is stopped"
        second.stdout.fnmatch_lines([f"*pd: starting a fresh cluster: {why} (SIGSTOP*kill -CONT {pid}*"])
        assert "another run" not in second.stdout.str()
        t0 = time.monotonic()
        out = _pdserve("--dir", str(reuse_dir), "stop", "--all")
        took = time.monotonic() - t0
        assert out.returncode == 1, out
        assert f"{state['id']}: its keeper (pid {pid}) is stopped" in out.stderr, out
        # timing: one CLI process and no start; waiting on the keeper costs a minute per cluster
        assert took < 45, f"{took:.1f}s: `pdserve stop --all` waited on the stopped keeper"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _pdserve("--dir", str(reuse_dir), "stop", "--all").returncode == 0
    inner.gone_within()


# ------------------------------------------------------------------------------------ pdserve stop --all


def test_stop_all_returns_only_when_nothing_is_left(inner: Inner, reuse_dir: Path) -> None:
    """The issue's "done when": `pdserve stop --all` leaves no process and no lease. A script that checks right
    after it returns (`pdserve stop --all && pgrep ...`) must find nothing: not the keeper, not its guard."""
    inner.pytester.makepyfile(UP)
    kept_one(inner, reuse_dir)
    assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0  # in-process: no interpreter exit to wait for
    left = live_procs(inner.mark)  # no wait: at once
    assert left == {}, left
    unheld_locks(inner.lease_dir)
    assert states(reuse_dir) == []


# ------------------------------------------------------------------------------ death during the hand-over

#: An inner conftest addition that SIGKILLs pytest at one moment of the hand-over to the keeper.
KILL_AT = """
import os, signal
from pytest_pdserve.reuse import handover as reuse

_keep, _read_line = reuse.keep, reuse._read_line_within
WHEN = os.environ["KILL_AT"]

def _keep_then_die(*args, **kwargs):
    pid = _keep(*args, **kwargs)
    if WHEN == "after-ready":  # the keeper owns the clusters; pytest has not disowned them yet
        os.kill(os.getpid(), signal.SIGKILL)
    return pid

def _die_before_ready(stream, timeout):
    if WHEN == "before-ready":  # the keeper is starting (or writing its state files)
        os.kill(os.getpid(), signal.SIGKILL)
    return _read_line(stream, timeout)

reuse.keep = _keep_then_die
reuse._read_line_within = _die_before_ready
"""


@pytest.mark.parametrize("when", ["before-ready", "after-ready"])
def test_pytest_killed_during_the_hand_over_leaves_no_orphan(
    inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """SIGKILL at the worst moment of the hand-over: whatever survives is owned (a keeper, a state file the next
    run and `pdserve stop --all` see), never servers nobody stops; every lease frees once it is stopped."""
    inner.pytester.makeconftest(INNER_CONFTEST + KILL_AT)
    inner.pytester.makepyfile(UP)
    monkeypatch.setenv("KILL_AT", when)
    result = run_reuse(inner, reuse_dir)
    assert result.ret == -signal.SIGKILL, result.stdout.str()[-2000:]

    def settled() -> bool:  # every process left is a kept cluster's (its keeper runs), or nothing is left
        kept = client.list_kept(reuse_dir)
        procs = set(live_procs(inner.mark))
        owned = {s.pid for k in kept for s in k.servers} | {k.keeper_pid for k in kept}
        return procs <= owned | _guards(procs)

    wait_for(settled, GONE_WITHIN_S, f"only owned processes left ({live_procs(inner.mark)})")
    monkeypatch.delenv("KILL_AT")
    inner.pytester.makeconftest(INNER_CONFTEST)
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)  # the next run copes either way
    assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    inner.gone_within()
    unheld_locks(inner.lease_dir)
    assert states(reuse_dir) == []


def _guards(pids: set[int]) -> set[int]:
    """The pids among ``pids`` that are a guard (`pytest_pdserve.running.supervise`: sweeps a dead owner's run
    token)."""
    found = set()
    for pid in pids:
        try:
            cmdline = Path(
                f"/proc/{pid}/cmdline"
            ).read_bytes()  # python -I -S -c '... pytest_pdserve.running.supervise ...'
        except OSError:
            continue
        if b"pytest_pdserve.running.supervise" in cmdline or b"pytest_pdserve.running.watchdog" in cmdline:
            found.add(pid)
    return found


# ------------------------------------------------------------------------------------------------ the TTL


def test_the_ttl_of_the_last_run_applies(inner: Inner, reuse_dir: Path) -> None:
    """README: a keeper stops a cluster after `--pd-reuse-ttl` seconds unclaimed. A run that reuses a cluster with
    a shorter TTL (its header says `idle ttl 1s`) must have it stopped that long after it ends, not after the TTL
    of the run that first kept it (15 minutes)."""
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    second = run_reuse(inner, reuse_dir, "--pd-reuse-ttl=1")
    second.stdout.fnmatch_lines(["*reuse on (idle ttl 1s*", f"*reused kept cluster {state['id']}*"])
    inner.gone_within()
    assert states(reuse_dir) == []
    unheld_locks(inner.lease_dir)
    assert "idle for 1s" in (reuse_dir / "keeper.log").read_text()


# ------------------------------------------------------------------------------------------------ secrets


def test_no_secret_reaches_the_keepers_log_pdserve_ls_or_the_report(
    inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/reuse.md: state files hold no secret; nor may anything else a kept cluster leaves readable: keeper.log,
    guard.log, `pdserve ls [--json]`, and the keeping and reusing runs' output (an API key, a spec env's HF_TOKEN
    and OPENAI_API_KEY)."""
    secrets = ["sk-reuse-hostile-0123456", "hf_hostile_token_98765", "sk-openai-hostile-5555"]
    monkeypatch.setenv("PDSERVE_API_KEY", secrets[0])
    inner.pytester.makepyfile(
        f"""
        def test_up(pd_cluster_factory):
            c = pd_cluster_factory(env={{"HF_TOKEN": {secrets[1]!r}, "OPENAI_API_KEY": {secrets[2]!r}}})
            assert c.complete("a " * 8, max_tokens=1)["choices"]
        """
    )
    outputs = [run_reuse(inner, reuse_dir), run_reuse(inner, reuse_dir)]
    outputs[0].assert_outcomes(passed=1)
    outputs[1].stdout.fnmatch_lines(["*reused kept cluster*"])
    texts = {
        str(p): p.read_text(errors="replace") for p in reuse_dir.rglob("*") if p.is_file() and "logs" not in p.parts
    }
    texts["ls"] = _pdserve("--dir", str(reuse_dir), "ls").stdout
    texts["ls --json"] = _pdserve("--dir", str(reuse_dir), "ls", "--json").stdout
    for i, r in enumerate(outputs):
        texts[f"run {i}"] = r.stdout.str() + r.stderr.str()
    assert any(p.endswith(".json") for p in texts), texts.keys()
    leaks = {(name, s) for name, text in texts.items() for s in secrets if s in text}
    assert leaks == set(), leaks


def test_a_secret_on_the_servers_argv_stays_out_of_the_state_file() -> None:
    """vLLM's `--hf-token TOKEN` (EngineArgs.hf_token) may reach the servers' argv through extra args; the state
    file records the argv (kv role, served model name), never that value (nor an `--api-key=` one)."""
    from types import SimpleNamespace

    from pytest_pdserve.config.commands import ServerCommand, ServerPorts

    argv = ("vllm", "serve", "m", "--hf-token", "hf_argv_secret_4444", "--api-key=sk-argv-secret-5555", "--seed", "0")
    command = ServerCommand("prefill", 0, argv, {"HF_TOKEN": "hf_env_secret_6666", "VLLM_API_KEY": "sk-env-7777"})
    proc = SimpleNamespace(
        name="prefill-0", pid=os.getpid(), pgid=os.getpgid(0), server_token="t", log_path="x", rpc_dir=None
    )
    handle = SimpleNamespace(
        role="prefill", index=0, url="http://127.0.0.1:1", gpus=(), ports=ServerPorts(1, 2, 3), command=command,
        ready_seconds=1.0,
    )  # fmt: skip
    state = json.dumps(handover._server_state(proc, handle).as_dict())  # type: ignore[arg-type]
    for secret in ("hf_argv_secret_4444", "sk-argv-secret-5555", "hf_env_secret_6666", "sk-env-7777"):
        assert secret not in state, state
    assert '"--seed", "0"' in state  # the rest of the argv is kept as it was


# ------------------------------------------------------------------------------------------- bad settings


#: Every door a flag comes in by: (name, how the flag is given). ``{flag}`` is the flag; env and ini key are its
#: setting's (a flag is a boolean there).
DOORS = ["argv", "PYTEST_ADDOPTS", "ini addopts", "env", "ini key"]
FLAGS = {"--pd-reuse": "reuse", "--pd-export-env": "export_env"}


def _through(
    inner: Inner, monkeypatch: pytest.MonkeyPatch, door: str, words: list[str], setting: str, value: str
) -> list[str]:
    """Give *words* (a flag, or its old spelling) through *door*; returns the argv words left for the command line."""
    from pytest_pdserve.config.settings import SETTINGS_BY_NAME

    s = SETTINGS_BY_NAME[setting]
    if door == "PYTEST_ADDOPTS":
        monkeypatch.setenv("PYTEST_ADDOPTS", " ".join(words))
    elif door == "ini addopts":
        inner.pytester.makeini(f"[pytest]\naddopts = {' '.join(words)}\n")
    elif door == "env":
        monkeypatch.setenv(s.env_var, value)
    elif door == "ini key":
        inner.pytester.makeini(f"[pytest]\n{s.ini_key} = {value}\n")
    else:
        return words
    return []


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("flag", list(FLAGS))
def test_a_flag_never_takes_the_next_word_through_any_door(
    inner: Inner, monkeypatch: pytest.MonkeyPatch, flag: str, door: str
) -> None:
    """`pytest --pd-reuse test_x.py`, as everyone types it, and `PYTEST_ADDOPTS="--pd-export-env" pytest
    test_x.py`: both flags are plain flags (issue 25: `--pd-export-env` took an optional value and OVERWROTE
    test_x.py with export lines when it came from PYTEST_ADDOPTS or the ini's addopts). Through every door the
    flag is on, test_x.py is the test run, and test_x.py is byte-identical afterwards."""
    check = "assert os.environ.get('PREFILL_PORT')" if flag == "--pd-export-env" else "pass"
    test_file = inner.pytester.makepyfile(test_x=f"import os\ndef test_x():\n    {check}\n")
    before = test_file.read_bytes()
    words = _through(inner, monkeypatch, door, [flag], FLAGS[flag], "1")
    # The path right after the flag, as typed: pytest puts PYTEST_ADDOPTS and addopts before the command line
    # (pytester.run, not runpytest_subprocess: that puts its own --basetemp first).
    args = [*words, "test_x.py", *inner.args(f"--pd-reuse-dir={inner.pytester.path / 'reuse'}")]
    result = inner.pytester.run(sys.executable, "-m", "pytest", *args, timeout=120)
    result.assert_outcomes(passed=1)
    assert test_file.read_bytes() == before
    if flag == "--pd-reuse":
        result.stdout.fnmatch_lines(["pdserve: reuse on (idle ttl*"])
    else:
        result.stdout.fnmatch_lines(["pdserve: exported: PREFILL_HOST=127.0.0.1 *"])
    inner.gone_within()


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(("flag", "value"), [("--pd-export-env", "test_x.py"), ("--pd-reuse", "force")])
def test_a_flag_given_a_value_is_a_usage_error(
    inner: Inner, monkeypatch: pytest.MonkeyPatch, door: str, flag: str, value: str
) -> None:
    """`--pd-export-env=FILE` and `--pd-reuse=MODE` (and such a value in the env or ini) are usage errors: the file
    and the mode have options of their own; nothing starts and nothing is written."""
    test_file = inner.pytester.makepyfile(test_x="def test_x():\n    pass\n")
    before = test_file.read_bytes()
    words = _through(inner, monkeypatch, door, [f"{flag}={value}"], FLAGS[flag], value)
    result = inner.run(*words, "test_x.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    err = result.stderr.str()
    if door in ("env", "ini key"):
        assert f"{value!r} from " in err, err
        assert f"is not a valid {FLAGS[flag]}" in err, err
    else:  # argparse's own words
        assert f"argument {flag}/--no-{flag[2:]}: ignored explicit argument {value!r}" in err, err
    assert "Traceback" not in err
    assert test_file.read_bytes() == before
    assert not live_procs(inner.mark)


def test_a_mode_or_file_turns_its_flag_on_and_an_explicit_off_disagrees(
    inner: Inner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--pd-reuse-mode=force` alone means reuse (as `--pd-reuse=force` did); with `--no-pd-reuse` the two say
    different things: a usage error naming both sources, not one silently winning."""
    inner.pytester.makepyfile(test_x="def test_x():\n    pass\n")
    monkeypatch.setenv("CI", "true")
    forced = inner.run("--pd-reuse-mode=force", f"--pd-reuse-dir={inner.pytester.path / 'reuse'}")
    forced.assert_outcomes(passed=1)
    forced.stdout.fnmatch_lines(["pdserve: reuse force (CI=true is set)*"])
    both = inner.run("--no-pd-reuse", "--pd-reuse-mode=force")
    assert both.ret == pytest.ExitCode.USAGE_ERROR
    both.stderr.fnmatch_lines(
        ["*reuse is off (from --pd-reuse) but reuse_mode is given (from --pd-reuse-mode), which needs it on*"]
    )
    file_off = inner.run("--no-pd-export-env", "--pd-export-env-file=env.sh")
    assert file_off.ret == pytest.ExitCode.USAGE_ERROR
    assert not (inner.pytester.path / "env.sh").exists()


def test_an_export_file_pdserve_did_not_write_is_never_overwritten(inner: Inner) -> None:
    """`--pd-export-env-file test_x.py` (the user named the file option, then a test path): test_x.py is not a
    file pdserve wrote, so the run stops before anything starts; a file it wrote is rewritten."""
    test_file = inner.pytester.makepyfile(test_x="def test_x():\n    pass\n")
    before = test_file.read_bytes()
    refused = inner.run("--pd-export-env-file", "test_x.py")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*export_env_file *test_x.py (from --pd-export-env-file) exists and was not "
                                  "written by pdserve*"])  # fmt: skip
    assert test_file.read_bytes() == before
    for _ in range(2):  # the second run overwrites the first run's file
        inner.run("--pd-export-env-file=env.sh", "test_x.py").assert_outcomes(passed=1)
    assert (inner.pytester.path / "env.sh").read_text().startswith("# written by pytest-pdserve")
    inner.gone_within()


@pytest.mark.parametrize(
    ("where", "value", "why"),
    [
        ("--pd-reuse-mode", "maybe", "accepted values: local, force"),
        (
            "PDSERVE_REUSE",
            "yes please",
            "accepted values: 1/0, true/false, yes/no, on/off",
        ),
        ("pdserve_reuse_mode", "on", "accepted values: local, force"),
        ("--pd-reuse-ttl", "0", "expected a number of seconds > 0 and <= 86400"),
        ("--pd-reuse-ttl", "-1", "expected a number of seconds > 0"),
        ("PDSERVE_REUSE_TTL", "nan", "expected a number of seconds > 0"),
        ("PDSERVE_REUSE_TTL", "inf", "expected a number of seconds > 0"),
        ("--pd-reuse-ttl", "1e309", "expected a number of seconds > 0"),
        ("pdserve_reuse_ttl", "abc", "expected a number of seconds > 0"),
        ("--pd-reuse-dir", "{tmp}/a-file", "is a regular file, not a directory"),
        ("--pd-reuse-dir", "{tmp}/dangling", "is a dangling symbolic link"),
        ("--pd-reuse-dir", "/dev/null", "/dev/null is a device, FIFO or socket, not a directory"),
        ("--pd-reuse-dir", "/proc", "/proc is not writable"),
        ("PDSERVE_REUSE_DIR", "{tmp}/line\nbreak", "control character"),
        ("--pd-reuse-dir", "{tmp}/" + "x" * 300, "File name too long"),
    ],
)
def test_bad_reuse_settings_are_usage_errors_naming_their_source(
    inner: Inner, monkeypatch: pytest.MonkeyPatch, where: str, value: str, why: str
) -> None:
    tmp = inner.pytester.path
    (tmp / "a-file").write_text("")
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    value = value.replace("{tmp}", str(tmp))
    inner.pytester.makepyfile(UP)
    args = {"--pd-reuse": "--pd-reuse", "--pd-reuse-dir": f"--pd-reuse-dir={tmp / 'reuse'}"}
    if where.startswith("--"):
        args[where] = f"{where}={value}"
        source = where
    elif where.startswith("PDSERVE_"):
        monkeypatch.setenv(where, value)
        args.pop(f"--pd-{where[8:].lower().replace('_', '-')}", None)  # the flag would win over the env var
        source = f"environment variable {where}"
    else:
        inner.pytester.makeini(f"[pytest]\n{where} = {value}\n")
        source = f"ini key {where}"
    result = inner.run(*args.values())
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    err = result.stderr.str()
    assert f"from {source} is not a valid" in err, err
    assert why in err, err


# ------------------------------------------------------------------------------------- junk in the reuse dir


def test_junk_in_the_reuse_dir_neither_hides_a_kept_cluster_nor_floods_the_header(
    inner: Inner, reuse_dir: Path
) -> None:
    """A FIFO named *.json (opening it must not block), a directory named *.json, a 2 MiB file, a JSON array,
    and a thousand garbage state files sorted before the real one: the next run still finds and reuses the kept
    cluster, stays quick, and says what it left alone in a few lines, not a thousand; none of them is removed
    (pdserve did not create them: common/created.py)."""
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    os.mkfifo(reuse_dir / "a-fifo.json")
    (reuse_dir / "a-dir.json").mkdir()
    (reuse_dir / "a-huge.json").write_bytes(b" " * (2 << 20))
    (reuse_dir / "a-array.json").write_text("[]")
    for i in range(1000):
        (reuse_dir / f"a{i:04d}.json").write_text('{"keeper": 1')
    second = run_reuse(inner, reuse_dir)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines([f"*reused kept cluster {state['id']}*"])
    out = second.stdout.str()
    assert out.count("pdserve: reuse: left") <= 10, out[:3000]
    assert "a-fifo.json" in out, out[:3000]
    assert "pdserve: reuse: removed" not in out, out[:3000]
    assert all((reuse_dir / name).exists() for name in ("a-fifo.json", "a-dir.json", "a-huge.json", "a0999.json"))


# ----------------------------------------------------------------------------- what changes the fingerprint


def test_env_the_servers_read_starts_fresh_and_pytests_own_does_not(
    inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A changed VLLM_* variable starts a fresh cluster and names the variable (not its value); what only pytest
    reads (COLUMNS, -q, -k, another --pd-log-dir) does not."""
    inner.pytester.makepyfile(UP)
    monkeypatch.setenv("VLLM_HOSTILE_KNOB", "hf_value_one_1111")
    kept = kept_one(inner, reuse_dir)
    monkeypatch.setenv("VLLM_HOSTILE_KNOB", "hf_value_two_2222")
    fresh = run_reuse(inner, reuse_dir)
    fresh.stdout.fnmatch_lines(
        [f"*pd: starting a fresh cluster: kept cluster {kept['id']} differs in env.VLLM_HOSTILE_KNOB"]
    )
    assert "hf_value_" not in fresh.stdout.str()
    monkeypatch.setenv("COLUMNS", "57")
    same = run_reuse(inner, reuse_dir, "-q", "-k", "test_up", f"--pd-log-dir={inner.pytester.path / 'other-logs'}")
    same.assert_outcomes(passed=1)
    same.stdout.fnmatch_lines(["*reused kept cluster*"])
    assert _pdserve("--dir", str(reuse_dir), "stop", "--all").returncode == 0


def test_stop_all_while_a_run_uses_the_cluster_leaves_nothing_and_fails_that_run_clearly(
    inner: Inner, reuse_dir: Path
) -> None:
    """`pdserve stop --all` is obeyed even while a run has the cluster claimed: nothing is left (no process, no
    lease, no state), and the run using it fails saying its servers stopped, not with a hang or a traceback."""
    with claimed_run(inner, reuse_dir) as (state, proc, go):
        out = _pdserve("--dir", str(reuse_dir), "stop", "--all")
        assert out.returncode == 0, out
        assert out.stdout.strip() == f"stopped {state['id']}", out
        kept_pids = [(s["pid"], s["starttime"]) for s in [*state["servers"], state["proxy"]]]
        assert not any(alive_as(*p) for p in kept_pids)
        assert not alive_as(state["keeper"]["pid"], state["keeper"]["starttime"])
        unheld_locks(inner.lease_dir)
        go.touch()
        assert proc.wait(60) == 1
    text = inner.output()
    assert re.search(r"cluster 'pd': (prefill|decode)-0 stopped answering", text), text[-3000:]
    assert "Traceback" not in text.split("short test summary")[-1], text[-3000:]
    inner.gone_within()
    unheld_locks(inner.lease_dir)
    assert states(reuse_dir) == []


# ----------------------------------------------------------------------------------------- a kept server


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_kept_server_dead_or_hung_right_before_the_next_run_is_not_handed_out(
    inner: Inner, reuse_dir: Path, how: str
) -> None:
    """Kill a kept prefill right before the next run, or freeze it (alive, pid and start time right, but it
    answers nothing): the run must not hand it out, must say why, and must not wait long; the frozen one is
    stopped too (SIGKILL reaches a stopped process)."""
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    prefill = state["servers"][0]
    os.kill(prefill["pid"], getattr(signal, how))
    second = run_reuse(inner, reuse_dir, timeout=60)
    second.assert_outcomes(passed=1)
    if how == "SIGSTOP":  # (a dead one is seen by the run or, often first, by the keeper: either is right)
        second.stdout.fnmatch_lines([f"*kept cluster {state['id']} failed its check (prefill-0 at * does not answer*"])
    assert [i["reused"] for i in inner.infos()] == [None, None]
    wait_for(lambda: not alive_as(prefill["pid"], prefill["starttime"]), GONE_WITHIN_S, "the kept prefill stopped")
    assert state["id"] not in [s["id"] for s in states(reuse_dir)]


@pytest.mark.parametrize("name", ["keeper.log", "guard.log"])
def test_a_fifo_where_a_log_goes_neither_hangs_nor_leaves_a_keeper(inner: Inner, reuse_dir: Path, name: str) -> None:
    """A FIFO (or any non-file) where the keeper's log or its guard's log goes: opening it for writing blocks
    until someone reads it. pytest's hand-over must not hang, and no keeper may be left blocked holding the
    leases: the run ends, the clusters are stopped (or kept with a working keeper), and nothing is left."""
    dirs.ensure_reuse_dir(reuse_dir)
    os.mkfifo(reuse_dir / name)
    inner.pytester.makepyfile(UP)
    result = run_reuse(inner, reuse_dir, timeout=60)
    result.assert_outcomes(passed=1)
    if name == "keeper.log":  # nowhere to log what the keeper does: not kept, and said why
        result.stdout.fnmatch_lines([f"*reuse: the reuse keeper did not start: its log {reuse_dir / name}: not a "
                                     "regular file (a FIFO*; stopping the clusters instead*"])  # fmt: skip
    kept = client.list_kept(reuse_dir)
    if kept:  # kept after all: its keeper works
        assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    inner.gone_within()
    unheld_locks(inner.lease_dir)


def test_a_state_naming_live_bystanders_with_absurd_numbers_is_parsed_defensively(
    inner: Inner, reuse_dir: Path
) -> None:
    """A state file whose keeper and servers are live processes of ours that pdserve never started (a `sleep`),
    with NaN and Infinity where times go (Python's json reads them): no run, `pdserve ls` or `pdserve stop`
    crashes on it or signals a bystander; the file is refused as no state, and left alone (pdserve did not write
    it: common/created.py)."""
    dirs.ensure_reuse_dir(reuse_dir)
    bystanders = [
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True, preexec_fn=die_with_parent
        )
        for _ in range(2)
    ]
    try:
        stats = [s for p in bystanders if (s := read_stat(p.pid)) is not None]
        assert len(stats) == 2
        fake = {"pid": bystanders[1].pid, "pgid": bystanders[1].pid, "starttime": stats[1].starttime,
                "token": "nothing-carries-it", "url": "http://127.0.0.1:9", "name": "prefill-0", "role": "prefill",
                "index": 0}  # fmt: skip
        keeper = {"pid": bystanders[0].pid, "starttime": stats[0].starttime, "socket": "nobody-listens",
                  "ttl": float("inf"), "since": float("nan")}  # fmt: skip
        planted = {"id": "planted-1", "spec_name": "pd", "created": float("nan"), "fingerprint": {},
                   "servers": [fake], "proxy": {**fake, "name": "proxy"}, "keeper": keeper}  # fmt: skip
        (reuse_dir / "planted-1.json").write_text(json.dumps(planted))  # NaN, Infinity: what json.dumps writes
        inner.pytester.makepyfile(UP)
        result = run_reuse(inner, reuse_dir)
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["*reuse: left *planted-1.json alone: not a kept-cluster state*"])
        assert (reuse_dir / "planted-1.json").exists()
        for args in (["ls"], ["ls", "--json"], ["stop", "--all"]):
            out = _pdserve("--dir", str(reuse_dir), *args)
            assert "Traceback" not in out.stderr, out
            assert out.returncode == 0, out
        assert [p.poll() for p in bystanders] == [None, None], "a pid named in a state file was signalled"
    finally:
        for p in bystanders:
            p.kill()
            p.wait(30)
    assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    inner.gone_within()


def test_two_runs_at_once_share_no_cluster_and_stop_all_ends_both_keepers(inner: Inner, reuse_dir: Path) -> None:
    """Two reuse runs with one configuration started together, with one cluster kept: one attaches, the other
    starts its own (saying the kept one is in use); each keeps its own; `pdserve stop --all` then leaves no
    process of either, no lease, no state."""
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    for p in inner.info_dir.glob("*.json"):
        p.unlink()
    inner.pytester.makepyfile(  # a barrier: each holds its cluster until both have one (so both looked meanwhile)
        """
        import os, time
        from pathlib import Path

        def test_up(pd_cluster, pdinfo):
            pdinfo(pd_cluster, reused=pd_cluster.reused.kept_id if pd_cluster.reused else None)
            deadline = time.monotonic() + 240
            while len(list(Path(os.environ["PDINFO_DIR"]).glob("*.json"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        """
    )
    args = inner.args("--pd-reuse", f"--pd-reuse-dir={reuse_dir}")
    procs = [  # pytester's popen: its PYTHONPATH (part of the fingerprint: the servers read it) as the first run's
        inner.pytester.popen([sys.executable, "-m", "pytest", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(2)
    ]
    outs = []
    for p in procs:  # a few KB each: neither pipe fills while the other is read
        assert p.stdout is not None
        with p.stdout:
            outs.append(p.stdout.read().decode(errors="replace"))
        p.wait(120)
    assert [p.returncode for p in procs] == [0, 0], outs
    reused = sorted(i["reused"] or "" for i in inner.infos())
    assert reused == ["", state["id"]], (reused, outs)
    assert any(f"kept cluster {state['id']} is in use by another run" in o for o in outs), outs
    assert len(states(reuse_dir)) == 2
    assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    assert live_procs(inner.mark) == {}
    unheld_locks(inner.lease_dir)
    assert states(reuse_dir) == []


# --------------------------------------------------------------------------------------- pdserve ls / stop


def test_pdserve_on_an_empty_or_a_bad_reuse_dir(tmp_path: Path) -> None:
    """No reuse dir or an empty one: nothing kept (exit 0; `stop NAME` exit 1). A file, a directory others may
    write, one of another user, or one holding a user's files: a clear error naming it, exit 2, nothing touched."""
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    for args, code in ((["ls"], 0), (["ls", "--json"], 0), (["stop", "--all"], 0), (["stop", "pd-1-abcdef"], 1)):
        for directory in (empty, tmp_path / "missing"):
            out = _pdserve("--dir", str(directory), *args)
            assert out.returncode == code, (directory, args, out)
    assert json.loads(_pdserve("--dir", str(empty), "ls", "--json").stdout) == []
    assert not (tmp_path / "missing").exists()
    assert list(empty.iterdir()) == []  # looking never marks it
    a_file = tmp_path / "a-file"
    a_file.write_text("{}")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "theirs.json").write_text("{}")
    bad = {a_file: "is not a directory", shared: "is writable by others (mode 1777)"}
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        bad[foreign] = "belongs to uid 65534, not to us"
    for directory, why in bad.items():
        for args in (["ls"], ["stop", "--all"]):
            out = _pdserve("--dir", str(directory), *args)
            assert out.returncode == 2, (directory, args, out)
            assert f"pdserve: reuse directory {directory} {why}" in out.stderr, out
    assert (shared / "theirs.json").exists()
    assert a_file.read_text() == "{}"


def test_a_long_run_keeps_its_logs_while_other_reuse_runs_prune(inner: Inner, reuse_dir: Path) -> None:
    """Without --pd-log-dir a reuse run logs under `<reuse dir>/logs/<time>-<pid>`, and every reuse run prunes
    old ones (all but 5, older than 10 minutes). A run still going (a long suite in another terminal) must keep
    its log directory however old it is and however many runs came since."""
    go = inner.pytester.path / "go"
    inner.pytester.makepyfile(
        f"""
        import time
        from pathlib import Path

        def test_long(pd_cluster, pdinfo):
            pdinfo(pd_cluster, reused=None)
            deadline = time.monotonic() + 240
            while not Path({str(go)!r}).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pd_cluster.complete("hello " * 10, max_tokens=2)["choices"]
        """
    )
    args = ["--pd-engine=sim", f"--pd-lease-dir={inner.lease_dir}", "-p", "no:cacheprovider", "--pd-reuse",
            f"--pd-reuse-dir={reuse_dir}", "--pd-reuse-ttl=5"]  # fmt: skip
    with inner.pytester.popen([sys.executable, "-m", "pytest", *args], stdout=subprocess.DEVNULL) as long_run:
        wait_for(lambda: list(inner.info_dir.glob("*.json")), 60.0, "the long run's cluster up")
        [own] = (reuse_dir / "logs").iterdir()
        os.utime(own, (0, 0))  # it started long ago
        for i in range(6):  # and six runs came since (their directories sort after it)
            newer = reuse_dir / "logs" / f"29991231-00000{i}-1"
            newer.mkdir()
            os.utime(newer, (0, 0))
        inner.pytester.makepyfile(test_other="def test_other():\n    pass\n")
        try:
            other = inner.pytester.runpytest_subprocess(*args, "test_other.py", timeout=60)
            other.assert_outcomes(passed=1)
            assert own.is_dir(), "a running session's logs were pruned"
        finally:
            go.touch()
        assert long_run.wait(60) == 0
    assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0


def test_a_state_whose_keeper_pid_is_a_bystander_is_cleaned_by_stop_all(tmp_path: Path) -> None:
    """A state file naming a live process of ours as its keeper (right pid and start time: a `sleep` that
    pdserve never started) that serves no keeper socket: `pdserve stop --all` must not fail on it forever
    ("its keeper did not stop it"), must not signal the bystander, and must leave no state behind."""
    reuse_dir = tmp_path / "reuse"
    dirs.ensure_reuse_dir(reuse_dir)
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True, preexec_fn=die_with_parent
    )
    try:
        me = read_stat(bystander.pid)
        assert me is not None
        fake = {"pid": bystander.pid, "pgid": bystander.pid, "starttime": me.starttime, "token": "nothing-carries-it",
                "url": "http://127.0.0.1:9", "name": "prefill-0"}  # fmt: skip
        planted = {"id": "planted-2", "spec_name": "pd", "created": 0, "fingerprint": {}, "servers": [fake],
                   "proxy": {**fake, "name": "proxy"},
                   "keeper": {"pid": bystander.pid, "starttime": me.starttime, "socket": f"nobody-{os.getpid()}",
                              "ttl": 900, "since": 0}}  # fmt: skip
        # As a keeper writes it (recorded in the reuse dir's manifest): pdserve's own file, whose pid is now another's.
        write_replace(reuse_dir / "planted-2.json", json.dumps(planted).encode())
        out = _pdserve("--dir", str(reuse_dir), "stop", "--all")
        assert out.returncode == 0, out
        assert bystander.poll() is None, "a pid named in a state file was signalled"
        assert states(reuse_dir) == []
    finally:
        bystander.kill()
        bystander.wait(30)


def test_a_kept_server_pid_that_is_another_process_now_is_not_attached(inner: Inner, reuse_dir: Path) -> None:
    """Pid reuse: a kept server's pid now names another process (simulated: the state's start time differs from
    the live process's). The next run goes by pid *and* start time: it does not attach, says why, and asks the
    keeper to stop that cluster; nothing is signalled by pid."""
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    [path] = reuse_dir.glob("*.json")
    state["servers"][0]["starttime"] += 1
    path.write_text(json.dumps(state))
    second = run_reuse(inner, reuse_dir)
    second.assert_outcomes(passed=1)
    prefill = state["servers"][0]
    second.stdout.fnmatch_lines(
        [f"*reuse: kept cluster {state['id']} not reused: prefill-0 (pid {prefill['pid']}) is gone; stopping it*"]
    )
    assert [i["reused"] for i in inner.infos()] == [None, None]
    assert state["id"] not in [s["id"] for s in states(reuse_dir)]
