"""Run every benchmark and print the target table.

    .venv/bin/python benchmarks/run_all.py            # full run (about 5 minutes on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick    # smoke run (about 1.5 minutes)
    .venv/bin/python benchmarks/run_all.py --only proxy,teardown

Each benchmark also runs alone (``python benchmarks/bench_proxy.py [--quick]``). Results go to
``benchmarks/results/<name>.json`` (gitignored) and ``summary.json``; docs/benchmarks.md explains them.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import bench_bash_way
import bench_collection
import bench_proxy
import bench_reuse
import bench_startup
import bench_teardown
import bench_xdist
from _common import machine, print_table, verdict, write_result

BENCHMARKS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "startup": bench_startup.run,
    "collection": bench_collection.run,
    "proxy": bench_proxy.run,
    "xdist": bench_xdist.run,
    "teardown": bench_teardown.run,
    "bash_way": bench_bash_way.run,
    "reuse": bench_reuse.run,
}


def targets(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """One row per target: what, measured, target, verdict."""
    rows: list[list[str]] = []
    if "startup" in results:
        f = results["startup"]["fixture"]["stats"]
        loops = results["startup"]["poll_loops"]["stats"]
        y = f["yield_overhead"]["median"] * 1e3
        rows.append(["1 readiness: servers serving -> fixture yields", f"{y:.0f} ms", "<= 50 ms", verdict(y <= 50)])
        d = f["poll_detect"]["median"] * 1e3
        rows.append(["1   of which: poll notices both servers", f"{d:.0f} ms", "-", ""])
        if "beyond_round_trip" in f:
            b, rt = f["beyond_round_trip"]["median"] * 1e3, f["pd_round_trip"]["median"] * 1e3
            rows.append(["1   beyond one P/D round trip (the round trip)", f"{b:.0f} ms ({rt:.0f} ms)", "<= 5 ms",
                         verdict(b <= 5)])  # fmt: skip
        rows.append([
            "1   poll loops plugin / RemoteOpenAIServer / bash",
            " / ".join(f"{loops[k]['median'] * 1e3:.0f}" for k in ("plugin", "remote_openai_server", "bash_curl"))
            + " ms", "-", "",
        ])  # fmt: skip
        if "ratio_fixture" in f:
            r = f["ratio_fixture"]["median"]
            rows.append(["2 parallel start: pd_cluster / slower alone", f"{r:.3f}", "<= 1.05", verdict(r <= 1.05)])
            r = f["ratio_servers"]["median"]
            rows.append(["2   servers only (P+D, no proxy) / slower alone", f"{r:.3f}", "<= 1.05", verdict(r <= 1.05)])
    if "collection" in results:
        c = results["collection"]
        r, pr = c["stats"]["ratio_of_medians"], c["stats"]["paired_ratio"]["median"]
        rows.append(["3 collection wall: with plugin / -p no:pdserve", f"{r:.3f} (paired {pr:.3f})", "<= 1.05",
                     verdict(r <= 1.05)])  # fmt: skip
        sr, spr = c["stats"]["stub_ratio"], c["stats"]["stub_paired_ratio"]["median"]
        rows.append(
            [
                "3   plugin / a conftest with the same fixtures",
                f"{sr:.3f} (paired {spr:.3f})",
                "<= 1.05",
                verdict(sr <= 1.05),
            ]
        )
        r = c["stats"]["cpu_ratio"]
        rows.append(["3   same, CPU time (user+sys)", f"{r:.3f}", "<= 1.05", verdict(r <= 1.05)])
        bad = c["forbidden_imported"]
        rows.append(["3   torch/vllm imported at collection", ", ".join(bad) or "none", "none", verdict(not bad)])
    if "proxy" in results:
        o = results["proxy"]["overhead"]
        stats = results["proxy"]["stats"]
        for mode in ("json", "stream"):
            b, ref = o[f"builtin/{mode}"], o[f"reference/{mode}"]
            rows.append([
                f"4 proxy p50 overhead, {mode} (p99)",
                f"{b['p50_overhead_ms']:+.2f} ms ({b['p99_overhead_ms']:+.1f})", "<= 2 ms",
                verdict(b["p50_overhead_ms"] <= 2),
            ])  # fmt: skip
            bi, re_ = stats[f"builtin/{mode}"]["median"] * 1e3, stats[f"reference/{mode}"]["median"] * 1e3
            rows.append([
                f"4   builtin vs reference p50, {mode}", f"{bi:.2f} vs {re_:.2f} ms (ref overhead "
                f"{ref['p50_overhead_ms']:+.2f})", "builtin <= ref (+5% noise)", verdict(bi <= re_ * 1.05),
            ])  # fmt: skip
        cpu = results["proxy"]["cpu_ms_per_request"]
        both = f"{cpu['builtin']:.2f} / {cpu['reference']:.2f} ms"
        rows.append(["4   proxy CPU per request builtin / reference", both, "-", ""])
    if "xdist" in results:
        x = results["xdist"]
        bad = [v for r in x["runs"].values() for v in r["violations"]]
        rows.append([f"5 xdist speedup -n {x['workers']} vs -n 1", f"{x['speedup']:.2f}x", ">= 3x",
                     verdict(x["speedup"] >= 3)])  # fmt: skip
        rows.append(["5   GPU shared between concurrent tests", "; ".join(bad) or "never", "never", verdict(not bad)])
    if "teardown" in results:
        t = results["teardown"]["stats"]
        for name in ("well-behaved", "ignores SIGTERM"):
            rows.append([
                f"6 teardown, {name}: all gone (pytest exit)",
                f"{t[name]['all_gone']['median']:.2f} s ({t[name]['pytest_exit']['median']:.2f} s)", "-", "",
            ])  # fmt: skip
        killed = t[bench_teardown.PYTEST_KILLED]["all_gone"]["max"]
        rows.append([f"6 teardown, {bench_teardown.PYTEST_KILLED}: all gone after the kill (worst)",
                     f"{killed:.2f} s", "<= 5 s", verdict(killed <= 5)])  # fmt: skip
    if "bash_way" in results:
        b = results["bash_way"]
        r = b["ratio_total"]
        rows.append(["7 vLLM's modules: bash way / plugin, wall (sim)", f"{r:.2f}x", ">= 3x", verdict(r >= 3)])
        h = b["harness_ratio_total"]
        rows.append(["7   harness only (wall minus the module's own run)", f"{h:.1f}x", "-", ""])
        for module, ratio in b["ratios"].items():
            rows.append([f"7   {module}", f"{ratio:.2f}x", "-", ""])
    if "reuse" in results:
        r = results["reuse"]
        s = r["stats"]
        rows.append([
            "8 --pd-reuse: second run, start to first test body (max)",
            f"{s['second run']['max']:.2f} s vs {s['no cluster']['median']:.2f} s with no cluster", "within 1 s",
            verdict(r["target_met"]),
        ])  # fmt: skip
        rows.append(["8   first run (starts and keeps the cluster)", f"{s['first run']['median']:.2f} s", "-", ""])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description="Run the pytest-pdserve benchmarks.")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke run, numbers are rough")
    parser.add_argument("--only", default="", help=f"comma list of {','.join(BENCHMARKS)}")
    args = parser.parse_args()
    chosen = [b.strip() for b in args.only.split(",") if b.strip()] or list(BENCHMARKS)
    unknown = [b for b in chosen if b not in BENCHMARKS]
    if unknown:
        parser.error(f"--only {args.only!r}: unknown {unknown}; choose from {', '.join(BENCHMARKS)}")
    start = machine()
    print(f"machine: {start['nproc']} x {start['cpu_model']}; {start['uptime']}")
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    t0 = time.monotonic()
    for name in chosen:
        t = time.monotonic()
        try:
            results[name] = BENCHMARKS[name](args.quick)
        except Exception:
            failed[name] = traceback.format_exc()
            print(f"benchmark {name} FAILED:\n{failed[name]}", file=sys.stderr)
        print(f"[{name}: {time.monotonic() - t:.0f}s]")
    end = machine()
    rows = targets(results)
    print_table(
        f"Targets ({'quick' if args.quick else 'full'} run, {time.monotonic() - t0:.0f}s; load "
        f"{start['loadavg'][0]:.1f} -> {end['loadavg'][0]:.1f} on {end['nproc']} cores)",
        ["measure", "measured (median)", "target", "verdict"],
        rows,
    )
    path = write_result("summary", {"quick": args.quick, "machine_at_start": start, "targets": rows,
                                    "failed": failed})  # fmt: skip
    print(f"-> {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
