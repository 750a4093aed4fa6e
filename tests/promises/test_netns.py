"""P/D across two network namespaces: the decode pulls KV from a prefill it can reach only over a veth.

This is the multi-node case on one machine. The test makes two namespaces joined by a veth pair with
private addresses that exist only inside them (10.201.0.1 = prefill, 10.201.0.2 = decode), so the prefill's
side channel is reachable from the decode only across the veth, never over a shared loopback:

* namespace P: the simulator's prefill, HTTP and NIXL side channel bound to 10.201.0.1
  (``VLLM_NIXL_SIDE_CHANNEL_HOST=10.201.0.1``), plus a "misconfigured" prefill that advertises
  ``VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1`` (the negative control);
* namespace D: the simulator's decode, and an inner pytest session in attach mode
  (``--pd-prefill-url http://10.201.0.1:8100 --pd-decode-url http://127.0.0.1:8200``) whose built-in proxy
  runs there too.

Needs root and iproute2 (``ip netns``); skipped otherwise. Namespaces and processes are removed in
``finally`` whatever happens; nothing outside the two namespaces is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from _children import die_with_parent

P_ADDR, D_ADDR = "10.201.0.1", "10.201.0.2"
P_HTTP, BAD_P_HTTP, D_HTTP = 8100, 8101, 8200
P_SIDE, BAD_P_SIDE, D_SIDE = 5600, 5602, 5601
MODEL = "pdserve-sim/tiny-llama"
IP_TIMEOUT_S = 60.0
INNER_TIMEOUT_S = 240.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check)


def _netns_unavailable() -> str | None:
    """Why this test cannot run here (None: it can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install -y iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"pdserve-probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except subprocess.TimeoutExpired:
        return "`ip netns add` hung"
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def _namespaces() -> Iterator[tuple[str, str]]:
    """Two fresh namespaces joined by a veth pair; both deleted on exit (which also removes the veth)."""
    tag = os.getpid() % 100000
    ns_p, ns_d = f"pdserve-p-{tag}", f"pdserve-d-{tag}"
    made: list[str] = []
    try:
        for ns in (ns_p, ns_d):
            _ip("netns", "add", ns)
            made.append(ns)
        # Both ends are created directly inside the namespaces: no interface ever appears in ours.
        _ip("link", "add", f"pdvp{tag}", "netns", ns_p, "type", "veth", "peer", "name", f"pdvd{tag}", "netns", ns_d)
        for ns, dev, addr in ((ns_p, f"pdvp{tag}", P_ADDR), (ns_d, f"pdvd{tag}", D_ADDR)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ns_p, ns_d
    finally:
        for ns in made:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                _ip("netns", "del", ns, check=False)


class _Procs:
    """Processes started in a namespace (``ip netns exec`` execs them: the pid is the process itself)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, ns: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "VLLM_"))}
        child_env.update(env)
        with (self.log_dir / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv], env=child_env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
        self.procs.append((name, proc))

    def logs(self) -> str:
        return "\n".join(
            f"--- {name} ---\n{(self.log_dir / f'{name}.log').read_text(errors='replace')[-3000:]}"
            for name, _ in self.procs
        )

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


def _sim(host: str, port: int, role: str, side_host: str, side_port: int) -> tuple[list[str], dict[str, str]]:
    kvc = json.dumps({"kv_connector": "NixlConnector", "kv_role": role})
    argv = [sys.executable, "-m", "pytest_pdserve.sim", "serve", MODEL, "--host", host, "--port", str(port)]
    argv += ["--kv-transfer-config", kvc, "--seed", "0"]
    return argv, {"VLLM_NIXL_SIDE_CHANNEL_HOST": side_host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}


# Runs in namespace D. The servers were started a moment ago: wait for them (bounded) before attach mode checks.
INNER_CONFTEST = f"""
import time, httpx

def pytest_sessionstart(session):
    deadline = time.monotonic() + 30
    urls = ["http://{P_ADDR}:{P_HTTP}", "http://{P_ADDR}:{BAD_P_HTTP}", "http://127.0.0.1:{D_HTTP}"]
    while urls and time.monotonic() < deadline:
        try:
            if httpx.get(urls[0] + "/health", timeout=1.0, trust_env=False).status_code == 200:
                urls.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
"""

INNER_TEST = f"""
import json, os
import httpx
from pytest_pdserve.assertions import assert_pd_matches_single
from pytest_pdserve.proxy.app import prefill_body

PROMPT = " ".join(f"n{{i}}" for i in range(400))

def test_kv_crosses_the_veth(pd_cluster):
    decode = pd_cluster.decode[0]
    # What the proxy asks the prefill for; the answer's remote_host is the address the decode will dial.
    kv = pd_cluster.prefill[0].client.post(
        "/v1/completions", json=prefill_body({{"model": pd_cluster.model, "prompt": PROMPT + " probe"}})
    ).json()["kv_transfer_params"]
    before = decode.metrics()
    result = assert_pd_matches_single(pd_cluster, {{"prompt": PROMPT, "max_tokens": 12}})
    after = decode.metrics()

    # Negative control: a prefill that advertises 127.0.0.1 sends the decode to its own loopback.
    bad = httpx.post(
        "http://{P_ADDR}:{BAD_P_HTTP}/v1/completions", trust_env=False, timeout=30,
        json=prefill_body({{"model": pd_cluster.model, "prompt": PROMPT + " bad"}}),
    ).json()["kv_transfer_params"]
    failed_before = decode.metrics().nixl_failed_transfers()
    bad_decode = decode.client.post(
        "/v1/completions",
        json={{"model": pd_cluster.model, "prompt": PROMPT + " bad", "max_tokens": 4, "kv_transfer_params": bad}},
    )
    failed = decode.metrics().nixl_failed_transfers() - failed_before

    with open(os.environ["NETNS_RESULT"], "w") as fh:
        json.dump({{
            "remote_host": kv["remote_host"], "remote_port": kv["remote_port"],
            "nixl_bytes": after.nixl_bytes_transferred() - before.nixl_bytes_transferred(),
            "pd_text": result.outputs[0].text, "single_text": result.outputs[1].text,
            "prefill_url": pd_cluster.prefill[0].url, "proxy_url": pd_cluster.url,
            "bad_remote_host": bad["remote_host"], "bad_status": bad_decode.status_code, "bad_failed": failed,
        }}, fh)
"""


def test_pd_across_network_namespaces(tmp_path: Path) -> None:
    """Prefill in one namespace, decode in another: remote_host is routable and the KV crosses the veth."""
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    result_path = tmp_path / "result.json"
    procs = _Procs(tmp_path)
    with _namespaces() as (ns_p, ns_d):
        try:
            procs.start("prefill", ns_p, *_sim(P_ADDR, P_HTTP, "kv_producer", P_ADDR, P_SIDE))
            procs.start("prefill-bad", ns_p, *_sim(P_ADDR, BAD_P_HTTP, "kv_producer", "127.0.0.1", BAD_P_SIDE))
            procs.start("decode", ns_d, *_sim("127.0.0.1", D_HTTP, "kv_consumer", D_ADDR, D_SIDE))
            inner = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", str(tmp_path)]
            inner += ["--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "basetemp")]
            inner += ["--pd-lease-dir", str(tmp_path / "leases"), "-o", "timeout=60"]
            inner += ["--pd-prefill-url", f"http://{P_ADDR}:{P_HTTP}", "--pd-decode-url", f"http://127.0.0.1:{D_HTTP}"]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "VLLM_"))}
            env["NETNS_RESULT"] = str(result_path)
            try:
                run = subprocess.run(
                    ["ip", "netns", "exec", ns_d, *inner], env=env, cwd=tmp_path, capture_output=True, text=True,
                    timeout=INNER_TIMEOUT_S, check=False,
                )  # fmt: skip
            except subprocess.TimeoutExpired as exc:
                pytest.fail(f"inner session ran over {INNER_TIMEOUT_S}s:\n{exc.stdout!s}\n{procs.logs()}")
            print(run.stdout)
            assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{procs.logs()}"
        finally:
            procs.stop()
    data = json.loads(result_path.read_text())
    assert data["prefill_url"] == f"http://{P_ADDR}:{P_HTTP}"
    assert data["remote_host"] == P_ADDR, "prefill must advertise its routable side-channel address"
    assert data["remote_port"] == P_SIDE
    assert data["nixl_bytes"] > 0, "the decode pulled no KV across the veth"
    assert data["pd_text"] == data["single_text"]
    assert data["pd_text"], "empty completion"
    # The negative control: an unroutable advertised host breaks the pull (the decode cannot reach it).
    assert data["bad_remote_host"] == "127.0.0.1"
    assert data["bad_status"] >= 400
    assert data["bad_failed"] >= 1
    assert "attached (no servers started" in run.stdout
    namespaces = _ip("netns", "list").stdout
    assert ns_p not in namespaces, "namespace left behind"
    assert ns_d not in namespaces, "namespace left behind"
