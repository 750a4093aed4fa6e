"""Bounds a setting and a `ClusterSpec` field share, in a module that imports only the digits rule. [pytest-free]

The settings table needs them when the plugin loads; `spec.py` (which imports the owned-flags and presets tables)
is loaded only when a cluster is described, so the shared values live here and spec.py re-exports them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pytest_pdserve.common.digits import is_int

#: Upper bounds shared by the session settings and `ClusterSpec`: beyond them a value only costs memory or time.
MAX_BLOCK_SIZE = 8192
MAX_MODEL_LEN = 1 << 24
#: What vLLM attention backend names look like (``FLASH_ATTN``, ``TRITON_ATTN``, ``auto``).
ATTENTION_BACKEND_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")

#: How long every client of the plugin (tests', checks', the proxy's upstream) keeps an idle connection for reuse.
#: Why: uvicorn, under vLLM and the simulator alike, closes a connection idle for its keep-alive (vLLM's
#: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s). httpx's own expiry is also 5 s, so a request sent on a connection idle for
#: just under 5 s met the server's close and failed with "Server disconnected without sending a response" (a CI
#: run on a loaded machine, between two contract tests). An expiry well below the server's leaves no such window.
KEEPALIVE_EXPIRY_S = 1.0
#: The variable vLLM (``vllm/envs.py``) and the simulator read their keep-alive from, in whole seconds.
SERVER_KEEPALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
#: The shortest server keep-alive a cluster may have: twice the clients' expiry.
MIN_SERVER_KEEPALIVE_S = 2


def server_keepalive_problem(env: Mapping[str, str]) -> str | None:
    """Why the servers' keep-alive in *env* (a mapping) would race the plugin's clients, or None.

    One rule for every door: ``ClusterSpec.env`` / ``prefill_env`` / ``decode_env`` and the environment pytest
    runs in (which the servers inherit).
    """
    value = env.get(SERVER_KEEPALIVE_ENV)
    if value is None:
        return None
    if not is_int(value):
        return f"{SERVER_KEEPALIVE_ENV}={value!r} is not a whole number of seconds in digits 0-9"
    seconds = int(value)
    if seconds < MIN_SERVER_KEEPALIVE_S:
        return (
            f"{SERVER_KEEPALIVE_ENV}={value!r} is below {MIN_SERVER_KEEPALIVE_S} s: the servers would close idle "
            f"connections that pdserve's clients still reuse (for up to {KEEPALIVE_EXPIRY_S:g} s), and requests would "
            f"fail with 'Server disconnected'; set it to {MIN_SERVER_KEEPALIVE_S} or more, or leave it unset (5)"
        )
    return None
