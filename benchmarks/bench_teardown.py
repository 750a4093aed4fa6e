"""Teardown: from the end of the last test to every process of the session gone.

Inner session: one test using ``pd_cluster``. A ``pytest_runtest_call`` hook wrapper in the generated
conftest writes the moment the test call finished (the session's last test; session fixtures are torn
down after it). The test writes the pids of everything carrying its run token (P, D, proxy and any
descendant or helper that inherited ``PDSERVE_RUN_TOKEN``). The benchmark polls ``/proc`` for those pids
(every 2 ms; a zombie counts as gone) and also notes when the inner pytest process exits.

Variants: a well-behaved simulator, and one that ignores SIGTERM (``PDSERVE_SIM_IGNORE_SIGTERM=1``) with
``--pd-shutdown-timeout=2`` (expected: ~2 s of grace, then SIGKILL). A third SIGKILLs pytest the moment its test
ends, servers ignoring SIGTERM: the watchdog cleans up, timed from the kill (the README's promise: nothing alive
5 s later; the tests that kill pytest only wait for it with a loaded machine's margin).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from typing import Any

from _common import InnerProject, fmt, load_average, print_table, probe_env, proc_gone, summary, write_result

GRACE = 2.0
PYTEST_KILLED = "pytest SIGKILLed, ignores SIGTERM"

CONFTEST = r"""
import json, os, time
from pathlib import Path

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    finally:
        out = Path(os.environ["BENCH_RECORDS"], "end.json")
        out.with_suffix(".tmp").write_text(json.dumps({"mono": time.monotonic(), "wall": time.time()}))
        out.with_suffix(".tmp").replace(out)
"""

TEST = r"""
import json, os
from pathlib import Path


def _carriers(token):
    needle = f"PDSERVE_RUN_TOKEN={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_cluster(pd_cluster):
    pd_cluster.complete("hello " * 8, max_tokens=2)
    servers = {s.name: s.process.pid for s in pd_cluster.servers}
    token = pd_cluster.prefill[0].process.run_token
    Path(os.environ["BENCH_RECORDS"], "pids.json").write_text(
        json.dumps({"servers": servers, "all": sorted(set(_carriers(token)) | set(servers.values()))}))
"""


def one_round(project: InnerProject, ignore_sigterm: bool, kill_pytest: bool = False) -> dict[str, float]:
    project.clear_records()
    env = probe_env(None, BENCH_RECORDS=str(project.records))
    if ignore_sigterm:
        env["PDSERVE_SIM_IGNORE_SIGTERM"] = "1"
    argv = project.argv(f"--pd-shutdown-timeout={GRACE:g}")
    proc = subprocess.Popen(argv, cwd=project.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    end_file = project.records / "end.json"
    deadline = time.monotonic() + 120
    while not end_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise RuntimeError(f"inner session ended before its test finished (rc={proc.poll()}):\n{out[-3000:]}")
        time.sleep(0.002)
    killed_at = None
    if kill_pytest:
        proc.kill()
        killed_at = time.monotonic()
    pids = json.loads((project.records / "pids.json").read_text())
    pending = set(pids["all"])
    gone_at: dict[int, float] = {}
    while pending and time.monotonic() < deadline:
        now = time.monotonic()
        for pid in [p for p in pending if proc_gone(p)]:
            gone_at[pid] = now
            pending.discard(pid)
        time.sleep(0.002)
    output, _ = proc.communicate(timeout=120)
    exited = time.monotonic()
    if proc.returncode != (-9 if kill_pytest else 0) or pending:
        raise RuntimeError(f"rc={proc.returncode}, still alive: {sorted(pending)}\n{output.decode()[-3000:]}")
    end = killed_at if killed_at is not None else json.loads(end_file.read_text())["mono"]
    by_pid = {pid: name for name, pid in pids["servers"].items()}
    res = {"all_gone": max(gone_at.values()) - end, "pytest_exit": exited - end, "processes": float(len(gone_at))}
    for pid, t in gone_at.items():
        if pid in by_pid:
            res[f"{by_pid[pid]}_gone"] = t - end
    return res


def run(quick: bool = False) -> dict[str, Any]:
    rounds = 1 if quick else 4
    project = InnerProject("teardown")
    project.write("conftest.py", CONFTEST)
    project.write("test_teardown.py", TEST)
    load_before = load_average()
    variants = (("well-behaved", False, False), ("ignores SIGTERM", True, False), (PYTEST_KILLED, True, True))
    samples: dict[str, dict[str, list[float]]] = {name: {} for name, _, _ in variants}
    try:
        for _ in range(rounds):
            for name, ignore, kill in variants:
                for k, v in one_round(project, ignore, kill).items():
                    samples[name].setdefault(k, []).append(v)
    finally:
        project.cleanup()
    stats = {name: {k: summary(v) for k, v in s.items()} for name, s in samples.items()}
    rows = []
    for name, s in stats.items():
        rows.append([
            name, fmt(s["all_gone"], "s", 1, 3), fmt(s["prefill-0_gone"], "s", 1, 3), fmt(s["proxy_gone"], "s", 1, 3),
            fmt(s["pytest_exit"], "s", 1, 3), int(s["processes"]["median"]),
        ])  # fmt: skip
    print_table(
        f"Teardown: last test finished -> processes gone ({rounds} rounds each; --pd-shutdown-timeout={GRACE:g})",
        ["server", "all gone", "prefill gone", "proxy gone", "pytest exited", "processes"],
        rows,
    )
    data = {"grace_s": GRACE, "load_before": load_before, "load_after": load_average(), "stats": stats,
            "samples": samples}  # fmt: skip
    print(f"-> {write_result('teardown', data)}")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round per variant")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
