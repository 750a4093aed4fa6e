"""The plugin's start of a real-vLLM-for-CPU P/D pair against a bare ``vllm serve`` pair with the same flags.

Each round, in alternating order (the machine is shared and noisy: CI has 2 cores):

  plugin  an inner pytest session whose one test asks for ``pd_cluster`` (``--pd-engine=vllm``); it records each
          server's argv and environment as the plugin built them, the moment it spawned them, the moment it
          noticed both ready (GET /health + /v1/models), and ``started_seconds`` (spawn -> the test body gets
          the cluster: the proxy and the P/D-ready proof request included)
  bare    the same two ``vllm serve`` argv and environment (on top of this environment without PDSERVE_/VLLM_
          variables), spawned together by this script, polled every 0.1 s on GET /health until both answer 200

overhead = plugin (spawn -> both noticed) - bare (spawn -> both healthy): what the plugin's own start adds to
vLLM's; ``started_seconds`` - bare adds the proxy and the proof request a bare pair does not have. The inner
pytest's wall time is printed too (its import, collection, tiny model look-up and teardown included).

    PDSERVE_VLLM_EXECUTABLE=.venv-vllm/bin/vllm .venv/bin/python benchmarks/bench_vllm_start.py [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from _common import CLUSTER_RECORD_TEST, InnerProject, clean_env, fmt, load_average, print_table, summary, write_result

START_LIMIT = 900.0  # seconds: a start on a loaded 2-core machine has taken up to ~200 s


def plugin_round(project: InnerProject, exe: str) -> dict[str, Any]:
    """One inner pytest session (one real P/D pair); seconds, and the servers' argv/env for the bare round."""
    project.clear_records()
    # The plugin's cache (the tiny model) is kept: a first build would be billed to the first round.
    cache = {k: os.environ[k] for k in ("PDSERVE_CACHE_DIR",) if k in os.environ}
    env = clean_env(BENCH_RECORDS=str(project.records), **cache)
    t0 = time.monotonic()
    project.run_argv(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "--rootdir", str(project.path),
         "--pd-engine=vllm", f"--pd-vllm-executable={exe}", f"--pd-lease-dir={project.lease_dir}"],
        env=env, timeout=START_LIMIT + 300,
    )  # fmt: skip
    wall = time.monotonic() - t0
    rec = json.loads((project.records / "cluster.json").read_text())
    servers = [s for s in rec["servers"] if s["name"] in ("prefill-0", "decode-0")]
    spawn = min(s["started_at"] for s in servers)
    noticed = max(s["started_at"] + s["ready_seconds"] for s in servers)
    return {"servers_ready": noticed - spawn, "started_seconds": rec["started_seconds"], "pytest_wall": wall,
            "servers": servers}  # fmt: skip


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def bare_round(servers: list[dict[str, Any]], work: Path) -> float:
    """Both servers spawned together with the plugin's argv/env; seconds until both answer /health."""
    procs = []
    t0 = time.monotonic()
    for s in servers:
        env = clean_env()
        for k, v in s["env"].items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        log = (work / f"bare-{s['name']}.log").open("wb")
        procs.append(subprocess.Popen(s["argv"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
    try:
        waiting = {s["url"] for s in servers}
        while waiting:
            if time.monotonic() - t0 > START_LIMIT:
                raise RuntimeError(f"bare vllm serve not healthy after {START_LIMIT:g} s (logs in {work})")
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a bare vllm serve exited {[p.returncode for p in procs]} (logs in {work})")
            waiting = {u for u in waiting if not _healthy(u)}
            if waiting:
                time.sleep(0.1)
        return time.monotonic() - t0
    finally:
        for p in procs:
            with_group(p, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with_group(p, signal.SIGKILL)
                p.wait()


def with_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the server's own process group (vLLM's engine core and worker are its children)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def run(rounds: int, exe: str) -> dict[str, Any]:
    load_before = load_average()
    work = Path(tempfile.mkdtemp(prefix="pdbench-vllm-start-"))
    project = InnerProject("vllm-start")
    project.write("test_cluster.py", CLUSTER_RECORD_TEST)
    samples: dict[str, list[float]] = {}
    try:
        servers: list[dict[str, Any]] | None = None
        for n in range(rounds):
            # Alternate which goes first; the first round needs the plugin's argv, so it starts with the plugin.
            order = ["plugin", "bare"] if n % 2 == 0 or servers is None else ["bare", "plugin"]
            for what in order:
                if what == "plugin":
                    got = plugin_round(project, exe)
                    servers = got.pop("servers")
                    for k, v in got.items():
                        samples.setdefault(k, []).append(v)
                else:
                    assert servers is not None
                    samples.setdefault("bare", []).append(bare_round(servers, work))
                print(f"  round {n + 1} {what}: done (load {load_average()[0]:.2f})", file=sys.stderr, flush=True)
    finally:
        project.cleanup()
    stats = {k: summary(v) for k, v in samples.items()}
    pairs = list(zip(samples["servers_ready"], samples["bare"], strict=False))
    overhead = summary([p - b for p, b in pairs])
    rows = [
        ["bare `vllm serve` P+D: spawn -> both /health 200", fmt(stats["bare"], "s", 1, 1)],
        ["plugin: spawn -> both noticed ready", fmt(stats["servers_ready"], "s", 1, 1)],
        ["  overhead (paired, plugin - bare)", fmt(overhead, "s", 1, 1)],
        ["plugin: spawn -> test body (proxy + P/D proof request)", fmt(stats["started_seconds"], "s", 1, 1)],
        ["plugin: whole inner pytest session, wall", fmt(stats["pytest_wall"], "s", 1, 1)],
    ]
    la = load_average()
    print_table(
        f"Real vLLM for CPU, 1P x 1D start: plugin vs bare vllm serve ({rounds} rounds each; median [p10-p90]; "
        f"load {load_before[0]:.2f} -> {la[0]:.2f} on {os.cpu_count()} cores)",
        ["measure", "time"], rows,
    )  # fmt: skip
    data = {"rounds": rounds, "samples": samples, "stats": stats, "overhead": overhead, "load_before": load_before,
            "load_after": la, "argv": [s["argv"] for s in servers or []]}  # fmt: skip
    print(f"-> {write_result('vllm_start', data)}")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (default 3; each start ~1-3 min)")
    args = parser.parse_args()
    exe = os.environ.get("PDSERVE_VLLM_EXECUTABLE", "vllm")
    run(args.rounds, exe)


if __name__ == "__main__":
    main()
