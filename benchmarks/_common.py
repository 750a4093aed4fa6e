"""Shared helpers for the benchmarks: statistics, tables, JSON results, machine facts, inner pytest runs.

Every benchmark measures its ratios *within one run* (interleaving the variants where it can), because
the machine is noisy: CI has 2 cores and other test sessions run at the same time. Numbers are reported
as median with p10/p90 so one slow sample does not move the headline.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
PROBE_DIR = BENCH_DIR / "_probe"
#: Set for a child python: its uvicorn server writes ``<dir>/<pid>.json`` the moment it starts serving.
READY_DIR_ENV = "PDSERVE_BENCH_READY_DIR"

# Variables of the caller's environment that would change what an inner pytest or a server does.
_SCRUB_PREFIXES = ("PDSERVE_", "PYTEST_", "VLLM_", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without pdserve/pytest/vLLM settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES)}
    env.pop("PYTHONPATH", None)
    # Users' Pythons cache bytecode; a session that sets PYTHONDONTWRITEBYTECODE would bill every run for
    # compiling the plugin (and the simulator) from source, which no user pays.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(extra)
    return env


#: Set for a child python: sockets handed to uvicorn pre-bound get TCP_NODELAY (the sim's Nagle stall, see docs).
NODELAY_ENV = "PDSERVE_BENCH_SIM_NODELAY"


def probe_env(ready_dir: Path | None, *, nodelay: bool = True, **extra: str) -> dict[str, str]:
    """``clean_env`` plus the probe (a ``sitecustomize`` on PYTHONPATH, inert unless its variables are set).

    :param ready_dir: where servers record the moment they start serving (None: not recorded).
    :param nodelay: work around the simulator's missing TCP_NODELAY (a ~40 ms stall per keep-alive JSON answer).
    """
    probe = {READY_DIR_ENV: str(ready_dir)} if ready_dir is not None else {}
    if nodelay:
        probe[NODELAY_ENV] = "1"
    return clean_env(PYTHONPATH=str(PROBE_DIR), **probe, **extra)


def ready_moments(ready_dir: Path) -> dict[int, dict[str, Any]]:
    """``{pid: record}`` written by the probe (``mono`` is CLOCK_MONOTONIC, comparable across processes)."""
    out: dict[int, dict[str, Any]] = {}
    for path in ready_dir.glob("*.json"):
        rec = json.loads(path.read_text())
        out[int(rec["pid"])] = rec
    return out


# ------------------------------------------------------------------------------------------- statistics


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]) of a non-empty sequence."""
    if not values:
        raise ValueError("quantile of an empty sample")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: Iterable[float]) -> dict[str, float]:
    """n, median, p10, p90, p99, min, max, mean of a sample."""
    v = list(values)
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "median": statistics.median(v),
        "p10": quantile(v, 0.10),
        "p90": quantile(v, 0.90),
        "p99": quantile(v, 0.99),
        "min": min(v),
        "max": max(v),
        "mean": statistics.fmean(v),
    }


def fmt(s: Mapping[str, float], unit: str = "ms", scale: float = 1000.0, digits: int = 1) -> str:
    """``median [p10-p90] unit`` for a summary (seconds scaled to ms by default)."""
    if not s.get("n"):
        return "n/a"
    m, lo, hi = (s[k] * scale for k in ("median", "p10", "p90"))
    return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}] {unit}".rstrip()


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain aligned text table on stdout."""
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n== {title}")
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------- machine


def load_average() -> tuple[float, float, float]:
    """1/5/15-minute load averages."""
    return os.getloadavg()


def machine() -> dict[str, Any]:
    """Date, CPU count and model, load, Python: the context every number needs."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    uptime = ""
    if shutil.which("uptime"):
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "loadavg": load_average(),
        "uptime": uptime,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def write_result(name: str, data: Mapping[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` (with machine facts) and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **data}, indent=2, default=str))
    return path


# ------------------------------------------------------------------------------------------ inner pytest

INNER_INI = """[pytest]
addopts = -p no:cacheprovider
timeout = 600
"""


class InnerProject:
    """A throwaway directory with its own ``pytest.ini`` (so the repo's config is not picked up) and lease dir."""

    def __init__(self, prefix: str) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"pdbench-{prefix}-"))
        (self.path / "pytest.ini").write_text(INNER_INI)
        self.lease_dir = self.path / "leases"
        self.records = self.path / "records"
        self.records.mkdir()
        self.last_cpu = 0.0

    def write(self, name: str, text: str) -> Path:
        p = self.path / name
        p.write_text(text)
        return p

    def argv(self, *args: str, plugin: bool = True) -> list[str]:
        base = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "--rootdir", str(self.path)]
        if plugin:
            base += ["--pd-engine=sim", "--pd-simulate-gpus=8", f"--pd-lease-dir={self.lease_dir}"]
        return base + list(args)

    def run(self, *args: str, env: Mapping[str, str] | None = None, plugin: bool = True, timeout: float = 300) -> float:
        """Run pytest here; return its wall time. Raises with the output tail if it fails."""
        return self.run_argv(self.argv(*args, plugin=plugin), env=env, timeout=timeout)

    def run_argv(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 300) -> float:
        """Run ``argv`` (a pytest command line of the caller's own) here; as :meth:`run`."""
        t0 = time.monotonic()
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(
            list(argv), cwd=self.path, env=dict(env or clean_env()), capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
        wall = time.monotonic() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        #: CPU seconds (user + sys) of the run and its reaped children: far less sensitive to load than wall time.
        self.last_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        if proc.returncode != 0:
            raise RuntimeError(
                f"inner pytest {' '.join(argv)} in {self.path} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                f"{proc.stderr[-2000:]}"
            )
        return wall

    def read_records(self) -> list[dict[str, Any]]:
        out = [json.loads(p.read_text()) for p in sorted(self.records.glob("*.json"))]
        return out

    def clear_records(self) -> None:
        for p in self.records.glob("*.json"):
            p.unlink()

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def proc_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs: no /proc entry, or a zombie/dead state awaiting its reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 :][:1] in (b"Z", b"X")


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("MET" if ok else "MISSED")


#: The inner test of the start benchmarks (bench_startup.py, bench_vllm_start.py): when `pd_cluster` yielded, and each
#: server's start, argv and env, into $BENCH_RECORDS/cluster.json.
CLUSTER_RECORD_TEST = r"""
import json, os, time
from pathlib import Path


def test_cluster(pd_cluster):
    t_yield = time.monotonic()
    servers = []
    for s in pd_cluster.servers:
        p = s.process
        servers.append({
            "name": s.name, "pid": p.pid, "started_at": p.started_at, "ready_seconds": s.ready_seconds,
            "argv": list(s.command.argv) if s.command else list(p.argv),
            "env": dict(s.command.env) if s.command else {}, "url": s.url,
        })
    rec = {"t_yield": t_yield, "started_seconds": pd_cluster.started_seconds, "model": pd_cluster.model,
           "pd_ready_seconds": pd_cluster.pd_ready_seconds, "servers": servers}
    Path(os.environ["BENCH_RECORDS"], "cluster.json").write_text(json.dumps(rec))
"""
