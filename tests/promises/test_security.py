"""Security properties of a running cluster: loopback only, no shell, private logs, API key enforced.

One inner pytest session (real simulator processes) runs with ``--pd-api-key`` and a hostile
``VLLM_SERVE_EXTRA_ARGS``; the inner test inspects its own servers through ``/proc`` while they run.
"""

from __future__ import annotations

import os
import uuid

import _procnet
import pytest

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

INNER_TEST = r"""
import os
import stat
import sys
from pathlib import Path

import httpx
from procnet import LOOPBACK_V4, listening

API_KEY = "s3cret-key-{tag}"
HOSTILE = "x; touch {pwned}"


def test_security(pd_cluster):
    # 1. Every listening socket of every server and the proxy is on 127.0.0.1.
    for server in pd_cluster.servers:
        mine = listening(server.process.pid)
        assert mine, f"{{server.name}} listens on nothing?"
        for ip, port in mine:
            assert ip == LOOPBACK_V4, f"{{server.name}} listens on {{ip}}:{{port}}, not 127.0.0.1"
        assert server.process.argv[server.process.argv.index("--host") + 1] == "127.0.0.1"

    # 2. No shell: each server is a direct child of pytest running python, and the hostile value is
    #    one intact argv element of the running process.
    for server in pd_cluster.servers:
        pid = server.process.pid
        stat_fields = Path(f"/proc/{{pid}}/stat").read_text().rsplit(")", 1)[1].split()
        assert int(stat_fields[1]) == os.getpid(), f"{{server.name}} is not a direct child of pytest"
        assert os.path.realpath(f"/proc/{{pid}}/exe") == os.path.realpath(sys.executable)
    for server in (*pd_cluster.prefill, *pd_cluster.decode):
        argv = Path(f"/proc/{{server.process.pid}}/cmdline").read_bytes().split(b"\0")[:-1]
        assert argv.count(HOSTILE.encode()) == 1, argv
        assert argv[argv.index(HOSTILE.encode()) - 1] == b"--served-model-name"
    assert pd_cluster.model == HOSTILE  # the served name became the model id

    # 3. The log directory is private, and the API key is not written into the log header.
    log_dir = pd_cluster.prefill[0].log_path.parent
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700, oct(log_dir.stat().st_mode)
    header = pd_cluster.prefill[0].log_path.read_text().splitlines()[0]
    assert '"VLLM_API_KEY": "***"' in header
    # The key reaches servers and proxy through VLLM_API_KEY, never argv (ps shows argv to every local
    # user), so no log line carries it either: neither pdserve's headers nor the server's own start-up lines.
    for server in pd_cluster.servers:
        assert API_KEY.encode() not in Path(f"/proc/{{server.process.pid}}/cmdline").read_bytes(), server.name
    for path in log_dir.iterdir():
        assert API_KEY not in path.read_text(errors="replace"), path

    # 4. The servers require the key; the cluster's clients and the proxy send it.
    for server in (*pd_cluster.prefill, *pd_cluster.decode):
        anonymous = httpx.get(f"{{server.url}}/v1/models", trust_env=False, timeout=60)
        assert anonymous.status_code == 401, (server.name, anonymous.status_code)
        assert server.client.get("/v1/models").status_code == 200
    assert pd_cluster.complete("hello " * 20, max_tokens=3)["usage"]["completion_tokens"] == 3
"""


def test_loopback_only_no_shell_private_logs_and_api_key(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = uuid.uuid4().hex[:8]
    pwned = pytester.path / "pwned"
    monkeypatch.setenv("VLLM_SERVE_EXTRA_ARGS", f"--served-model-name,x; touch {pwned}")
    pytester.makepyfile(INNER_TEST.format(tag=tag, pwned=pwned))
    _procnet.install(pytester)
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}", f"--pd-log-dir={pytester.path / 'logs'}",
        f"--pd-api-key=s3cret-key-{tag}", "-p", "no:cacheprovider", timeout=120,
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    assert not pwned.exists()
    assert not os.path.exists("/tmp/pwned")
    assert f"s3cret-key-{tag}" not in result.stdout.str()  # nor in the progress lines on the terminal
