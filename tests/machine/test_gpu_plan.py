"""GPU planning on simulated inventories: leased, explicit and shared plans, and the checks made at configure time.

The planner is driven directly (fast, every topology); then real inner pytest sessions with the simulator show
that what the plan says is what each server gets (``CUDA_VISIBLE_DEVICES``, ``--gpu-memory-utilization``, the
staggered start) and that bad input stops the run with a usage error before any test runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_pdserve.config.cluster_settings import ClusterSettings
from pytest_pdserve.config.effective import SessionDefaults
from pytest_pdserve.errors import ClusterSpecError, ClusterUnavailable
from pytest_pdserve.glue.session_inventory import InventoryHolder
from pytest_pdserve.machine import leases
from pytest_pdserve.machine.gpu_plan import GpuPlan, GpuPlanner, explicit_ids_problem
from pytest_pdserve.machine.inventory import Inventory, simulated_inventory
from pytest_pdserve.spec import ClusterSpec

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")


@pytest.fixture
def lease_dir(tmp_path: Path) -> Path:
    return tmp_path / "leases"


@pytest.fixture
def plans() -> Iterator[list[GpuPlan]]:
    """Plans made by a test; their leases are released afterwards."""
    made: list[GpuPlan] = []
    yield made
    for plan in made:
        for lease in plan.leases:
            lease.release()


def planner(lease_dir: Path, gpus: int | Inventory, **kw: object) -> GpuPlanner:
    """A planner on ``gpus`` simulated GPUs (or that inventory) that waits at most 5 s for a lease; ``kw``: the
    session's settings (`ClusterSettings` fields, and ``gpu_memory_utilization``)."""
    inv = simulated_inventory("cuda", gpus) if isinstance(gpus, int) else gpus
    kw.setdefault("gpu_wait_timeout", 5.0)
    util = kw.pop("gpu_memory_utilization", None)
    defaults = SessionDefaults(gpu_memory_utilization=util, platform=inv.platform)  # type: ignore[arg-type]
    settings = ClusterSettings(defaults, inv, log_dir=lease_dir.parent / "logs", lease_dir=lease_dir, **kw)  # type: ignore[arg-type]
    return GpuPlanner(settings)


def devices(inv: Inventory, plan: GpuPlan) -> list[str]:
    """Each server's CUDA_VISIBLE_DEVICES, as the manager gives it."""
    return [str(inv.child_env(p)["CUDA_VISIBLE_DEVICES"]) if p else "" for p in plan.positions]


# --------------------------------------------------------------------------- leased


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (ClusterSpec(), ["0", "1"]),
        (ClusterSpec(num_prefill=2, num_decode=2), ["0", "1", "2", "3"]),
        (ClusterSpec(prefill_tp=2, decode_tp=2), ["0,1", "2,3"]),
        (ClusterSpec(num_prefill=3, num_decode=1, decode_tp=4), ["0", "1", "2", "3,4,5,6"]),
    ],
    ids=["1x1", "2x2", "tp2-tp2", "3x1-tp4"],
)
def test_every_server_gets_a_disjoint_tp_sized_slice(
    lease_dir: Path, plans: list[GpuPlan], spec: ClusterSpec, expected: list[str]
) -> None:
    gp = planner(lease_dir, 8)
    plans.append(plan := gp.plan(spec, "t"))
    assert devices(gp.inventory, plan) == expected
    assert plan.held == spec.num_gpus
    assert not plan.shared
    assert plan.utilization == (None,) * len(expected)


def test_too_few_gpus_skip_naming_the_count_and_share_gpus(lease_dir: Path) -> None:
    with pytest.raises(ClusterUnavailable, match=r"needs 2 GPUs .*1 visible.*; --pd-share-gpus .* on one GPU"):
        planner(lease_dir, 1).plan(ClusterSpec(), "t")
    # TP 2 cannot share, so the hint is not offered.
    with pytest.raises(ClusterUnavailable) as info:
        planner(lease_dir, 1).plan(ClusterSpec(decode_tp=2), "t")
    assert "share" not in str(info.value)


# --------------------------------------------------------------------------- explicit ids


@pytest.mark.parametrize(
    ("gpus", "ids", "spec", "expected"),
    [
        (2, {"decode_gpu_ids": (1,)}, ClusterSpec(), ["0", "1"]),
        (2, {"decode_gpu_ids": (0,)}, ClusterSpec(), ["1", "0"]),
        (2, {"prefill_gpu_ids": (1,)}, ClusterSpec(), ["1", "0"]),
        (4, {"prefill_gpu_ids": (0,)}, ClusterSpec(decode_tp=2), ["0", "1,2"]),
        (4, {"decode_gpu_ids": (1, 2)}, ClusterSpec(prefill_tp=2, decode_tp=2), ["0,3", "1,2"]),
        (2, {"prefill_gpu_ids": (0,), "decode_gpu_ids": (0,)}, ClusterSpec(), ["0", "0"]),
    ],
    ids=["decode-1", "decode-0", "prefill-1", "prefill-0-decode-tp2", "decode-tp2-ids", "both-pinned-share"],
)
def test_the_side_without_ids_gets_a_lease_of_other_gpus(
    lease_dir: Path, plans: list[GpuPlan], gpus: int, ids: dict[str, tuple[int, ...]], spec: ClusterSpec,
    expected: list[str],
) -> None:  # fmt: skip
    """``DECODE_GPU_ID=1`` alone: prefill must not see every GPU, it gets one leased GPU other than 1."""
    gp = planner(lease_dir, gpus, **ids)
    plans.append(plan := gp.plan(spec, "t"))
    assert devices(gp.inventory, plan) == expected
    # Every GPU a server sees is leased, so another run cannot take it meanwhile.
    seen = {p for positions in plan.positions for p in positions}
    assert {p for lease in plan.leases for p in lease.positions} == seen
    keys = [gp.inventory.gpus[p].uuid for p in sorted(seen)]
    assert leases.try_acquire_gpus(lease_dir, keys, 1, contiguous=False) is None


def test_the_side_without_ids_waits_for_or_skips_gpus_another_run_holds(lease_dir: Path) -> None:
    inv = simulated_inventory("cuda", 2)
    other = leases.acquire_gpus(lease_dir, [inv.gpus[0].uuid], 1, timeout=0)  # another run holds GPU 0
    try:
        gp = planner(lease_dir, inv, decode_gpu_ids=(1,), gpu_wait="skip")
        with pytest.raises(ClusterUnavailable, match="no 1 free GPU .*--pd-gpu-wait=skip"):
            gp.plan(ClusterSpec(), "t")
        # The pinned GPU taken before the failure went back.
        again = leases.try_acquire_gpus(lease_dir, [inv.gpus[1].uuid], 1)
        assert again is not None
        again.release()
    finally:
        other.release()


def test_the_side_without_ids_skips_when_no_other_gpu_is_visible(lease_dir: Path) -> None:
    with pytest.raises(ClusterUnavailable, match=r"prefill needs 1 GPU other than the decode GPU ids \[0\]"):
        planner(lease_dir, 1, decode_gpu_ids=(0,)).plan(ClusterSpec(), "t")


def test_explicit_ids_first_free_every_gpu_our_other_clusters_hold(lease_dir: Path, plans: list[GpuPlan]) -> None:
    """Every spec pins the same ids: the manager must stop its own clusters first, not wait for itself."""
    asked: list[int] = []
    plans.append(planner(lease_dir, 4, decode_gpu_ids=(1,)).plan(ClusterSpec(), "t", asked.append))
    assert asked == [4]


def test_explicit_ids_must_match_the_tensor_parallel_size(lease_dir: Path) -> None:
    with pytest.raises(ClusterSpecError, match=r"prefill GPU ids \[0\] .* tensor-parallel size 2: give 2 ids"):
        planner(lease_dir, 4, prefill_gpu_ids=(0,)).plan(ClusterSpec(prefill_tp=2), "t")


def test_explicit_ids_not_in_the_inventory_are_named() -> None:
    inv = simulated_inventory("cuda", 2)
    problem = explicit_ids_problem(inv, (0,), (2, 3))
    assert problem is not None
    assert problem.startswith("decode GPU ids 2, 3 (--pd-decode-gpu-ids / DECODE_GPU_ID) are not visible: 2 GPUs")
    assert explicit_ids_problem(inv, (1,), (0,)) is None
    # CPU machine: the servers run on the CPU, the ids do not apply.
    assert explicit_ids_problem(Inventory("cpu", (), None, "no nvidia-smi"), (5,), None) is None


# --------------------------------------------------------------------------- shared


def test_share_gpus_puts_every_server_on_one_leased_gpu_with_a_split_memory_fraction(
    lease_dir: Path, plans: list[GpuPlan]
) -> None:
    gp = planner(lease_dir, 1, share_gpus=True)
    plans.append(plan := gp.plan(ClusterSpec(), "t"))
    assert devices(gp.inventory, plan) == ["0", "0"]
    assert plan.shared
    assert plan.held == 1
    assert plan.utilization == (0.4, 0.4)
    plans.append(four := planner(lease_dir, 2, share_gpus=True).plan(ClusterSpec(num_prefill=2, num_decode=2), "u"))
    assert four.utilization == (0.2,) * 4
    assert four.held == 1
    assert len({p for p in four.positions}) == 1


def test_share_gpus_refuses_tensor_parallel(lease_dir: Path) -> None:
    with pytest.raises(ClusterSpecError, match="decode TP 2, but --pd-share-gpus puts every server on one GPU"):
        planner(lease_dir, 2, share_gpus=True).plan(ClusterSpec(decode_tp=2), "t")


def test_a_given_memory_fraction_wins_when_it_fits_and_is_an_error_when_not(
    lease_dir: Path, plans: list[GpuPlan]
) -> None:
    plan = planner(lease_dir, 1, share_gpus=True, gpu_memory_utilization=0.5).plan(ClusterSpec(), "t")
    assert plan.utilization == (None, None)  # the session's 0.5 reaches the servers unchanged
    plan.leases[0].release()
    with pytest.raises(ClusterSpecError, match=r"2 servers share one GPU .* 0\.6 each, 1\.2 of the GPU"):
        planner(lease_dir, 1, share_gpus=True).plan(ClusterSpec(gpu_memory_utilization=0.6), "u")
    # The failed plan's lease went back.
    plans.append(planner(lease_dir, 1, share_gpus=True).plan(ClusterSpec(), "v"))


# --------------------------------------------------------------------------- inner sessions

CLUSTER_TEST = """
import json, os

def test_cluster(pd_cluster):
    out = {}
    for s in (*pd_cluster.prefill, *pd_cluster.decode):
        argv = list(s.command.argv)
        util = argv[argv.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in argv else None
        out[s.name] = {"gpus": list(s.gpus), "cvd": s.command.env.get("CUDA_VISIBLE_DEVICES"), "util": util}
    with open(os.environ["GPU_PLAN_OUT"], "w") as fh:
        json.dump(out, fh)
"""


def run_inner(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str, env: dict[str, str] | None = None
) -> tuple[pytest.RunResult, dict[str, dict[str, object]]]:
    out = pytester.path / "servers.json"
    monkeypatch.setenv("GPU_PLAN_OUT", str(out))
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    pytester.makepyfile(test_inner=CLUSTER_TEST)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rA", "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}",
        "--pd-startup-timeout=120", *args, timeout=240,
    )  # fmt: skip
    return result, json.loads(out.read_text()) if out.exists() else {}


def test_decode_gpu_id_alone_gives_prefill_its_own_visible_device(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, servers = run_inner(pytester, monkeypatch, "--pd-simulate-gpus=2", env={"DECODE_GPU_ID": "1"})
    result.assert_outcomes(passed=1)
    assert servers["prefill-0"] == {"gpus": ["0"], "cvd": "0", "util": None}
    assert servers["decode-0"] == {"gpus": ["1"], "cvd": "1", "util": None}


def test_share_gpus_runs_the_default_cluster_on_one_gpu_staggered(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, servers = run_inner(pytester, monkeypatch, "--pd-simulate-gpus=1", env={"PDSERVE_SHARE_GPUS": "1"})
    result.assert_outcomes(passed=1)
    assert servers == {
        "prefill-0": {"gpus": ["0"], "cvd": "0", "util": "0.4"},
        "decode-0": {"gpus": ["0"], "cvd": "0", "util": "0.4"},
    }
    result.stdout.fnmatch_lines(["*pdserve: pd: servers share a GPU; starting them one after another*"])


def test_one_gpu_without_share_gpus_skips_naming_it(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result, _ = run_inner(pytester, monkeypatch, "--pd-simulate-gpus=1")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED *cluster pd needs 2 GPUs*1 visible*--pd-share-gpus*one GPU*"])


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--pd-simulate-gpus=2", "--pd-decode-gpu-ids=2"], {},
         "*decode GPU id 2 (--pd-decode-gpu-ids / DECODE_GPU_ID) is not visible: 2 GPUs (positions 0-1)*"
         "(given by --pd-decode-gpu-ids=2)*"),
        (["--pd-simulate-gpus=2"], {"PREFILL_GPU_ID": "0", "DECODE_GPU_ID": "7"},
         "*decode GPU id 7*(given by environment variable PREFILL_GPU_ID=0 and environment variable "
         "DECODE_GPU_ID=7)*"),
        (["--pd-simulate-gpus=1", "--pd-share-gpus", "--pd-gpu-memory-utilization=0.6"], {},
         "*0.6 from --pd-gpu-memory-utilization is not a valid gpu_memory_utilization: "
         "with --pd-share-gpus, 2 servers share one GPU*"
         "at most 0.5 each*"),
        (["--pd-simulate-gpus=2", "--pd-prefill-gpu-ids=1", "--pd-decode-gpu-ids=1"],
         {"GPU_MEMORY_UTILIZATION": "0.9"},
         "*from environment variable GPU_MEMORY_UTILIZATION*with the same prefill and decode GPU ids*"),
        (["--pd-simulate-gpus=2", "--pd-share-gpus"], {"DECODE_GPU_ID": "1"},
         "*--pd-share-gpus (from --pd-share-gpus) and explicit GPU ids (from environment variable "
         "DECODE_GPU_ID) both say where servers run*"),
    ],
    ids=["flag-id-missing", "env-id-missing", "share-util-too-big", "pinned-share-util-too-big", "share-and-ids"],
)  # fmt: skip
def test_bad_gpu_settings_are_usage_errors_before_any_test_runs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str], message: str
) -> None:
    result, servers = run_inner(pytester, monkeypatch, *args, env=env)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.outlines + result.errlines
    result.stderr.fnmatch_lines([f"ERROR: pdserve: {message}"])
    assert servers == {}


def test_a_crash_in_gpu_detection_is_an_error_naming_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a CPU inventory: that would skip every GPU test and leave CI green on a broken GPU machine."""

    def crash() -> Inventory:
        raise TypeError("unexpected nvidia-smi output")

    holder = InventoryHolder(crash, "platform auto")
    with pytest.raises(pytest.UsageError) as info:
        holder.get()
    text = str(info.value)
    assert text.startswith("pdserve: GPU detection (platform auto) crashed: TypeError: unexpected nvidia-smi output")
    assert "(at test_gpu_plan.py:" in text
    assert "in crash)" in text
    assert "--pd-platform=cpu" in text

    # The same inside a real session: a usage error, not a run that skips every GPU test.
    import pytest_pdserve.glue.session_inventory as session_inventory

    monkeypatch.setattr(session_inventory, "detect_inventory", lambda platform: crash())
    pytester.makepyfile("import pytest\n\n@pytest.mark.gpus(1)\ndef test_gpu():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "GPU detection (platform auto) crashed: TypeError" in "\n".join(result.errlines)
