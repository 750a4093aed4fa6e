"""Entry point: ``pdserve-sim serve MODEL [flags]`` / ``python -m pytest_pdserve.sim serve MODEL [flags]``."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from pytest_pdserve.sim import environment_table
from pytest_pdserve.sim.cli import parse_serve_args
from pytest_pdserve.sim.faults import SimEnv, SimEnvError

USAGE = "usage: pdserve-sim serve [model_tag] [options]"

HELP = f"""{USAGE}

pdserve-sim: a vLLM 0.34 stand-in for machines without GPUs or vLLM, and a fault injector. It takes the
arguments of `vllm serve` and speaks vLLM's HTTP API, prefix-cache arithmetic, metrics and NixlConnector P/D.

commands:
  serve [model_tag] [options]   start a simulated server (`pdserve-sim serve --help` lists every flag)

examples:
  pdserve-sim serve pdserve-sim/tiny-llama --port 8100 --block-size 128
  pdserve-sim serve Qwen/Qwen3-0.6B --kv-cache-memory-bytes 256MiB \\
      --kv-transfer-config '{{"kv_connector":"NixlConnector","kv_role":"kv_both"}}'
  PDSERVE_SIM_CRASH_AFTER_REQUESTS=3 pdserve-sim serve pdserve-sim/tiny-llama   # a fault switch

fault switches and environment (read at startup):
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``serve`` arguments and environment, then run the simulator; returns the exit status.

    Only the stdlib-only argument parser is imported before validation, so argparse errors (status 2)
    are immediate; the server stack is imported afterwards.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(HELP + environment_table(), file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    if args[0] != "serve":
        print(USAGE, file=sys.stderr)
        print(f"pdserve-sim: error: invalid choice: {args[0]!r} (choose from 'serve')", file=sys.stderr)
        return 2
    serve_args = parse_serve_args(args[1:])
    try:
        env = SimEnv.from_environ(os.environ)
    except SimEnvError as exc:
        print(f"pdserve-sim: error: {exc}", file=sys.stderr)
        return 2

    # Lazy: the server stack (starlette, uvicorn, prometheus_client) is slow to import, which a bad argument or
    # --help must not wait for; imported without the collector (startup.py).
    from pytest_pdserve.common.startup import importing_without_gc

    with importing_without_gc():
        from pytest_pdserve.sim.server import serve  # lazy: see above

    return serve(serve_args, env)


if __name__ == "__main__":
    sys.exit(main())
