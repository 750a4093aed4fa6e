#!/usr/bin/env python3
"""The full differential sweep of `vllm serve` flag sets: hypothesis-generated sets started on the simulator and on
vLLM for CPU, compared on "starts or refuses" and the refusal's class (exit status, argparse argument, config class
or exception type: tests/_flags.py).

Usage (from the repo root, with the dev venv; real vLLM for CPU installed):

    PDSERVE_VLLM_EXECUTABLE=.venv-vllm/bin/vllm .venv/bin/python scripts/differential-flags.py \\
        [--examples 20] [--seed 0] [--timeout 400] [--logs DIR]

Each set is one to four flags of tests/_flags.py FLAG_VALUES (valid and invalid values). A set vLLM starts costs
50-100 s on a 2-core machine (it is stopped once /health answers); one it refuses while parsing arguments costs
the time vLLM takes to import (10-40 s). Prints one JSON line per set and exits 1 if any outcome differs and is
not listed in tests/_flags.py ACCEPTED. The fixed sample runs in tests/test_start_refusals.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import _flags  # noqa: E402
from _ports import free_port  # noqa: E402

from pytest_pdserve.engines.cpu import cpu_server_env  # noqa: E402
from pytest_pdserve.engines.engine import resolve_engine, vllm_python  # noqa: E402
from pytest_pdserve.engines.tiny_model import ensure_tiny_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20, help="flag sets to try (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=400, help="seconds one vLLM start may take")
    parser.add_argument("--logs", type=Path, default=None, help="keep every server's output here")
    args = parser.parse_args()
    vllm_argv = resolve_engine("vllm", os.environ.get("PDSERVE_VLLM_EXECUTABLE", "vllm"))[2]
    if not vllm_argv:
        print("real vLLM is not installed (set PDSERVE_VLLM_EXECUTABLE)", file=sys.stderr)
        return 2
    model = str(ensure_tiny_model("llama", vllm_python(vllm_argv)))
    logs = args.logs or Path(tempfile.mkdtemp(prefix="pdserve-flags-"))
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **cpu_server_env(logs)}
    env.pop("VLLM_ALLOW_LONG_MAX_MODEL_LEN", None)
    engines = {"vllm": list(vllm_argv), "sim": [sys.executable, "-m", "pytest_pdserve.sim"]}

    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", tempfile.mkdtemp(prefix="pdserve-hypothesis-"))
    from hypothesis import HealthCheck, given, seed, settings

    differing: list[dict[str, Any]] = []
    seen = 0

    @seed(args.seed)
    @settings(max_examples=args.examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_flags.flags_strategy())
    def compare(flags: list[str]) -> None:
        nonlocal seen
        seen += 1
        got: dict[str, Any] = {"flags": flags}
        for name, argv in engines.items():
            port = free_port()
            started = time.monotonic()
            got[name] = _flags.outcome([*argv, "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags],
                                       env, port, args.timeout, logs / f"{seen:03d}-{name}.log")  # fmt: skip
            got[f"{name}_s"] = round(time.monotonic() - started, 1)
        same = got["vllm"] == got["sim"]
        why = None if same else _flags.accepted(flags)
        got["verdict"] = "same" if same else (f"accepted: {why}" if why else "DIFFERENT")
        print(json.dumps(got), flush=True)
        if not same and why is None:
            differing.append(got)

    compare()
    print(f"{seen} flag sets: " + ("sim and vLLM agree" if not differing else f"{len(differing)} differ")
          + f" (logs: {logs})", file=sys.stderr)  # fmt: skip
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
