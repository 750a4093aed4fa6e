"""RemoteOpenAIServer-style readiness loop (our own re-implementation of vLLM's tests/utils.py behaviour).

``python _remote_poll.py URL OUT``: GET URL with a fresh connection each time (like ``requests.get``);
stop at HTTP 200; on a connection error sleep 0.5 s; any other status retries at once (as upstream does).
Writes ``time.monotonic()`` of the moment it saw 200 to OUT.
"""

from __future__ import annotations

import sys
import time

import httpx


def main() -> int:
    url, out = sys.argv[1], sys.argv[2]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, trust_env=False).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        return 1
    with open(out, "w") as fh:
        fh.write(repr(time.monotonic()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
