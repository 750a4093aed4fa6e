"""Command line: ``python -m pytest_pdserve.proxy --host H --port P --prefill URL ... --decode URL ...``.

The API key comes from the environment (``VLLM_API_KEY``, like vLLM's servers), never from argv, where
``ps`` would show it to every local user.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pytest_pdserve.common.startup import import_httpx_without_its_cli, importing_without_gc

with importing_without_gc():  # the server stack, imported without the collector (common/startup.py)
    import_httpx_without_its_cli()
    import uvicorn

    from pytest_pdserve.common.rlimits import raise_nofile_limit
    from pytest_pdserve.proxy.app import UPSTREAM_TIMEOUT, ProxyConfig, create_app


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_pdserve.proxy",
        description="P/D proxy: prefill on one server (max_tokens=1), decode on another (NixlConnector). "
        "$VLLM_API_KEY, when set, is sent upstream as 'Authorization: Bearer KEY' (else the client's header is).",
    )
    # 127.0.0.1, not localhost: localhost may resolve to IPv6, which CI blocks (vLLM PR #27010).
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="port to bind")
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="prefill server base URL, e.g. http://127.0.0.1:8100 (repeat for several; round-robin)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="decode server base URL (repeat for several; round-robin, independent of prefill)",
    )
    parser.add_argument(
        "--upstream-timeout",
        type=float,
        default=UPSTREAM_TIMEOUT,
        metavar="SECONDS",
        help=f"total seconds an upstream has for an answer, and in a stream for each next chunk (default: "
        f"{UPSTREAM_TIMEOUT:g}); past it the client gets a 502",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (the proxy's own per-request line always goes to stdout)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse *argv*, then serve until SIGINT/SIGTERM."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is out of range; expected 1-65535")
    try:
        # $VLLM_API_KEY: sent as 'Authorization: Bearer KEY' upstream; unset: the client's header is forwarded.
        api_key = os.environ.get("VLLM_API_KEY") or None
        if not (0 < args.upstream_timeout < float("inf")):
            raise ValueError(f"--upstream-timeout {args.upstream_timeout:g} is not a number of seconds > 0")
        config = ProxyConfig(
            prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode), api_key=api_key,
            upstream_timeout=args.upstream_timeout,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    print(
        f"pdserve proxy on http://{args.host}:{args.port} prefill={','.join(config.prefill_urls)}"
        f" decode={','.join(config.decode_urls)}",
        flush=True,
    )
    raise_nofile_limit()  # as vLLM does: 1000 concurrent requests need more than the common soft limit of 1024
    # access_log off: the app logs one richer line per request itself.
    app = create_app(config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
