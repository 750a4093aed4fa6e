"""Collection overhead: ``pytest --collect-only -q`` over 2,000 generated tests, with the plugin vs ``-p no:pdserve``.

20 modules x 100 tests; half the tests ask for ``pd_cluster`` (collection resolves fixture closures), the rest
are plain. Runs alternate (with, without, with, ...) so drifting load hits both; ratio = median(with) /
median(without), plus the median of per-pair ratios. A ``pytest_collection_finish`` hook in the generated
conftest writes which heavy modules are in ``sys.modules`` once collection is done (must be none of torch/vllm).

A third variant, ``-p no:pdserve -p stub_fixtures``, defines ``pd_cluster`` and ``pd_cluster_factory`` as empty
session fixtures: without the plugin pytest finds no such fixture and skips resolving it, so "with / stub" is the
plugin's own cost against any conftest that provides the same fixtures (what a hand-written harness would pay).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from _common import InnerProject, clean_env, fmt, load_average, print_table, summary, write_result

MODULES = 20
PER_MODULE = 100
STUB_FIXTURES = """
import pytest


@pytest.fixture(scope="session")
def pd_cluster_factory(request):
    return None


@pytest.fixture(scope="session")
def pd_cluster(pd_cluster_factory):
    return None
"""
HEAVY = ("torch", "vllm", "httpx", "starlette", "uvicorn", "prometheus_client", "numpy", "transformers")

CONFTEST = f"""
import json, os, sys


def pytest_collection_finish(session):
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
    roots = sorted({{m.split(".")[0] for m in heavy}})
    out = os.path.join(os.environ["BENCH_RECORDS"], "modules-%s.json" % os.getpid())
    with open(out, "w") as fh:
        json.dump({{"collected": len(session.items), "heavy_roots": roots,
                   "pdserve_loaded": session.config.pluginmanager.has_plugin("pdserve")}}, fh)
"""


def _module(i: int) -> str:
    lines = ["import pytest", ""]
    for j in range(PER_MODULE):
        if j % 2:
            lines += [f"def test_plain_{i}_{j}():", "    assert True", ""]
        else:
            lines += [f"def test_cluster_{i}_{j}(pd_cluster):", "    assert pd_cluster", ""]
    return "\n".join(lines)


def run(quick: bool = False) -> dict[str, Any]:
    pairs = 3 if quick else 9
    project = InnerProject("collect")
    project.write("conftest.py", CONFTEST)
    project.write("stub_fixtures.py", STUB_FIXTURES)
    for i in range(MODULES):
        project.write(f"test_gen_{i:02d}.py", _module(i))
    env = clean_env(BENCH_RECORDS=str(project.records))
    load_before = load_average()
    times: dict[str, list[float]] = {"with": [], "without": [], "stub": []}
    cpu: dict[str, list[float]] = {"with": [], "without": [], "stub": []}
    stub_args = ("--collect-only", "-p", "no:pdserve", "-p", "stub_fixtures")
    records: dict[str, dict[str, Any]] = {}
    try:
        project.run("--collect-only", env=env)  # warm the bytecode caches of both variants
        project.run("--collect-only", "-p", "no:pdserve", env=env, plugin=False)
        project.run(*stub_args, env=env, plugin=False)
        for _ in range(pairs):
            for variant in ("with", "without", "stub"):
                project.clear_records()
                if variant == "with":
                    times[variant].append(project.run("--collect-only", env=env))
                elif variant == "without":
                    times[variant].append(project.run("--collect-only", "-p", "no:pdserve", env=env, plugin=False))
                else:
                    times[variant].append(project.run(*stub_args, env=env, plugin=False))
                cpu[variant].append(project.last_cpu)
                rec = json.loads(next(project.records.glob("modules-*.json")).read_text())
                records[variant] = rec
    finally:
        project.cleanup()
    s_with, s_without = summary(times["with"]), summary(times["without"])
    ratio = s_with["median"] / s_without["median"]
    paired = summary([a / b for a, b in zip(times["with"], times["without"], strict=True)])
    c_with, c_without = summary(cpu["with"]), summary(cpu["without"])
    cpu_ratio = c_with["median"] / c_without["median"]
    s_stub = summary(times["stub"])
    stub_ratio = s_with["median"] / s_stub["median"]
    stub_paired = summary([a / b for a, b in zip(times["with"], times["stub"], strict=True)])
    heavy = records["with"]["heavy_roots"]
    forbidden = [m for m in heavy if m in ("torch", "vllm")]
    print_table(
        f"Collection: pytest --collect-only -q, {MODULES * PER_MODULE} tests ({pairs} alternating pairs; "
        "TARGET ratio <= 1.05, no torch/vllm import)",
        ["measure", "value"],
        [
            ["with plugin", fmt(s_with, "s", 1, 3)],
            ["-p no:pdserve", fmt(s_without, "s", 1, 3)],
            ["ratio of medians", f"{ratio:.3f}"],
            ["paired ratio median [p10-p90]", fmt(paired, "", 1, 3)],
            ["CPU time (user+sys) with / without", f"{fmt(c_with, 's', 1, 3)} / {fmt(c_without, 's', 1, 3)}"],
            ["CPU time ratio of medians", f"{cpu_ratio:.3f}"],
            ["-p no:pdserve + stub pd_cluster fixtures", fmt(s_stub, "s", 1, 3)],
            ["ratio with / stub (the plugin's own cost)", f"{stub_ratio:.3f} (paired {fmt(stub_paired, '', 1, 3)})"],
            [
                "plugin loaded (with / without)",
                f"{records['with']['pdserve_loaded']} / {records['without']['pdserve_loaded']}",
            ],
            ["collected (with / without)", f"{records['with']['collected']} / {records['without']['collected']}"],
            ["heavy modules after collection (with plugin)", ", ".join(heavy) or "none"],
            ["torch/vllm imported", ", ".join(forbidden) or "no"],
        ],
    )
    data = {
        "tests": MODULES * PER_MODULE,
        "load_before": load_before,
        "load_after": load_average(),
        "seconds": times,
        "cpu_seconds": cpu,
        "stats": {
            "with": s_with,
            "without": s_without,
            "ratio_of_medians": ratio,
            "paired_ratio": paired,
            "cpu_with": c_with,
            "cpu_without": c_without,
            "cpu_ratio": cpu_ratio,
            "stub": s_stub,
            "stub_ratio": stub_ratio,
            "stub_paired_ratio": stub_paired,
        },
        "heavy_modules_with_plugin": heavy,
        "heavy_modules_without_plugin": records["without"]["heavy_roots"],
        "forbidden_imported": forbidden,
        "records": records,
    }
    print(f"-> {write_result('collection', data)}")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 pairs instead of 7")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
