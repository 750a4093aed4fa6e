"""Helpers for tests/gpu (see its conftest): the inner sessions' conftest, nvidia-smi's GPU list, output parsing."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

#: Options every inner session gets: the simulator, bounded waits, our own log dir.
INNER_ARGS = ("-p", "no:cacheprovider", "-v", "-rA", "--pd-engine=sim", "--pd-startup-timeout=180",
              "--pd-gpu-wait-timeout=120", "--pd-shutdown-timeout=10")  # fmt: skip

#: A module in the inner session's directory: what a GPU-mode cluster's servers report about themselves.
INNER_HELPERS = r"""
import json, os, subprocess, time

import httpx

GPU_ENV = {"PDSERVE_SIM_GPU": "1"}


def compute_apps(memory=False):
    # [pid, uuid] (and used MiB with memory=True) of every compute process nvidia-smi lists.
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    rows = [[f.strip() for f in line.split(",")] for line in out.splitlines()]
    return [[int(r[0]), r[1], *([r[2]] if memory else [])] for r in rows if len(r) == 3 and r[0].isdigit()]


def describe(cluster):
    # What each server says about itself at GET /version, next to what pdserve gave it.
    servers = []
    for s in (*cluster.prefill, *cluster.decode):
        sim = httpx.get(f"{s.url}/version", timeout=30, trust_env=False).json()["pdserve_sim"]
        device = sim.get("device") or {}
        argv = list(s.command.argv) if s.command is not None else []
        util = argv[argv.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in argv else None
        servers.append({
            "name": s.name, "url": s.url, "handle_gpus": list(s.gpus), "pid": sim["pid"],
            "uuid": device.get("uuid"), "device_name": device.get("name"), "cvd": sim["cuda_visible_devices"],
            "ready_seconds": s.ready_seconds, "log": str(s.log_path), "gpu_memory_utilization": util,
        })
    return {
        "servers": servers, "started_seconds": cluster.started_seconds, "apps": compute_apps(),
        "apps_mib": compute_apps(memory=True),
        "wall": time.time(), "worker": os.environ.get("PYTEST_XDIST_WORKER", "master"),
        "caller_cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def record(name, data):
    # Write ``data`` as ``$PROOF_DIR/<name>.json``, atomically (another worker may be polling for it).
    out = os.path.join(os.environ["PROOF_DIR"], f"{name}.json")
    with open(out + ".tmp", "w") as fh:
        json.dump(data, fh, indent=1)
    os.rename(out + ".tmp", out)
"""

#: The inner sessions' conftest: the ``gpu_cluster`` fixture (1P x 1D, simulator in GPU mode).
INNER_CONFTEST = """
import pytest

from gpuinner import GPU_ENV
from pytest_pdserve.spec import ClusterSpec


@pytest.fixture
def gpu_cluster(pd_cluster_factory):
    return pd_cluster_factory(ClusterSpec(env=GPU_ENV, name="gpu"))
"""


@dataclass
class PhysicalGpus:
    """``nvidia-smi --query-gpu=index,uuid --format=csv,noheader``: the truth the servers' UUIDs are held to."""

    raw: str
    uuids: list[str]

    @property
    def share_args(self) -> list[str]:
        """``--pd-share-gpus`` on a one-GPU machine (both servers on it), nothing where each gets its own."""
        return ["--pd-share-gpus"] if len(self.uuids) == 1 else []

    def by_token(self, token: str) -> str:
        """The UUID a ``CUDA_VISIBLE_DEVICES`` token names (an index or a full UUID)."""
        if token.isdigit():
            return self.uuids[int(token)]
        assert token in self.uuids, f"token {token!r} is no UUID nvidia-smi lists: {self.uuids}"
        return token


@dataclass
class Inner:
    """An inner pytest session in ``pytester.path``, with the GPU conftest and evidence kept."""

    pytester: pytest.Pytester
    monkeypatch: pytest.MonkeyPatch
    proof_dir: Path
    label: str
    results: Path = field(init=False)
    runs: int = 0

    def __post_init__(self) -> None:
        self.results = self.pytester.path / "proof"
        self.results.mkdir()
        self.pytester.makeconftest(INNER_CONFTEST)
        self.pytester.makepyfile(gpuinner=INNER_HELPERS)

    def args(self, *extra: str) -> list[str]:
        """The inner command line: :data:`INNER_ARGS`, a kept log dir, then ``extra``."""
        self.runs += 1
        logs = self.proof_dir / "logs" / f"{self.label}-{self.runs}"
        return [*INNER_ARGS, f"--pd-log-dir={logs}", *extra]

    def env(self, cvd: str | None) -> dict[str, str]:
        """The inner session's environment: ours, ``PROOF_DIR``, and ``CUDA_VISIBLE_DEVICES`` when given."""
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env["PROOF_DIR"] = str(self.results)
        if cvd is not None:
            env["CUDA_VISIBLE_DEVICES"] = cvd
        return env

    def run(self, *extra: str, cvd: str | None = None, timeout: float = 300) -> pytest.RunResult:
        """Run the inner session (``CUDA_VISIBLE_DEVICES=cvd`` when given) and keep its output."""
        self.monkeypatch.setenv("PROOF_DIR", str(self.results))
        if cvd is None:
            self.monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            self.monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
        args = self.args(*extra)
        t0 = time.monotonic()
        try:
            result = self.pytester.runpytest_subprocess(*args, timeout=timeout)
        finally:
            self.monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        self.keep(args, cvd, time.monotonic() - t0, "\n".join(result.outlines + result.errlines))
        return result

    def keep(self, args: list[str], cvd: str | None, seconds: float, output: str) -> None:
        """Append an inner session's output to ``inner-runs.log``."""
        with (self.proof_dir / "inner-runs.log").open("a", encoding="utf-8") as fh:
            fh.write(f"\n===== {self.label} run {self.runs}: CUDA_VISIBLE_DEVICES={cvd!r} pytest {' '.join(args)}"
                     f" ({seconds:.1f}s)\n{output}\n")  # fmt: skip

    @property
    def last_log_dir(self) -> Path:
        """The latest inner session's own log directory under its ``--pd-log-dir`` (``<time>-<pid>``, or
        ``xdist-<run id>`` holding one directory per worker): ``pdserve.log`` and server logs."""
        base = self.proof_dir / "logs" / f"{self.label}-{self.runs}"
        [run] = [p for p in base.iterdir() if p.is_dir()]
        return run

    def read(self, name: str) -> dict[str, Any]:
        """What the inner test recorded under ``name``."""
        path = self.results / f"{name}.json"
        assert path.exists(), f"the inner test recorded no {name}.json; see {self.proof_dir / 'inner-runs.log'}"
        data: dict[str, Any] = json.loads(path.read_text())
        return data


def find_line(lines: list[str], pattern: str) -> re.Match[str]:
    """The first match of ``pattern`` in ``lines`` (assertion error quoting the output when none)."""
    for line in lines:
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matches {pattern!r} in:\n" + "\n".join(lines[-60:]))


def ready_seconds(lines: list[str]) -> float:
    """Seconds from the plugin's ``pdserve: cluster ... ready in X s`` line."""
    return float(find_line(lines, r"pdserve: cluster .* ready in ([0-9.]+)s").group(1))


def gate_seconds(lines: list[str]) -> list[float]:
    """Every ``GPUs [...] released after a X s gate`` duration the plugin reported."""
    found = [re.search(r"GPUs \[.*\] released after a ([0-9.]+)s gate", line) for line in lines]
    return [float(m.group(1)) for m in found if m]
