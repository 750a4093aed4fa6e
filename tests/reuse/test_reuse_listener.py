"""Issue 25, class 3: a kept cluster's state file can be edited; the API key goes only to the kept processes.

An edited state file that points a server's URL at another listener made the next run send ~15 requests carrying
the API key there before it gave up. Now, before any request, each URL's port must be a listening socket of the
kept pid (``proctree.listens_on``: its inode from /proc/net/tcp{,6} among /proc/PID/fd); else nothing is sent.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import _reuse
import pytest
from _pdsession import Inner
from _reuse import UP, run_reuse, states

from pytest_pdserve.running.proctree import listens_on

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

# The shared fixtures (tests/_reuse.py): one copy, bound here so pytest finds them.
inner = _reuse.inner
reuse_dir = _reuse.reuse_dir

KEY = "sk-kept-cluster-key-7777"


@contextlib.contextmanager
def recorder() -> Iterator[tuple[int, list[dict[str, str]]]]:
    """A 127.0.0.1 HTTP server answering every request 200 ``{}`` and recording its headers: (port, records)."""
    seen: list[dict[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
            body = b"{}"
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer  # noqa: N815 - http.server's names

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def key_setting(inner: Inner, monkeypatch: pytest.MonkeyPatch, via: str) -> list[str]:
    """The API key through ``via``; returns the argv part (if any)."""
    if via == "argv":
        return [f"--pd-api-key={KEY}"]
    if via == "PYTEST_ADDOPTS":
        monkeypatch.setenv("PYTEST_ADDOPTS", f"--pd-api-key={KEY}")
    elif via == "ini":
        inner.pytester.makeini(f"[pytest]\npdserve_api_key = {KEY}\n")
    else:
        monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    return []


def test_listens_on_knows_its_own_listener_from_anothers() -> None:
    import os
    import socket

    with socket.create_server(("127.0.0.1", 0)) as mine, socket.create_server(("127.0.0.1", 0)) as other:
        assert listens_on(os.getpid(), mine.getsockname()[1])
        assert not listens_on(1, other.getsockname()[1])  # not pid 1's socket (nor readable, as the case may be)
    with socket.create_server(("::1", 0), family=socket.AF_INET6) as six:
        assert listens_on(os.getpid(), six.getsockname()[1])


@pytest.mark.parametrize("via", ["argv", "PYTEST_ADDOPTS", "ini", "env"])
@pytest.mark.parametrize("which", ["prefill-0", "proxy"])
def test_an_edited_state_file_never_sends_the_key_to_a_foreign_listener(
    inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch, via: str, which: str
) -> None:
    inner.pytester.makepyfile(UP)
    args = key_setting(inner, monkeypatch, via)
    run_reuse(inner, reuse_dir, *args).assert_outcomes(passed=1)
    [state] = states(reuse_dir)
    [path] = reuse_dir.glob(f"{state['id']}.json")
    with recorder() as (port, seen):
        servers = [*state["servers"], state["proxy"]]
        [target] = [s for s in servers if s["name"] == which]
        target["url"] = f"http://127.0.0.1:{port}"  # the kept pid and start time stay right: only the URL moved
        path.write_text(json.dumps(state))
        result = run_reuse(inner, reuse_dir, *args)
    out = result.stdout.str()
    assert [r["path"] for r in seen if KEY in r.get("authorization", "")] == []  # the key never went there
    assert seen == [], seen  # nor any request at all
    result.assert_outcomes(passed=1)  # on a fresh cluster
    assert f"{which}: port {port} is not a listening socket of the kept process" in out, out
    assert "reused kept cluster" not in out
