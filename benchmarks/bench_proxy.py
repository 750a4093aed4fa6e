"""Proxy overhead: latency through the built-in proxy and through a reference proxy, vs doing the flow directly.

Setup: two ``pdserve-sim`` servers (prefill, decode; NixlConnector argv from the plugin's command builder),
the built-in proxy (``python -m pytest_pdserve.proxy``) and ``reference_proxy.py`` (vLLM's toy-proxy flow on
Starlette + httpx), all on 127.0.0.1 over real HTTP.

Paths, each with its own keep-alive ``httpx.Client``, interleaved request by request (so load spikes hit all):
  direct     the client itself POSTs the prefill request (max_tokens=1, kv_transfer_params), then the decode
             request with the returned kv_transfer_params, sequentially on ONE keep-alive client;
  builtin    one POST to the built-in proxy (which does the same two requests);
  reference  one POST to the reference proxy.
Latency = send of the first byte to receipt of the last byte of the final answer (for streams: ``[DONE]``).
overhead(proxy) = latency(proxy) - latency(direct); reported as the difference of medians (p50) and p99s, and
as the median of per-round paired differences.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import BENCH_DIR, fmt, load_average, print_table, probe_env, summary, write_result

from pytest_pdserve.cluster import SIM_VERSION
from pytest_pdserve.config import commands
from pytest_pdserve.config.commands import EngineInfo, Role, ServerPorts, SessionDefaults
from pytest_pdserve.config.effective import effective
from pytest_pdserve.proxy.app import prefill_body
from pytest_pdserve.running.process import ServerProcess, new_run_token, wait_all_ready
from pytest_pdserve.spec import ClusterSpec

MODEL = "pdserve-sim/tiny-llama"
MAX_TOKENS = 8
FILLER = "the quick brown fox jumps over the lazy dog " * 6
PATHS = ("direct", "builtin", "reference")


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


class Stack:
    """P, D, built-in proxy and reference proxy, started together and stopped together."""

    def __init__(self, work: Path, nodelay: bool) -> None:
        token = new_run_token()
        engine = EngineInfo("sim", (sys.executable, "-m", "pytest_pdserve.sim"), SIM_VERSION)
        ports = _free_ports(8)
        self.procs: list[ServerProcess] = []
        self.urls: dict[str, str] = {}
        roles: tuple[Role, Role] = ("prefill", "decode")
        for i, role in enumerate(roles):
            cmd = commands.build_server_command(
                spec=ClusterSpec(), role=role, index=0, model=MODEL,
                ports=ServerPorts(ports[3 * i], ports[3 * i + 1], ports[3 * i + 2]), engine=engine,
                asked=effective(ClusterSpec(), SessionDefaults()), gpu_env={},
            )  # fmt: skip
            env = probe_env(None, nodelay=nodelay)
            env.update({k: v for k, v in cmd.env.items() if v is not None})
            url = f"http://127.0.0.1:{ports[3 * i]}"
            self.urls[role] = url
            self.procs.append(
                ServerProcess(
                    role,
                    cmd.argv,
                    env,
                    work / f"{role}.log",
                    health_url=f"{url}/health",
                    models_url=f"{url}/v1/models",
                    model_id=MODEL,
                    run_token=token,
                )  # fmt: skip
            )
        up = ["--prefill", self.urls["prefill"], "--decode", self.urls["decode"]]
        for name, argv, port in (
            ("builtin", [sys.executable, "-m", "pytest_pdserve.proxy", "--host", "127.0.0.1"], ports[6]),
            ("reference", [sys.executable, str(BENCH_DIR / "reference_proxy.py"), "--host", "127.0.0.1"], ports[7]),
        ):
            url = f"http://127.0.0.1:{port}"
            self.urls[name] = url
            self.procs.append(
                ServerProcess(
                    name,
                    [*argv, "--port", str(port), *up],
                    probe_env(None, nodelay=nodelay),
                    work / f"{name}.log",
                    health_url=f"{url}/health",
                    run_token=token,
                )  # fmt: skip
            )

    def __enter__(self) -> Stack:
        try:
            for p in self.procs:
                p.start()
            wait_all_ready(self.procs, time.monotonic() + 120)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.stop(grace=5)


def _body(tag: str, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"{tag} {FILLER}", "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream}


def _finish(resp: httpx.Response, stream: bool) -> None:
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
    if stream and not resp.content.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"stream did not end with [DONE]: {resp.content[-200:]!r}")


def _post(client: httpx.Client, url: str, body: dict[str, Any], stream: bool) -> httpx.Response:
    if not stream:
        return client.post(url, json=body)
    with client.stream("POST", url, json=body) as resp:
        resp.read()  # every chunk, up to [DONE]
    return resp


def one(clients: dict[str, httpx.Client], urls: dict[str, str], path: str, tag: str, stream: bool) -> float:
    """One request along ``path``; seconds."""
    body = _body(tag, stream)
    client = clients[path]
    t0 = time.perf_counter()
    if path == "direct":
        p = client.post(urls["prefill"] + "/v1/completions", json=prefill_body(body))
        if p.status_code != 200:
            raise RuntimeError(f"prefill HTTP {p.status_code}: {p.text[:300]}")
        body["kv_transfer_params"] = p.json().get("kv_transfer_params")
        resp = _post(client, urls["decode"] + "/v1/completions", body, stream)
    else:
        resp = _post(client, urls[path] + "/v1/completions", body, stream)
    elapsed = time.perf_counter() - t0
    _finish(resp, stream)
    return elapsed


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (seconds, clock-tick resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    work: Path, n: int, nodelay: bool, modes: tuple[bool, ...] = (False, True), cpu: dict[str, float] | None = None
) -> dict[str, list[float]]:
    """``{"<path>/<json|stream>": [seconds, ...]}``, n each, interleaved in a shuffled order per round.

    :param cpu: filled with each process's CPU milliseconds per recorded request through it (load-independent).
    """
    samples: dict[str, list[float]] = {f"{p}/{'stream' if s else 'json'}": [] for p in PATHS for s in modes}
    rng = random.Random(0)
    work.mkdir(parents=True, exist_ok=True)
    with Stack(work, nodelay) as stack:
        before: dict[str, float] = {}
        clients = {p: httpx.Client(trust_env=False, timeout=30) for p in PATHS}
        try:
            combos = [(p, s) for p in PATHS for s in modes]
            for i in range(-20, n):  # 20 warm-up rounds, not recorded
                if i == 0:
                    before = {p.name: cpu_seconds(p.pid or 0) for p in stack.procs}
                rng.shuffle(combos)
                for path, stream in combos:
                    dt = one(clients, stack.urls, path, f"r{i}-{path}-{stream}", stream)
                    if i >= 0:
                        samples[f"{path}/{'stream' if stream else 'json'}"].append(dt)
            if cpu is not None:
                # Each proxy handled n * len(modes) requests; P and D served all three paths.
                for p in stack.procs:
                    per = n * len(modes) * (len(PATHS) if p.name in ("prefill", "decode") else 1)
                    cpu[p.name] = (cpu_seconds(p.pid or 0) - before[p.name]) * 1000 / per
        finally:
            for c in clients.values():
                c.close()
    return samples


def _paired(a: list[float], b: list[float]) -> dict[str, float]:
    return summary([x - y for x, y in zip(a, b, strict=True)])


def run(quick: bool = False) -> dict[str, Any]:
    n = 100 if quick else 1000
    load_before = load_average()
    work = Path(tempfile.mkdtemp(prefix="pdbench-proxy-"))
    cpu: dict[str, float] = {}
    samples = measure(work, n, nodelay=True, cpu=cpu)
    shipped = measure(work / "as-shipped", 30 if quick else 100, nodelay=False, modes=(False,)) if not quick else {}
    stats = {k: summary(v) for k, v in samples.items()}
    rows = []
    result: dict[str, Any] = {}
    for mode in ("json", "stream"):
        direct = stats[f"direct/{mode}"]
        for path in PATHS:
            s = stats[f"{path}/{mode}"]
            row = [f"{path}/{mode}", f"{s['median'] * 1e3:.2f}", f"{s['p90'] * 1e3:.2f}", f"{s['p99'] * 1e3:.2f}"]
            if path == "direct":
                row += ["-", "-", "-"]
            else:
                paired = _paired(samples[f"{path}/{mode}"], samples[f"direct/{mode}"])
                result[f"{path}/{mode}"] = {
                    "p50_overhead_ms": (s["median"] - direct["median"]) * 1e3,
                    "p99_overhead_ms": (s["p99"] - direct["p99"]) * 1e3,
                    "paired_overhead": paired,
                }
                row += [
                    f"{(s['median'] - direct['median']) * 1e3:+.2f}",
                    f"{(s['p99'] - direct['p99']) * 1e3:+.2f}",
                    fmt(paired, "ms", 1000, 2),
                ]
            rows.append(row)
    print_table(
        f"Proxy overhead ({n} requests per row, interleaved; max_tokens={MAX_TOKENS}; latencies in ms; "
        "overhead = proxy - direct, direct = client does prefill then decode itself on one keep-alive client; "
        "TARGET p50 overhead <= 2 ms, builtin <= reference)",
        ["path/mode", "p50", "p90", "p99", "p50 overhead", "p99 overhead", "paired overhead median [p10-p90]"],
        rows,
    )
    print_table(
        "CPU time per request (ms, from /proc utime+stime; independent of load)",
        ["process", "CPU ms / request"],
        [[k, f"{v:.2f}"] for k, v in cpu.items()],
    )
    shipped_stats = {k: summary(v) for k, v in shipped.items()}
    if shipped:
        print_table(
            "Same, simulator as shipped (no TCP_NODELAY; keep-alive JSON answers wait for a delayed ACK)",
            ["path/mode", "latency"],
            [[k, fmt(v, "ms", 1000, 2)] for k, v in shipped_stats.items()],
        )
    data = {
        "requests_per_row": n,
        "max_tokens": MAX_TOKENS,
        "load_before": load_before,
        "load_after": load_average(),
        "stats": stats,
        "overhead": result,
        "sim_as_shipped": shipped_stats,
        "cpu_ms_per_request": cpu,
        "reference": "Starlette + httpx (FastAPI not installed), toy_proxy_server.py flow",
        "http_impl": _http_impl(),
        "samples": samples,
    }
    print(f"-> {write_result('proxy', data)}")
    return data


def _http_impl() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(bool(u.find_spec('httptools')), "
         "bool(u.find_spec('uvloop')))"],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    httptools, uvloop = (x == "True" for x in out) if len(out) == 2 else (False, False)
    return f"uvicorn {'httptools' if httptools else 'h11'} / {'uvloop' if uvloop else 'asyncio'} loop"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 requests per row, no as-shipped run")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
