"""Attach mode as users meet it: servers started outside pytest, an inner pytest session attached to them.

The deployment (module-scoped) is real ``pytest_pdserve.sim`` processes and a real proxy on 127.0.0.1, started
here with plain ``subprocess`` (never by the plugin): one prefill, two decodes (D0, D1), and an external proxy
in front of P + D0. Each inner session (``pytester.runpytest_subprocess``) gets a private lease dir and a
simulated GPU inventory, so "no GPU or server port leased" is checked on the lease files it leaves behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from _children import die_with_parent
from _ports import free_port
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

REPO = Path(__file__).resolve().parents[2]
MODEL = "pdserve-sim/tiny-llama"
#: Four processes starting at once: seconds quiet, more on a loaded machine; bounded far beyond it.
READY_TIMEOUT_S = 120.0
#: An inner session of a few tests against attached servers, bounded far beyond a loaded machine's.
INNER_TIMEOUT_S = 240.0
#: The example suite against attached servers, the same.
EXAMPLES_TIMEOUT_S = 600.0
#: A request or a wait that takes milliseconds, bounded for a loaded machine (tests/_timing_scan.py).
BOUND_S = 30.0
BLOCK_SIZE = 128


def _env(extra: Mapping[str, str]) -> dict[str, str]:
    # No inherited simulator/vLLM knobs, no PDSERVE_* settings: the deployment is exactly what this file says.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "VLLM_"))}
    env.update(extra)
    return env


@dataclass
class _Proc:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode} before ready:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1.0, trust_env=False).status_code == 200:
                    return
            time.sleep(0.05)
        pytest.fail(f"{self.name} not ready after {READY_TIMEOUT_S} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=BOUND_S)

    def counter(self, name: str, **labels: str) -> float:
        """Sum of the samples named exactly ``name`` whose labels include ``labels``."""
        text = httpx.get(f"{self.url}/metrics", timeout=BOUND_S, trust_env=False).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and labels.items() <= s.labels.items():
                    total += s.value
        return total


@dataclass
class Deployment:
    prefill: _Proc
    decode: tuple[_Proc, _Proc]
    proxy: _Proc


def _spawn(name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path, port: int) -> _Proc:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(argv),
            env=_env(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
            cwd=REPO,
        )
    return _Proc(name, f"http://127.0.0.1:{port}", proc, log_path)


def _sim(name: str, role: str, log_dir: Path) -> _Proc:
    port, side = free_port(), free_port()
    kvc = json.dumps({"kv_connector": "NixlConnector", "kv_role": role})
    argv = [sys.executable, "-m", "pytest_pdserve.sim", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--kv-transfer-config", kvc, "--block-size", str(BLOCK_SIZE), "--seed", "0"]
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache, which the cold/warm assertions use
    }
    return _spawn(name, argv, env, log_dir, port)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """P, D0, D1 and a proxy (P + D0), started outside any pytest-pdserve session."""
    log_dir = tmp_path_factory.mktemp("deployment")
    procs: list[_Proc] = []
    try:
        p = _sim("prefill", "kv_producer", log_dir)
        procs.append(p)
        d0 = _sim("decode0", "kv_consumer", log_dir)
        procs.append(d0)
        d1 = _sim("decode1", "kv_consumer", log_dir)
        procs.append(d1)
        port = free_port()
        argv = [sys.executable, "-m", "pytest_pdserve.proxy", "--host", "127.0.0.1", "--port", str(port)]
        proxy = _spawn("proxy", [*argv, "--prefill", p.url, "--decode", d0.url], {}, log_dir, port)
        procs.append(proxy)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for proc in procs:
            proc.wait_ready(deadline)
        yield Deployment(p, (d0, d1), proxy)
    finally:
        for proc in procs:
            proc.stop()


# The inner session's tests: they use pd_cluster like any user test and write what they saw to $ATTACH_RESULT.
INNER_1X1 = """
import json, os
from pathlib import Path
from pytest_pdserve.assertions import assert_kv_transferred, assert_pd_matches_single

PROMPT = " ".join(f"w{i}" for i in range(300))

def test_requests_go_through_the_attached_servers(pd_cluster):
    assert pd_cluster.attached
    decode = pd_cluster.decode[0]
    before = decode.metrics()
    out = pd_cluster.complete(PROMPT, max_tokens=8)
    nixl = decode.metrics().nixl_bytes_transferred() - before.nixl_bytes_transferred()
    assert nixl > 0, "the attached decode pulled no KV"
    assert_kv_transferred(pd_cluster, {"prompt": PROMPT + " again", "max_tokens": 4})
    assert_pd_matches_single(pd_cluster, {"prompt": PROMPT + " single", "max_tokens": 8})
    Path(os.environ["ATTACH_RESULT"]).write_text(json.dumps({
        "text": out["choices"][0]["text"], "nixl": nixl, "model": pd_cluster.model,
        "block_size": pd_cluster.block_size, "proxy": pd_cluster.url,
        "prefill": [s.url for s in pd_cluster.prefill], "decode": [s.url for s in pd_cluster.decode],
        "proxy_log": str(pd_cluster.proxy.log_path),
        # Leases are files only while held (released ones are unlinked): list them while the cluster is up.
        "leases": sorted(p.name for p in Path(os.environ["ATTACH_LEASES"]).glob("*.lock")),
    }))

def test_other_topologies_skip(pd_cluster_factory):
    pd_cluster_factory(num_prefill=2, num_decode=2)
"""


@dataclass
class Inner:
    result: pytest.RunResult
    data: dict[str, Any]

    def leases(self, prefix: str) -> list[str]:
        """Lease files the inner test saw while its cluster was up."""
        return [name for name in self.data["leases"] if name.startswith(f"{prefix}-")]


def _run_inner(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str, *args: str, env: Mapping[str, str] = {}
) -> Inner:
    pytester.makepyfile(test_inner=source)
    out = pytester.path / "result.json"
    lease_dir = pytester.path / "leases"
    monkeypatch.setenv("ATTACH_RESULT", str(out))
    monkeypatch.setenv("ATTACH_LEASES", str(lease_dir))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # Two simulated GPUs: a lease would be possible, so "no gpu-*.lock" proves attach mode took none.
    base = ["-p", "no:cacheprovider", "-rs", "--pd-lease-dir", str(lease_dir), "--pd-simulate-gpus", "2"]
    result = pytester.runpytest_subprocess(*base, *args, timeout=INNER_TIMEOUT_S)
    data = json.loads(out.read_text()) if out.exists() else {}
    return Inner(result, data)


def _check_passed(inner: Inner, deployment: Deployment) -> None:
    inner.result.assert_outcomes(passed=1, skipped=1)
    assert inner.result.ret == 0
    assert inner.data["model"] == MODEL
    assert inner.data["prefill"] == [deployment.prefill.url]
    assert inner.data["decode"] == [deployment.decode[0].url]
    assert inner.data["nixl"] > 0
    assert inner.leases("gpu") == [], "attach mode leased a GPU"
    for server in (deployment.prefill, deployment.decode[0], deployment.proxy):
        # The session is over: what we attached to must still be up (the plugin never stops it).
        assert httpx.get(f"{server.url}/health", timeout=BOUND_S, trust_env=False).status_code == 200, server.name
    inner.result.stdout.fnmatch_lines(["*cluster*needs 2P x 2D*attach mode*1P x 1D*"])


def test_attach_with_given_proxy(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, deployment: Deployment
) -> None:
    """CLI form with --pd-proxy-url: the given proxy carries the requests, nothing is started or leased."""
    p, d0 = deployment.prefill, deployment.decode[0]
    proxied = deployment.proxy.counter("pdserve_proxy_requests_total")
    inner = _run_inner(
        pytester, monkeypatch, INNER_1X1,
        "--pd-prefill-url", p.url, "--pd-decode-url", d0.url, "--pd-proxy-url", deployment.proxy.url,
    )  # fmt: skip
    _check_passed(inner, deployment)
    assert inner.data["proxy"] == deployment.proxy.url
    assert deployment.proxy.counter("pdserve_proxy_requests_total") - proxied == 3  # complete + 2 assertions
    assert inner.leases("port") == [], "attach mode with --pd-proxy-url leased a port"
    inner.result.stdout.fnmatch_lines(
        [f"pdserve: attached (no servers started, no GPUs leased): prefill {p.url}; decode {d0.url}; "
         f"proxy {deployment.proxy.url}",
         "pdserve: engine none started (the attached servers' own), model as the servers serve"]
    )  # fmt: skip
    # Issue 29: the header named the engine --pd-engine=auto would have started ("engine sim (auto: ...)").
    assert "pdserve: engine sim" not in inner.result.stdout.str()


def test_attach_starts_builtin_proxy(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, deployment: Deployment
) -> None:
    """CLI form without a proxy: the built-in proxy starts in front of the servers, leasing only its own port."""
    p, d0 = deployment.prefill, deployment.decode[0]
    proxied = deployment.proxy.counter("pdserve_proxy_requests_total")
    # --pd-block-size 16 is overridden by what the servers report (vllm:cache_config_info block_size=128).
    inner = _run_inner(
        pytester, monkeypatch, INNER_1X1, "--pd-prefill-url", p.url, "--pd-decode-url", d0.url, "--pd-block-size", "16"
    )
    _check_passed(inner, deployment)
    assert inner.data["block_size"] == BLOCK_SIZE
    assert inner.data["proxy"] != deployment.proxy.url
    assert deployment.proxy.counter("pdserve_proxy_requests_total") == proxied, "the external proxy was used"
    assert "proxy /v1/completions status=200" in Path(str(inner.data["proxy_log"])).read_text()
    assert inner.leases("port") == [f"port-{httpx.URL(inner.data['proxy']).port}.lock"], "more than the proxy's port"
    inner.result.stdout.fnmatch_lines(["pdserve: attached (no servers started*proxy built-in (started here)"])
    with pytest.raises(httpx.ConnectError):  # the built-in proxy stopped with its session
        httpx.get(f"{inner.data['proxy']}/health", timeout=BOUND_S, trust_env=False)


def test_attach_from_env(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, deployment: Deployment) -> None:
    """$PDSERVE_PREFILL_URLS / $PDSERVE_DECODE_URLS / $PDSERVE_PROXY_URL."""
    env = {
        "PDSERVE_PREFILL_URLS": deployment.prefill.url,
        "PDSERVE_DECODE_URLS": deployment.decode[0].url,
        "PDSERVE_PROXY_URL": deployment.proxy.url,
    }
    inner = _run_inner(pytester, monkeypatch, INNER_1X1, env=env)
    _check_passed(inner, deployment)
    assert inner.data["proxy"] == deployment.proxy.url


def test_attach_from_ini(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, deployment: Deployment) -> None:
    """Ini keys pdserve_prefill_urls / pdserve_decode_urls (no proxy: the built-in one)."""
    pytester.makeini(
        f"[pytest]\npdserve_prefill_urls = {deployment.prefill.url}\npdserve_decode_urls = {deployment.decode[0].url}\n"
    )
    inner = _run_inner(pytester, monkeypatch, INNER_1X1)
    _check_passed(inner, deployment)
    assert inner.data["proxy"] != deployment.proxy.url


INNER_NXM = """
def test_round_robin(pd_cluster, pd_cluster_factory):
    assert pd_cluster_factory(num_decode=2) is pd_cluster
    assert [s.name for s in pd_cluster.decode] == ["decode-0", "decode-1"]
    before = pd_cluster.metrics()
    for i in range(4):
        pd_cluster.complete(" ".join(f"rr{i}-{k}" for k in range(200)), max_tokens=2)
    after = pd_cluster.metrics()
    for name in ("decode-0", "decode-1"):
        assert after[name].request_success() - before[name].request_success() == 2, name
        assert after[name].nixl_bytes_transferred() > before[name].nixl_bytes_transferred(), name
    assert after["prefill-0"].request_success() - before["prefill-0"].request_success() == 4

def test_exact_other_topology_skips(pd_cluster_factory):
    pd_cluster_factory(num_decode=3)
"""


def test_attach_n_by_m_round_robin(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, deployment: Deployment
) -> None:
    """1P x 2D: the built-in proxy alternates between the two attached decodes; both pull KV."""
    d0, d1 = deployment.decode
    inner = _run_inner(
        pytester, monkeypatch, INNER_NXM,
        "--pd-prefill-url", deployment.prefill.url, "--pd-decode-url", d0.url, "--pd-decode-url", d1.url,
    )  # fmt: skip
    inner.result.assert_outcomes(passed=1, skipped=1)
    inner.result.stdout.fnmatch_lines([f"*decode {d0.url} {d1.url};*", "*needs 1P x 3D*"])


INNER_DOWN = """
def test_one(pd_cluster):
    pass

def test_two(pd_cluster):
    pass

def test_without_cluster():
    pass
"""


@pytest.mark.parametrize("dead", ["decode", "proxy"])
def test_attach_url_down_fails_fast(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, deployment: Deployment, dead: str
) -> None:
    """A URL that does not answer: every test using pd_cluster errors at once with a message naming it."""
    down = f"http://127.0.0.1:{free_port()}"
    decode = down if dead == "decode" else deployment.decode[0].url
    args = ["--pd-prefill-url", deployment.prefill.url, "--pd-decode-url", decode]
    if dead == "proxy":
        args += ["--pd-proxy-url", down]
    started = time.monotonic()
    inner = _run_inner(pytester, monkeypatch, INNER_DOWN, *args)
    elapsed = time.monotonic() - started
    inner.result.assert_outcomes(passed=1, errors=2)
    assert inner.result.ret != 0
    flag = "--pd-decode-url" if dead == "decode" else "--pd-proxy-url"
    inner.result.stdout.fnmatch_lines(
        ["*attach mode: 1 of * attached URLs did not answer:", f"*at {down} (given by {flag}): GET /health: *"]
    )
    text = inner.result.stdout.str()
    # No noise: none of our helper frames, no chained httpx/httpcore traceback, one attach check per session.
    for noise in ("cluster.py", "manager.py", "attach.py", "httpcore", "During handling"):
        assert noise not in text, text
    assert text.count("did not answer:") == 2, text  # once per erroring test, not accumulating
    # The check of a refused URL ends at once; a wait for it to come up would last the start timeout (1200 s).
    assert elapsed < 120, f"failing took {elapsed:.1f}s"


def test_attach_wrong_model_names_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, deployment: Deployment
) -> None:
    """--pd-model that the attached servers do not serve: the error says which server serves what."""
    inner = _run_inner(
        pytester, monkeypatch, INNER_DOWN, "--pd-model", "no-such-model",
        "--pd-prefill-url", deployment.prefill.url, "--pd-decode-url", deployment.decode[0].url,
    )  # fmt: skip
    inner.result.assert_outcomes(passed=1, errors=2)
    expected = (
        f"attach mode: model 'no-such-model' (--pd-model) is not served everywhere: prefill-0 at "
        f"{deployment.prefill.url} serves ['{MODEL}']"
    )
    assert expected in inner.result.stdout.str()


@pytest.mark.timeout(2 * EXAMPLES_TIMEOUT_S)
def test_example_suite_against_attached_servers(deployment: Deployment, tmp_path: Path) -> None:
    """The repo's example suite passes against servers started elsewhere (what multi-node users run)."""
    examples = REPO / "examples"
    if not examples.is_dir():
        pytest.skip(f"no example suite at {examples} yet")
    argv = [sys.executable, "-m", "pytest", "examples", "-p", "no:cacheprovider", "-q", "-rs"]
    argv += ["--pd-prefill-url", deployment.prefill.url, "--pd-decode-url", deployment.decode[0].url]
    argv += ["--pd-lease-dir", str(tmp_path / "leases"), "--basetemp", str(tmp_path / "basetemp")]
    try:
        proc = subprocess.run(
            argv, cwd=REPO, env=_env({}), capture_output=True, text=True, timeout=EXAMPLES_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the example suite took more than {EXAMPLES_TIMEOUT_S}s:\n{exc.stdout!s}")
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
