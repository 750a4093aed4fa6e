"""The one way a test picks a port for a server it starts itself (the plugin leases its own, port_leases.py).

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range, and the port is free only until the
socket closes: before the test's child binds it, any process that connects or binds port 0 may take it. With the
real-vLLM tier beside the simulator tier (``.ci/run``), vLLM's ZeroMQ and NIXL sockets took such a port in
between (``[Errno 98] Address already in use`` in test_proxy). Ports here come from below the range the plugin
leases (20000 and up) and below the ephemeral range, where nothing hands out ports by itself.
"""

from __future__ import annotations

import random
import socket

#: Where tests' own servers listen: under the plugin's leases (port_leases.acquire_ports' low=20000).
TEST_PORTS = range(15000, 20000)


_next = random.randrange(len(TEST_PORTS))  # where this process starts: concurrent pytest processes spread out


def free_port() -> int:
    """The next port of :data:`TEST_PORTS` that nobody is bound to now, on loopback (at most 200 tried).

    Ports are handed out in order from a random start, as the kernel does in its own range, so one process never
    gets the same port twice (a fixture picking a dozen ports before its servers bind them collided when ports
    were drawn at random).
    """
    global _next
    for _ in range(200):
        port = TEST_PORTS[_next % len(TEST_PORTS)]
        _next += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among 200 tried in {TEST_PORTS}")
