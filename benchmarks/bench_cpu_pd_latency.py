"""P/D request latency on real vLLM for CPU, with and without vLLM's NIXL core pin.

vLLM's NIXL worker on CPU pins itself to the last core of each NUMA node, so every server's worker and NIXL
threads share one core; the CPU tweaks plugin skips that pin (docs/vllm-cpu.md). This runs one inner pytest per
variant and round: a session cluster (`pd_cluster`, real vLLM) and one test that sends ``--requests`` P/D
completions through the proxy, timing each. Variants:
  unpinned   the plugin's default (vLLM's pin skipped)
  pinned     ``VLLM_NIXL_CPU_PIN_KV_CORE=1`` (vLLM as shipped)
Reported: per-request latency (median, p90, max), requests over 5 s, HTTP 500s, and the P/D-ready round trip of
the cluster start. Target: no request over 5 s and no 500 with the pin skipped.

    PDSERVE_VLLM_EXECUTABLE=.venv-vllm/bin/vllm .venv/bin/python benchmarks/bench_cpu_pd_latency.py [--requests 50]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from _common import InnerProject, clean_env, fmt, load_average, print_table, summary, verdict, write_result

INNER_TEST = """
import json, os, time
import httpx

def test_requests(pd_cluster):
    out = []
    for i in range(int(os.environ["BENCH_REQUESTS"])):
        body = {{"model": pd_cluster.model, "prompt": f"request {{i}} " + "hello world " * 40, "max_tokens": 4,
                "temperature": 0}}
        t0 = time.monotonic()
        status = pd_cluster.client.post("/v1/completions", json=body).status_code
        out.append({{"seconds": time.monotonic() - t0, "status": status}})
    with open({records!r} + f"/{{os.getpid()}}.json", "w") as fh:
        json.dump({{"requests": out, "pd_ready": pd_cluster.pd_ready_seconds}}, fh)
"""


def run_variant(project: InnerProject, exe: str, requests: int, pinned: bool) -> dict[str, Any]:
    env = clean_env(PDSERVE_VLLM_EXECUTABLE=exe, BENCH_REQUESTS=str(requests))
    if os.environ.get("PDSERVE_CACHE_DIR"):
        env["PDSERVE_CACHE_DIR"] = os.environ["PDSERVE_CACHE_DIR"]
    if pinned:
        env["VLLM_NIXL_CPU_PIN_KV_CORE"] = "1"
    project.clear_records()
    # A cluster that is not P/D-ready fails at setup (the failure this benchmark is about): count it, keep going.
    try:
        project.run("--pd-engine=vllm", f"--pd-lease-dir={project.lease_dir}", "test_latency.py", env=env,
                    plugin=False, timeout=900)  # fmt: skip
    except RuntimeError as exc:
        failed = re.search(r"NotPDReady[^\n]*", str(exc))
        return {"failed_start": failed.group(0) if failed else str(exc)[-300:]}
    (record,) = project.read_records()
    return dict(record)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="inner sessions per variant, interleaved")
    args = parser.parse_args()
    exe = os.environ.get("PDSERVE_VLLM_EXECUTABLE")
    if not exe or not Path(exe).exists():
        print("set PDSERVE_VLLM_EXECUTABLE to real vLLM's `vllm` (scripts/install-vllm-cpu.sh)", file=sys.stderr)
        return 2
    project = InnerProject("cpu-latency")
    project.write("test_latency.py", INNER_TEST.format(records=str(project.records)))
    results: dict[str, list[dict[str, Any]]] = {"unpinned": [], "pinned": []}
    load0 = load_average()
    try:
        for _ in range(args.rounds):
            for name in results:
                results[name].append(run_variant(project, exe, args.requests, pinned=name == "pinned"))
    finally:
        project.cleanup()
    rows = []
    ok = None
    for name, runs in results.items():
        reqs = [r for run in runs for r in run.get("requests", [])]
        lat = summary(r["seconds"] for r in reqs)
        slow = sum(r["seconds"] > 5 for r in reqs)
        errors = sum(r["status"] >= 500 for r in reqs)
        failed = sum("failed_start" in run for run in runs)
        ready = [run["pd_ready"] for run in runs if run.get("pd_ready") is not None]
        rows.append([name, len(reqs), fmt(lat, "s", 1.0, 2), f"{lat.get('max', 0):.2f} s", slow, errors, failed,
                     " ".join(f"{r:.2f}" for r in ready)])  # fmt: skip
        if name == "unpinned":
            ok = bool(reqs) and slow == 0 and errors == 0 and failed == 0
    print_table(
        f"P/D latency on real vLLM for CPU ({args.rounds} sessions x {args.requests} requests per variant, "
        f"load {load0[0]:.1f} at start)",
        ["variant", "requests", "latency median [p10-p90]", "max", "> 5 s", "HTTP 5xx", "failed starts",
         "P/D-ready round trips (s)"],
        rows,
    )  # fmt: skip
    print(f"\ntarget (unpinned: no request over 5 s, no 5xx, every start P/D-ready): {verdict(ok)}")
    path = write_result("cpu_pd_latency", {"args": vars(args), "results": results, "target_met": ok})
    print(f"results: {path}")
    print(json.dumps({"target_met": ok}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
