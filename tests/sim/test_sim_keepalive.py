"""The simulator keeps an idle HTTP connection open for VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds, as vLLM's API server
does (``timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE``); tests/sim/test_contract.py measures the default (5 s)
on both engines."""

from __future__ import annotations

import socket

from ._simproc import BOUND_S, Factory


def _idle_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        assert chunk, f"closed before answering: {answer!r}"
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    return sock


def test_a_longer_keep_alive_is_honoured(sim_factory: Factory) -> None:
    """With 600 s the connection is still open 7 s after the answer, past uvicorn's default 5 s: a simulator that
    ignored the variable would have closed it (a loaded machine's stall would have to last ten minutes to reach the
    close from the other side)."""
    server = sim_factory(env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "600"}).wait_ready()
    with _idle_connection(server.port) as sock:
        sock.settimeout(7)  # the idle time under test
        try:
            data = sock.recv(65536)
        except TimeoutError:
            data = None  # still open: what the variable asks for
    assert data is None, f"the simulator closed an idle connection before 7 s (got {data!r}) with a 600 s keep-alive"
