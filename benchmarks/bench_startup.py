"""Readiness overhead and parallel start, against a stand-in whose ready moment is known.

The stand-in is ``pdserve-sim`` with ``PDSERVE_SIM_STARTUP_DELAY`` (like vLLM it binds its port at once but
only listens after "loading"). The probe in ``_probe/sitecustomize.py`` records, inside each server, the
CLOCK_MONOTONIC moment uvicorn starts serving: that is "the server answers /health".

Part A, poll loops (one standalone sim per round, all three loops watching the same server at once):
  plugin            process.wait_all_ready (GET /health + /v1/models, then the poll interval's sleep)
  RemoteOpenAIServer-style   GET /health, 0.5 s sleep on connection error (``_remote_poll.py``)
  bash scripts      ``until curl -s localhost:PORT/v1/completions; do sleep 1; done`` (``_curl_poll.sh``)
  latency = moment the loop saw the server ready - moment the server started serving.

Part B, the fixture (inner pytest with one test asking for ``pd_cluster``):
  overhead = moment the test body starts (fixture yielded) - moment *both* P and D serve.
  Broken down: poll detection, then the start's checks (the read-back and the P/D-ready round trip, run at once;
  the round trip's own seconds are ``pd_cluster.pd_ready_seconds``); "beyond one round trip" is the overhead minus
  that round trip (target: 5 ms). The proxy starts with the servers: its spawn -> serving is shown for reference.

Part C, parallel start (same rounds as B): P and D are then started alone, one after the other, with the
argv/env the plugin used; ratio = cluster time / slower of the two alone.

Part D, a crash at startup noticed: a process that prints its CLOCK_MONOTONIC moment and exits 3 a moment after
its start; latency = the moment ``wait_ready`` raised ``ServerExitedEarly`` - the moment it exited. (The tests only
check that the crash is noticed long before the deadline: tests/running/test_process.py.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    BENCH_DIR,
    CLUSTER_RECORD_TEST,
    InnerProject,
    clean_env,
    fmt,
    load_average,
    print_table,
    probe_env,
    ready_moments,
    summary,
    write_result,
)

from pytest_pdserve.errors import ServerExitedEarly
from pytest_pdserve.running.process import POLL_INTERVAL_S, ServerProcess, new_run_token

STARTUP_DELAY = 2.0


def _sim_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "pytest_pdserve.sim", "serve", "pdserve-sim/tiny-llama", "--port", str(port)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll_loops_round(work: Path, delay: float, nodelay: bool = True) -> dict[str, float]:
    """One standalone sim watched by the three loops; latencies in seconds."""
    ready_dir = Path(tempfile.mkdtemp(dir=work))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ServerProcess(
        "sim", _sim_argv(port), probe_env(ready_dir, nodelay=nodelay, PDSERVE_SIM_STARTUP_DELAY=str(delay)),
        work / f"sim-{port}.log",
        health_url=f"{url}/health", models_url=f"{url}/v1/models", model_id="pdserve-sim/tiny-llama",
        run_token=new_run_token(),
    )  # fmt: skip
    curl_out, remote_out = ready_dir / "curl.out", ready_dir / "remote.out"
    proc.start()
    env = clean_env()
    curl = subprocess.Popen([str(BENCH_DIR / "_curl_poll.sh"), str(port), str(curl_out)], env=env)
    remote = subprocess.Popen(
        [sys.executable, str(BENCH_DIR / "_remote_poll.py"), f"{url}/health", str(remote_out)], env=env
    )
    try:
        proc.wait_ready(time.monotonic() + 60)
        plugin_seen = proc.started_at + proc.ready_seconds()
        curl.wait(timeout=60)
        remote.wait(timeout=60)
        ready = ready_moments(ready_dir)[proc.pid or 0]
        return {
            "plugin": plugin_seen - ready["mono"],
            "remote_openai_server": float(remote_out.read_text()) - ready["mono"],
            "bash_curl": float(curl_out.read_text()) - ready["wall"],
        }
    finally:
        for p in (curl, remote):
            if p.poll() is None:
                p.kill()
                p.wait()
        proc.stop(grace=5)


#: Part D's crashing process: its exit moment (CLOCK_MONOTONIC, one clock for every process), then exit 3.
CRASHER = "import time; time.sleep(0.3); print('EXITING_AT', time.monotonic(), flush=True); raise SystemExit(3)"


def crash_round(work: Path) -> float:
    """Seconds from a starting process's exit to ``wait_ready`` raising for it."""
    port = _free_port()
    proc = ServerProcess(
        "crasher", [sys.executable, "-c", CRASHER], clean_env(), work / f"crash-{port}.log",
        health_url=f"http://127.0.0.1:{port}/health", run_token=new_run_token(),
    )  # fmt: skip
    proc.start()
    try:
        proc.wait_ready(time.monotonic() + 60)
    except ServerExitedEarly:
        noticed = time.monotonic()
    else:
        raise AssertionError("the crasher became ready")
    finally:
        proc.stop(grace=0)
    exited = next(
        float(line.split()[1]) for line in proc.log_path.read_text().splitlines() if line.startswith("EXITING_AT")
    )
    return noticed - exited


def _alone(work: Path, server: dict[str, Any], model: str, delay: float) -> float | None:
    """Start one server alone with the plugin's argv/env; seconds from spawn to detected ready."""
    env = probe_env(None, PDSERVE_SIM_STARTUP_DELAY=str(delay))  # same probe/TCP_NODELAY as in the cluster
    for k, v in server["env"].items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    url = server["url"]
    proc = ServerProcess(
        server["name"], server["argv"], env, work / f"alone-{server['name']}.log", health_url=f"{url}/health",
        models_url=f"{url}/v1/models", model_id=model, run_token=new_run_token(),
    )  # fmt: skip
    try:
        proc.start()
    except Exception as exc:  # PortInUse: another session took the port meanwhile; drop this sample
        print(f"  (alone {server['name']} skipped: {exc})", file=sys.stderr)
        return None
    try:
        return proc.wait_ready(time.monotonic() + 60)
    finally:
        proc.stop(grace=5)


def fixture_round(project: InnerProject, work: Path, delay: float) -> dict[str, float]:
    """One inner pytest session; then P and D alone. Seconds."""
    ready_dir = Path(tempfile.mkdtemp(dir=work))
    project.clear_records()
    env = probe_env(ready_dir, PDSERVE_SIM_STARTUP_DELAY=str(delay), BENCH_RECORDS=str(project.records))
    project.run(env=env)
    rec = json.loads((project.records / "cluster.json").read_text())
    moments = ready_moments(ready_dir)
    by_name = {s["name"]: s for s in rec["servers"]}
    p, d, proxy = by_name["prefill-0"], by_name["decode-0"], by_name["proxy"]
    serving = max(moments[p["pid"]]["mono"], moments[d["pid"]]["mono"])
    detected = max(s["started_at"] + s["ready_seconds"] for s in (p, d))
    proxy_serving = moments[proxy["pid"]]["mono"]
    proxy_detected = proxy["started_at"] + proxy["ready_seconds"]
    spawn = min(p["started_at"], d["started_at"])
    out = {
        "yield_overhead": rec["t_yield"] - serving,
        "poll_detect": detected - serving,
        "proxy_spawn_to_serving": proxy_serving - proxy["started_at"],
        "proxy_serving_to_detected": proxy_detected - proxy_serving,
        "detected_to_proxy_spawn": proxy["started_at"] - detected,
        "proxy_detected_to_yield": rec["t_yield"] - proxy_detected,
        "detected_to_yield": rec["t_yield"] - detected,
        "pd_round_trip": rec["pd_ready_seconds"] or 0.0,
        "beyond_round_trip": rec["t_yield"] - serving - (rec["pd_ready_seconds"] or 0.0),
        "proxy_serving_before_servers": serving - proxy_serving,
        "cluster_servers_ready": detected - spawn,
        "cluster_started_seconds": rec["started_seconds"],
    }
    alone = [_alone(work, s, rec["model"], delay) for s in (p, d)]
    if all(a is not None for a in alone):
        slower = max(a for a in alone if a is not None)
        out["alone_slower"] = slower
        out["ratio_servers"] = out["cluster_servers_ready"] / slower
        out["ratio_fixture"] = out["cluster_started_seconds"] / slower
    return out


def run(quick: bool = False) -> dict[str, Any]:
    rounds_a = 2 if quick else 8
    rounds_b = 2 if quick else 6
    delay = 1.0 if quick else STARTUP_DELAY
    load_before = load_average()
    work = Path(tempfile.mkdtemp(prefix="pdbench-startup-"))
    loops: dict[str, list[float]] = {"plugin": [], "remote_openai_server": [], "bash_curl": []}
    for _ in range(rounds_a):
        for k, v in poll_loops_round(work, delay).items():
            loops[k].append(v)
    # The simulator as shipped (no TCP_NODELAY): the plugin's /v1/models check waits for a delayed ACK.
    as_shipped = [poll_loops_round(work, delay, nodelay=False)["plugin"] for _ in range(1 if quick else 3)]
    project = InnerProject("startup")
    project.write("test_cluster.py", CLUSTER_RECORD_TEST)
    fixture: dict[str, list[float]] = {}
    try:
        for _ in range(rounds_b):
            for k, v in fixture_round(project, work, delay).items():
                fixture.setdefault(k, []).append(v)
    finally:
        project.cleanup()
    crashes = [crash_round(work) for _ in range(3 if quick else 10)]
    stats_loops = {k: summary(v) for k, v in loops.items()}
    stats_fixture = {k: summary(v) for k, v in fixture.items()}
    print_table(
        f"Readiness: poll-loop latency after the server starts serving (sim, startup delay {delay:g}s, "
        f"{rounds_a} rounds; median [p10-p90])",
        ["loop", "latency"],
        [
            [f"pytest-pdserve wait_all_ready ({POLL_INTERVAL_S * 1000:g} ms)", fmt(stats_loops["plugin"])],
            ["  same, sim as shipped (no TCP_NODELAY)", fmt(summary(as_shipped))],
            ["RemoteOpenAIServer-style (0.5 s)", fmt(stats_loops["remote_openai_server"])],
            ["bash curl loop (1 s)", fmt(stats_loops["bash_curl"])],
        ],
    )
    rows = [
        ["both servers serving -> fixture yields (TARGET <= 50 ms)", fmt(stats_fixture["yield_overhead"])],
        ["  servers serving -> plugin notices", fmt(stats_fixture["poll_detect"])],
        ["  noticed -> test body starts (checks, ready line)", fmt(stats_fixture["detected_to_yield"])],
        ["  of which the P/D-ready round trip (beside the read-back)", fmt(stats_fixture["pd_round_trip"])],
        ["  overhead beyond one round trip (TARGET <= 5 ms)", fmt(stats_fixture["beyond_round_trip"])],
        ["  proxy spawned -> proxy serving (with the servers)", fmt(stats_fixture["proxy_spawn_to_serving"])],
        ["  proxy serving before both servers by", fmt(stats_fixture["proxy_serving_before_servers"])],
    ]
    print_table(f"Readiness: pd_cluster fixture ({rounds_b} sessions)", ["interval", "time"], rows)
    if "ratio_servers" in stats_fixture:
        print_table(
            "Parallel start: cluster / slower of P and D alone (TARGET <= 1.05)",
            ["measure", "value"],
            [
                ["P+D spawn -> both noticed", fmt(stats_fixture["cluster_servers_ready"], "s", 1, 2)],
                ["slower of P, D alone", fmt(stats_fixture["alone_slower"], "s", 1, 2)],
                ["ratio, servers only", fmt(stats_fixture["ratio_servers"], "", 1, 3)],
                ["pd_cluster started_seconds (incl. proxy)", fmt(stats_fixture["cluster_started_seconds"], "s", 1, 2)],
                ["ratio, fixture (incl. proxy)", fmt(stats_fixture["ratio_fixture"], "", 1, 3)],
            ],
        )
    print_table(
        f"A crash at startup: the process exited -> wait_ready raised ({len(crashes)} rounds)",
        ["interval", "time"],
        [["exit -> ServerExitedEarly (TARGET <= 50 ms)", fmt(summary(crashes))]],
    )
    data = {
        "crash_noticed": {"samples": crashes, "stats": summary(crashes)},
        "startup_delay_s": delay,
        "load_before": load_before,
        "load_after": load_average(),
        "poll_loops": {"samples": loops, "stats": stats_loops, "plugin_sim_as_shipped": summary(as_shipped)},
        "fixture": {"samples": fixture, "stats": stats_fixture},
    }
    print(f"-> {write_result('startup', data)}")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, 1 s startup delay")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
