"""Issue 25, classes 1, 8, 9 and 11, attacked where the user meets them (real pytest sessions).

1. No option takes an optional value (walked over every registered option; the doors are in test_reuse_hostile).
8. Numbers are ASCII digits, in every setting and every variable a preset or the simulator reads.
9. A secret in a dying server's log reaches neither the terminal, nor JUnit XML, nor pdserve.log.
11. ``--pd-preset=auto`` finds the modules the run collects, or refuses; never a silent default cluster.
"""

from __future__ import annotations

import json
import pickle
import uuid
from pathlib import Path

import pytest

from pytest_pdserve.sim.faults import SimEnv, SimEnvError

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")


# ------------------------------------------------------------------------- 1: no option takes an optional value

WALK_CONFTEST = r"""
import json, os

import pytest


@pytest.hookimpl(trylast=True)
def pytest_addoption(parser):
    rows = []
    for opt in parser.getgroup("pdserve").options:
        attrs = opt.attrs()
        rows.append({"names": list(opt.names()), "nargs": attrs.get("nargs"), "const": repr(attrs.get("const")),
                     "action": type(attrs.get("action", "")).__name__ if not isinstance(attrs.get("action"), str)
                     else attrs.get("action")})
    with open(os.environ["WALK_OUT"], "w") as f:
        json.dump(rows, f)
"""


def test_no_registered_option_takes_an_optional_value(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every option of the pdserve group, as pytest registered it, takes exactly one value or none: an optional
    value (nargs "?" or "*") lets argparse take the next word, a test path, as the value (issue 25: `--pd-export-env`
    from PYTEST_ADDOPTS overwrote test_a.py). Each setting's flag is among them, so none escapes the walk."""
    from pytest_pdserve.config.setting_table import SETTINGS

    out = pytester.path / "walk.json"
    monkeypatch.setenv("WALK_OUT", str(out))
    pytester.makeconftest(WALK_CONFTEST)
    pytester.makepyfile("def test_x(): pass")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    rows = json.loads(out.read_text())
    names = {n for row in rows for n in row["names"]}
    assert {s.flag for s in SETTINGS} <= names, sorted({s.flag for s in SETTINGS} - names)
    for row in rows:
        assert row["nargs"] in (None, 0), row  # None: exactly one value; 0: a flag (store_true, --x/--no-x)
        assert row["const"] == "None", row  # a const is what an optional value's absence turns into
    assert len(rows) >= len(SETTINGS)


# ------------------------------------------------------------------------------------- 8: ASCII digits only

#: (door, where, value, fragment of the error). Underscores and other scripts' digits, which int() takes.
NUMBERS = [
    ("argv", "--pd-port-range", "6_1000-6_1999", "in digits 0-9"),
    ("env", "PDSERVE_PORT_RANGE", "٢٠٠٠٠-٢٠٩٩٩", "in digits 0-9"),
    ("ini", "pdserve_port_range", "20000-2_0999", "in digits 0-9"),
    ("argv", "--pd-proxy-port", "٨١٩٢", "digits 0-9 only"),
    ("env", "PDSERVE_PROXY_PORT", "8_192", "digits 0-9 only"),
    ("ini", "pdserve_block_size", "１６", "digits 0-9 only"),
    ("argv", "--pd-seed", "1_0", "digits 0-9 only"),
    ("env", "PREFILL_GPU_ID", "٠", "GPU indices >= 0"),
    ("argv", "--pd-simulate-gpus", "cuda:²", "N a whole number >= 0"),
    ("env", "PDSERVE_STARTUP_TIMEOUT", "1_0", "number of seconds"),
]


@pytest.mark.parametrize(("door", "where", "value", "fragment"), NUMBERS, ids=[f"{n[0]}-{n[1]}" for n in NUMBERS])
def test_a_number_not_in_ascii_digits_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, door: str, where: str, value: str, fragment: str
) -> None:
    """`--pd-port-range=6_1000-6_1999` was taken as 61000-61999 (int() reads underscores and any script's
    digits; `'²'.isdigit()` is True and int('²') raised a traceback). The README says digits 0-9."""
    args = []
    if door == "argv":
        args.append(f"{where}={value}")
    elif door == "env":
        monkeypatch.setenv(where, value)
    else:
        pytester.makeini(f"[pytest]\n{where} = {value}\n")
    pytester.makepyfile("def test_never(): raise AssertionError('must not run')")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    err = result.stderr.str()
    assert f"{value!r} from " in err, err
    assert fragment in err, err
    assert "Traceback" not in err + result.stdout.str()


@pytest.mark.parametrize(
    ("preset", "var", "value"),
    [("vllm-accuracy", "NUM_DECODE_INSTANCES", "٢"), ("vllm-multi-connector-edge-case", "BLOCK_SIZE", "1_28"),
     ("vllm-xpu-disagg", "MAX_MODEL_LEN", "１０２４")],
)  # fmt: skip
def test_a_preset_variable_not_in_ascii_digits_stops_the_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, preset: str, var: str, value: str
) -> None:
    """A preset reads its script's variables (NUM_DECODE_INSTANCES=٢ was two decode servers): the same rule."""
    monkeypatch.setenv(var, value)
    pytester.makepyfile("def test_never(): raise AssertionError('must not run')")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pd-engine=sim", "--pd-export-env", f"--pd-preset={preset}",
        f"--pd-lease-dir={pytester.path / 'leases'}",
    )  # fmt: skip
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    result.stderr.fnmatch_lines(
        [f"*preset {preset!r} (from --pd-preset): ${var}={value!r} is not a whole number > 0 in digits 0-9*"]
    )


@pytest.mark.parametrize(
    ("var", "value"),
    [("PDSERVE_SIM_CRASH_EXIT_CODE", "٣"), ("PDSERVE_SIM_SPAWN_WORKERS", "1_0"),
     ("VLLM_NIXL_SIDE_CHANNEL_PORT", "５６００"), ("PDSERVE_SIM_STARTUP_DELAY", "1_0"),
     ("PDSERVE_SIM_NONDETERMINISM_RATE", "٠.5"), ("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "５")],
)  # fmt: skip
def test_the_simulators_environment_takes_ascii_digits_only(var: str, value: str) -> None:
    """The simulator's knobs come from the environment the plugin hands it: the same digits rule."""
    with pytest.raises(SimEnvError, match=rf"{var}={value!r} is not accepted: .*\(digits 0-9\)"):
        SimEnv.from_environ({var: value})
    assert SimEnv.from_environ({var: "1"}) is not None  # the same variable in ASCII digits is fine


# ------------------------------------------------------------------------------ 9: secrets in a dying server's log

DYING = r"""
import os, signal

SECRETS = {secrets!r}


def test_dies(pd_cluster):
    server = pd_cluster.prefill[0]
    with open(server.log_path, "a") as f:
        f.write("RuntimeError: engine core died MARKER-{tag} " + " ".join(SECRETS) + "\n")
    os.kill(server.process.pid, signal.SIGKILL)
    pd_cluster.complete("hello " * 4, max_tokens=2)


def test_after(pd_cluster):
    pass
"""


def test_a_secret_in_a_dying_servers_log_reaches_no_output(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ServerDied's text carries the last lines of the dead server's log; a registered secret there (the API key,
    an HF token the servers inherit) is hidden in the failing test's report,
    the next test's failure, the terminal summary, JUnit XML and pdserve.log, with --showlocals on. The excerpt
    itself is shown (its marker), so the check is not vacuous."""
    tag = uuid.uuid4().hex[:8]
    key, hf = f"sk-key-{tag}", f"hf_envtoken_{tag}"
    monkeypatch.setenv("HF_TOKEN", hf)
    pytester.makepyfile(test_dying=DYING.format(secrets=[key, hf], tag=tag))
    logs, junit = pytester.path / "logs", pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}", f"--pd-log-dir={logs}",
        f"--pd-api-key={key}", "-p", "no:cacheprovider", "--showlocals", "-rA", f"--junitxml={junit}", timeout=120,
    )  # fmt: skip
    result.assert_outcomes(failed=1, errors=1)  # test_after: pd_cluster fails its setup with the death
    out = result.stdout.str() + result.stderr.str()
    assert f"MARKER-{tag}" in out, out[-4000:]  # the excerpt is in the report...
    assert "ServerDied" in out
    [run_logs] = [p for p in logs.iterdir() if p.is_dir()]  # each run writes into a directory of its own
    texts = {"terminal": out, "junit": junit.read_text(), "pdserve.log": (run_logs / "pdserve.log").read_text()}
    for where, text in texts.items():
        for secret in (key, hf):
            assert secret not in text, (where, secret)  # ...its secrets are not
    assert f"MARKER-{tag}" in texts["junit"]


def test_secrets_a_run_hands_its_servers_are_registered(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An --hf-token in VLLM_SERVE_EXTRA_ARGS and an HF_TOKEN in the environment reach the servers, which print
    what they were given (vLLM's `non-default args`): configure registers both, as it does the API key."""
    from pytest_pdserve.common.redaction import redact

    tag = uuid.uuid4().hex[:8]
    monkeypatch.setenv("VLLM_SERVE_EXTRA_ARGS", f"--hf-token hf_flag_{tag}")
    monkeypatch.setenv("HF_TOKEN", f"hf_env_{tag}")
    pytester.parseconfigure()
    assert redact(f"args: {{'hf_token': 'hf_flag_{tag}'}} env hf_env_{tag}") == "args: {'hf_token': '***'} env ***"


def test_secrets_a_cluster_spec_hands_a_server_are_registered(tmp_path: Path) -> None:
    """A ClusterSpec's own extra args and env reach one server only, past the settings: the process registers
    what it is given (every server and the proxy is a ServerProcess)."""
    from pytest_pdserve.common.redaction import redact
    from pytest_pdserve.running.process import ServerProcess

    tag = uuid.uuid4().hex[:8]
    ServerProcess(
        "prefill-0", ["vllm", "serve", "m", "--hf-token", f"hf_spec_{tag}"], {"HF_TOKEN": f"hf_specenv_{tag}"},
        tmp_path / "p.log", health_url=None, run_token="t",
    )  # fmt: skip
    assert redact(f"x hf_spec_{tag} y hf_specenv_{tag}") == "x *** y ***"


def test_an_error_class_cannot_skip_redaction() -> None:
    """The rule lives in the base class: a subclass that overrides __str__ or __repr__ is refused when defined."""
    from pytest_pdserve.common.redaction import register
    from pytest_pdserve.errors import PDServeError, ServerDied

    with pytest.raises(TypeError, match="overrides __str__: override describe"):
        type("Leaky", (PDServeError,), {"__str__": lambda self: "raw"})
    secret = f"sk-registered-{uuid.uuid4().hex[:8]}"
    register(secret)
    died = ServerDied("pd", "prefill-0", "exited with signal 9 (SIGKILL)", "12:00:00 UTC", f"key={secret}")
    for text in (str(died), repr(died), died.message, died.summary()):
        assert secret not in text, text
    assert "key=***" in str(died)
    assert str(pickle.loads(pickle.dumps(died))) == str(died)  # xdist ships it between processes


# --------------------------------------------------------------------------- 11: --pd-preset=auto never defaults

EDGE = "import os\n\ndef test_edge():\n    assert os.environ['BLOCK_SIZE'] == '16'\n"


@pytest.mark.parametrize("door", ["argv", "env", "ini"])
def test_preset_auto_with_no_path_finds_the_collected_module_or_refuses(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, door: str
) -> None:
    """`pytest --pd-preset=auto` with no path: the module under the current directory names the preset
    (test_edge_cases.py: vllm-edge-case, block size 16); it used to start the defaults (block size 128) silently.
    Where no collected module is one of vLLM's, it is a usage error saying to name the preset or the module."""
    args = ["-p", "no:cacheprovider", "--pd-engine=sim", "--pd-export-env", f"--pd-lease-dir={pytester.path / 'l'}"]
    if door == "argv":
        args.append("--pd-preset=auto")
    elif door == "env":
        monkeypatch.setenv("PDSERVE_PRESET", "auto")
    else:
        pytester.makeini("[pytest]\npdserve_preset = auto\n")
    pytester.makepyfile(test_mine="def test_never(): raise AssertionError('must not run')")
    refused = pytester.runpytest_subprocess(*args)
    assert refused.ret == pytest.ExitCode.USAGE_ERROR, refused.stdout.str()[-2000:]
    refused.stderr.fnmatch_lines(
        ["*--pd-preset auto (from *) found none of vLLM's P/D modules (test_edge_cases.py, *) in "
         f"{pytester.path}; name the preset (--pd-preset=NAME, *) or the module to run*"]
    )  # fmt: skip
    Path(pytester.path / "test_mine.py").unlink()
    sub = pytester.mkdir("nixl_integration")
    (sub / "test_edge_cases.py").write_text(EDGE)
    found = pytester.runpytest_subprocess(*args)
    found.assert_outcomes(passed=1)
    found.stdout.fnmatch_lines(["*pdserve: preset vllm-edge-case: NixlConnector, block size 16*"])
