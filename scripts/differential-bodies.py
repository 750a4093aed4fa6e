#!/usr/bin/env python3
"""The full differential sweep of request bodies: hypothesis-generated bodies sent to the simulator and to vLLM.

Usage (from the repo root, with the dev venv that has hypothesis and httpx; both servers up with the same model):

    .venv/bin/python scripts/differential-bodies.py --sim http://127.0.0.1:8941 --vllm http://127.0.0.1:8931 \\
        --model /path/to/tiny-llama [--examples 500] [--seed 0] [--record tests/data/vllm-cpu/request-validation.json]

Each body is a valid one with one to three fields given values of any JSON type (tests/_bodies.py body_strategy).
Both answers are compared on status, error type, param and message (a message listing several union errors is
exempt: docs/differential.md). Prints every difference and exits 1 if there is any. ``--record`` rewrites the fixed
sample's recorded vLLM answers (tests/_bodies.py CASES) from the --vllm server instead.
The fixed sample runs in the test suite (tests/sim/test_sim_bodies.py, tests/sim/test_differential.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import _bodies  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim", required=True, help="the simulator's base URL")
    parser.add_argument("--vllm", required=True, help="real vLLM's base URL")
    parser.add_argument("--model", required=True, help="the model both serve (as the bodies name it)")
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", type=Path, help="write the fixed sample's vLLM answers here and stop")
    args = parser.parse_args()
    vllm = httpx.Client(base_url=args.vllm, timeout=60, trust_env=False)
    if args.record is not None:
        version = vllm.get("/version").json().get("version")
        answers = _bodies.answers(vllm, args.model)
        args.record.write_text(json.dumps({"vllm_version": version, "answers": answers}, indent=1) + "\n")
        print(f"recorded {len(answers)} answers of vLLM {version} in {args.record}")
        return 0
    sim = httpx.Client(base_url=args.sim, timeout=60, trust_env=False)

    # Hypothesis keeps a directory of its own; not in the repository (pytest would then warn about collecting it).
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", tempfile.mkdtemp(prefix="pdserve-hypothesis-"))
    from hypothesis import HealthCheck, given, seed, settings

    differing: list[dict[str, Any]] = []
    seen = 0

    @seed(args.seed)
    @settings(max_examples=args.examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_bodies.body_strategy())
    def compare(case: tuple[str, dict[str, Any]]) -> None:
        nonlocal seen
        route, over = case
        body = _bodies.body_of(route, over, args.model)
        got = {name: _bodies.compared({"route": route, "over": over, **_bodies.answer(client, route, body)})
               for name, client in (("vllm", vllm), ("sim", sim))}  # fmt: skip
        seen += 1
        if got["vllm"] != got["sim"] and _bodies.accepted(got) is None:
            differing.append(got)

    compare()
    for diff in differing:
        print(json.dumps(diff, default=str))
    statuses = "sim and vLLM agree" if not differing else f"{len(differing)} differ"
    print(f"{seen} generated bodies: {statuses}", file=sys.stderr)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
