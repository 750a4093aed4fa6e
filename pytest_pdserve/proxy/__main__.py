"""Command line: ``python -m pytest_pdserve.proxy --host H --port P --prefill URL ... --decode URL ...``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import uvicorn

from pytest_pdserve.proxy.app import ProxyConfig, create_app


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_pdserve.proxy",
        description="P/D proxy: prefill on one server (max_tokens=1), decode on another (NixlConnector).",
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
        "--api-key",
        default=None,
        help="send 'Authorization: Bearer KEY' upstream (default: forward the client's header)",
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
        config = ProxyConfig(prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode), api_key=args.api_key)
    except ValueError as exc:
        parser.error(str(exc))
    print(
        f"pdserve proxy on http://{args.host}:{args.port} prefill={','.join(config.prefill_urls)}"
        f" decode={','.join(config.decode_urls)}",
        flush=True,
    )
    # access_log off: the app logs one richer line per request itself.
    app = create_app(config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
