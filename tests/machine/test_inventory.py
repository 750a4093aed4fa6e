"""Inventory detection against real H200 outputs (tests/data/h200x2) and ROCm outputs written from the
tools' documented formats (tests/data/rocm)."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from pytest_pdserve.errors import InventoryError
from pytest_pdserve.machine.gpu_probe import (
    AMD_SMI_LIST,
    NVIDIA_QUERY_APPS,
    NVIDIA_QUERY_GPU,
    CommandResult,
    Gpu,
    SystemPaths,
    gpu_processes,
    parse_amd_smi_list,
    parse_compute_apps,
    parse_kfd_topology,
    parse_nvidia_query_gpu,
    parse_rocm_smi_json,
    pids_off_gpus,
    run_command,
)
from pytest_pdserve.machine.inventory import (
    Inventory,
    detect_inventory,
    parse_simulate_gpus,
    select_visible,
    simulated_inventory,
)

H200 = Path(__file__).parents[1] / "data" / "h200x2"
ROCM = Path(__file__).parents[1] / "data" / "rocm"
UUID0 = "GPU-fefa1f67-af19-aea2-0552-784dbde5e9bf"
UUID1 = "GPU-58cd8ead-6b31-0b20-5811-d70ec0f63feb"


class FakeRunner:
    """Answers tool argv with recorded outputs; an argv it does not know is "not installed"."""

    def __init__(self, outputs: Mapping[tuple[str, ...], CommandResult]) -> None:
        self.outputs = dict(outputs)
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str]) -> CommandResult | None:
        self.calls.append(tuple(argv))
        return self.outputs.get(tuple(argv))


def ok(text: str) -> CommandResult:
    return CommandResult(0, text, "")


def no_paths(tmp_path: Path) -> SystemPaths:
    return SystemPaths(tmp_path / "no-proc", tmp_path / "no-kfd", tmp_path / "no-nodes")


@pytest.fixture
def h200_runner() -> FakeRunner:
    return FakeRunner({NVIDIA_QUERY_GPU: ok((H200 / "query-gpu.csv").read_text())})


def h200(tmp_path: Path, runner: FakeRunner, environ: Mapping[str, str]) -> Inventory:
    return detect_inventory(environ=environ, runner=runner, paths=no_paths(tmp_path))


# --------------------------------------------------------------------------- CUDA


def test_parse_real_h200_query() -> None:
    gpus = parse_nvidia_query_gpu((H200 / "query-gpu.csv").read_text())
    assert [(g.index, g.uuid, g.name, g.memory_mib, g.memory_used_mib) for g in gpus] == [
        (0, UUID0, "NVIDIA H200", 143771, 0),
        (1, UUID1, "NVIDIA H200", 143771, 0),
    ]
    assert [g.pci_bus_id for g in gpus] == ["00000000:00:06.0", "00000000:00:07.0"]


def test_detects_cuda_with_one_nvidia_smi_call(tmp_path: Path, h200_runner: FakeRunner) -> None:
    inv = h200(tmp_path, h200_runner, {})
    assert (inv.platform, inv.count, inv.source, inv.selector_var) == ("cuda", 2, "nvidia-smi", None)
    assert h200_runner.calls == [NVIDIA_QUERY_GPU]
    assert inv.describe() == "cuda: 2 GPUs NVIDIA H200 x2 [nvidia-smi]"


def _cvd_cases() -> list[tuple[str, list[str]]]:
    """cvd.txt: ``CVD=[value]`` then ``<count> [uuids torch saw]`` for each value."""
    lines = (H200 / "cvd.txt").read_text().splitlines()
    cases = []
    for head, seen in zip(lines[::2], lines[1::2], strict=True):
        value = head.removeprefix("CVD=[").removesuffix("]")
        count, _, uuids = seen.partition(" ")
        expected = [f"GPU-{u}" for u in ast.literal_eval(uuids)]
        assert int(count) == len(expected)
        cases.append((value, expected))
    return cases


@pytest.mark.parametrize(("value", "expected"), _cvd_cases())
def test_cuda_visible_devices_matches_what_cuda_saw_on_the_h200(
    tmp_path: Path, h200_runner: FakeRunner, value: str, expected: list[str]
) -> None:
    inv = h200(tmp_path, h200_runner, {"CUDA_VISIBLE_DEVICES": value})
    assert [g.uuid for g in inv.gpus] == expected
    assert inv.visibility == f"CUDA_VISIBLE_DEVICES={value}"


def test_cvd_reorders_and_child_env_uses_the_callers_indices(tmp_path: Path, h200_runner: FakeRunner) -> None:
    inv = h200(tmp_path, h200_runner, {"CUDA_VISIBLE_DEVICES": "1,0"})
    assert inv.describe() == "cuda: 2 GPUs (CUDA_VISIBLE_DEVICES=1,0) NVIDIA H200 x2 [nvidia-smi]"
    assert inv.child_env([0]) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert inv.child_env([1, 0]) == {"CUDA_VISIBLE_DEVICES": "0,1"}


@pytest.mark.parametrize(
    ("value", "uuids", "note"),
    [
        ("GPU-58cd", [UUID1], ""),  # a unique prefix, as CUDA accepts
        (f"{UUID1},0", [UUID1, UUID0], ""),
        (" 1 , 0 ", [UUID1, UUID0], ""),
        ("1,7,0", [UUID1], "'7' is index 7 but only 2 GPU(s) exist"),
        ("0,0,1", [UUID0], "'0' repeats an earlier entry"),
        ("-1", [], "'-1' is neither a GPU index nor a GPU UUID"),
        ("GPU-", [], "neither"),
        ("", [], "CUDA_VISIBLE_DEVICES is empty, which hides every GPU"),
        ("GPU-x,0", [], "'GPU-x' matches no GPU UUID"),
    ],
)
def test_cvd_rules(tmp_path: Path, h200_runner: FakeRunner, value: str, uuids: list[str], note: str) -> None:
    inv = h200(tmp_path, h200_runner, {"CUDA_VISIBLE_DEVICES": value})
    assert [g.uuid for g in inv.gpus] == uuids
    assert note in inv.note
    assert bool(inv.note) == bool(note)


def test_uuid_selection_gives_children_the_uuid(tmp_path: Path, h200_runner: FakeRunner) -> None:
    inv = h200(tmp_path, h200_runner, {"CUDA_VISIBLE_DEVICES": "GPU-58cd"})
    assert inv.child_env([0]) == {"CUDA_VISIBLE_DEVICES": UUID1}


def test_ambiguous_uuid_prefix_stops_parsing() -> None:
    gpus = [Gpu(0, "GPU-aa11", "x", None, "0"), Gpu(1, "GPU-aa22", "x", None, "1")]
    visible, note = select_visible(gpus, "CUDA_VISIBLE_DEVICES", "GPU-aa,1")
    assert visible == []
    assert "is a prefix of 2 GPU UUIDs" in note


def test_mixed_gpu_models_give_children_uuids(tmp_path: Path) -> None:
    text = "0, GPU-aaaa, NVIDIA A100, 0:1:0.0, 40000, 1\n1, GPU-bbbb, NVIDIA L4, 0:2:0.0, 23000, 1\n"
    runner = FakeRunner({NVIDIA_QUERY_GPU: ok(text)})
    inv = detect_inventory(environ={}, runner=runner, paths=no_paths(tmp_path))
    assert inv.child_env([1]) == {"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}
    assert "CUDA_DEVICE_ORDER" in inv.note
    ordered = detect_inventory(environ={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, runner=runner, paths=no_paths(tmp_path))
    assert ordered.child_env([1]) == {"CUDA_VISIBLE_DEVICES": "1"}


def test_child_env_rejects_bad_positions(tmp_path: Path, h200_runner: FakeRunner) -> None:
    inv = h200(tmp_path, h200_runner, {})
    with pytest.raises(InventoryError, match="position 2 is out of range: 2 GPUs visible"):
        inv.child_env([2])
    with pytest.raises(InventoryError, match="given twice"):
        inv.child_env([0, 0])


def write_proc_nvidia(root: Path) -> Path:
    """The driver's /proc files for the H200 pair (bus ids from devnodes.txt)."""
    for bus, uuid in (("0000:00:07.0", UUID1), ("0000:00:06.0", UUID0)):
        (root / bus).mkdir(parents=True)
        (root / bus / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 0\nGPU UUID: \t {uuid}\nVideo BIOS: \t ??.??.??.??.??\n"
            f"Bus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {bus}\n"
            "Device Minor: \t 0\nGPU Excluded:\t No\n"
        )
    return root


def test_driver_files_when_nvidia_smi_fails(tmp_path: Path) -> None:
    failing = CommandResult(9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", "")
    runner = FakeRunner({NVIDIA_QUERY_GPU: failing})
    paths = SystemPaths(write_proc_nvidia(tmp_path / "gpus"), tmp_path / "kfd", tmp_path / "nodes")
    inv = detect_inventory(environ={"CUDA_VISIBLE_DEVICES": "1"}, runner=runner, paths=paths)
    assert inv.platform == "cuda"
    assert [g.uuid for g in inv.gpus] == [UUID1]
    assert "nvidia-smi failed: NVIDIA-SMI has failed" in inv.source
    assert str(tmp_path / "gpus") in inv.source


def test_nothing_found_is_cpu(tmp_path: Path) -> None:
    runner = FakeRunner({})
    inv = detect_inventory(environ={"CUDA_VISIBLE_DEVICES": "0"}, runner=runner, paths=no_paths(tmp_path))
    assert (inv.platform, inv.count) == ("cpu", 0)
    assert inv.source == "no nvidia-smi, no /dev/kfd"
    assert inv.describe() == "cpu: no GPUs (no nvidia-smi, no /dev/kfd)"
    assert AMD_SMI_LIST in runner.calls  # ROCm tools were tried too


def test_forced_platforms(tmp_path: Path, h200_runner: FakeRunner) -> None:
    paths = no_paths(tmp_path)
    assert detect_inventory("cpu", environ={}, runner=h200_runner, paths=paths).count == 0
    assert h200_runner.calls == []  # forced cpu runs no tool
    forced_cuda = detect_inventory("cuda", environ={}, runner=FakeRunner({}), paths=paths)
    assert (forced_cuda.platform, forced_cuda.count) == ("cuda", 0)
    forced_rocm = detect_inventory("rocm", environ={}, runner=h200_runner, paths=paths)
    assert (forced_rocm.platform, forced_rocm.count) == ("rocm", 0)
    assert NVIDIA_QUERY_GPU not in h200_runner.calls


def test_run_command_missing_tool_and_timeout() -> None:
    assert run_command(["pdserve-no-such-tool-xyz"]) is None
    result = run_command(["sleep", "5"], timeout=0.2)  # timing: the timeout under test; the command outlasts it
    assert result is not None
    assert (result.returncode, result.stderr) == (-1, "timed out after 0.2s")


# --------------------------------------------------------------------------- compute apps


def test_parse_real_compute_apps() -> None:
    assert parse_compute_apps((H200 / "compute-apps.csv").read_text()) == [(563, UUID1, 2426)]


def test_compute_apps_edge_cases() -> None:
    assert parse_compute_apps("No running processes found\n\n") == []
    assert parse_compute_apps(f"12, {UUID0}, [N/A]\n") == [(12, UUID0, None)]
    runner = FakeRunner({NVIDIA_QUERY_APPS: ok((H200 / "compute-apps.csv").read_text())})
    assert gpu_processes(runner) == [(563, UUID1, 2426)]
    assert gpu_processes(FakeRunner({})) is None
    assert gpu_processes(FakeRunner({NVIDIA_QUERY_APPS: CommandResult(9, "", "")})) is None


def test_release_gate_rule_holds_only_when_none_of_our_pids_is_on_those_gpus() -> None:
    runner = FakeRunner({NVIDIA_QUERY_APPS: ok((H200 / "compute-apps.csv").read_text())})  # pid 563 on UUID1
    assert not pids_off_gpus({UUID1}, {563}, runner)
    assert pids_off_gpus({UUID0}, {563}, runner)  # ours, but on another GPU
    assert pids_off_gpus({UUID1}, {564}, runner)  # that GPU, but another process
    assert pids_off_gpus({UUID1}, {563}, FakeRunner({}))  # no nvidia-smi: nothing to wait on


# --------------------------------------------------------------------------- ROCm

ROCM_UUIDS = ["GPU-18f68e602b8a790f", "GPU-2a4b7c1d9e3f5a60"]


def test_parse_kfd_topology_skips_cpu_nodes() -> None:
    gpus = parse_kfd_topology(ROCM / "sysfs" / "nodes")
    assert [(g.index, g.uuid, g.name, g.pci_bus_id, g.memory_mib) for g in gpus] == [
        (0, ROCM_UUIDS[0], "gfx942", "0000:0c:00.0", 196288),
        (1, ROCM_UUIDS[1], "gfx942", "0000:22:00.0", 196288),
    ]


def test_parse_rocm_smi_json() -> None:
    gpus = parse_rocm_smi_json((ROCM / "rocm-smi.json").read_text())
    assert [(g.uuid, g.name, g.memory_mib, g.memory_used_mib) for g in gpus] == [
        (ROCM_UUIDS[0], "AMD Instinct MI300X", 196288, 279),
        (ROCM_UUIDS[1], "AMD Instinct MI300X", 196288, 12288),
    ]


def test_parse_amd_smi_list_orders_by_kfd_node() -> None:
    gpus = parse_amd_smi_list((ROCM / "amd-smi-list.json").read_text())
    assert [(g.index, g.pci_bus_id) for g in gpus] == [(0, "0000:0c:00.0"), (1, "0000:22:00.0")]
    swapped = json.dumps([{"gpu": 0, "bdf": "b", "node_id": 3}, {"gpu": 1, "bdf": "a", "node_id": 2}])
    assert [g.pci_bus_id for g in parse_amd_smi_list(swapped)] == ["a", "b"]


def rocm_paths(tmp_path: Path) -> SystemPaths:
    kfd = tmp_path / "kfd"
    kfd.write_text("")
    return SystemPaths(tmp_path / "no-proc", kfd, ROCM / "sysfs" / "nodes")


@pytest.mark.parametrize(
    ("environ", "uuids", "selector", "child"),
    [
        ({}, ROCM_UUIDS, "HIP_VISIBLE_DEVICES", "1"),
        ({"HIP_VISIBLE_DEVICES": "1"}, ROCM_UUIDS[1:], "HIP_VISIBLE_DEVICES", "1"),
        ({"CUDA_VISIBLE_DEVICES": "1,0"}, ROCM_UUIDS[::-1], "CUDA_VISIBLE_DEVICES", "0"),
        # ROCR filters first; HIP's index 0 is then physical GPU 1, which a lone selector must name as 1
        (
            {"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0"},
            ROCM_UUIDS[1:],
            "HIP_VISIBLE_DEVICES",
            "1",
        ),
        ({"ROCR_VISIBLE_DEVICES": "0,1"}, ROCM_UUIDS, "ROCR_VISIBLE_DEVICES", "1"),
        ({"HIP_VISIBLE_DEVICES": "GPU-2a4b"}, ROCM_UUIDS[1:], "HIP_VISIBLE_DEVICES", ROCM_UUIDS[1]),
        ({"HIP_VISIBLE_DEVICES": ""}, [], "HIP_VISIBLE_DEVICES", None),
    ],
)
def test_rocm_visibility_and_child_env(
    tmp_path: Path, environ: dict[str, str], uuids: list[str], selector: str, child: str | None
) -> None:
    runner = FakeRunner({})
    inv = detect_inventory(environ=environ, runner=runner, paths=rocm_paths(tmp_path))
    assert (inv.platform, inv.source) == ("rocm", "sysfs kfd topology")
    assert [g.uuid for g in inv.gpus] == uuids
    assert inv.child_selector == selector
    if inv.gpus:
        last = len(inv.gpus) - 1
        env = inv.child_env([last])
        # exactly one selector set, the other two removed (vLLM raises when HIP and CUDA disagree)
        assert [k for k, v in env.items() if v is not None] == [selector]
        assert sorted(env) == ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"]
        assert env[selector] == child
    else:
        assert child is None
    assert AMD_SMI_LIST not in runner.calls  # sysfs answered; no ROCm tool was run


def test_rocm_tools_when_sysfs_is_absent(tmp_path: Path) -> None:
    paths = SystemPaths(tmp_path / "p", tmp_path / "kfd", tmp_path / "nodes")
    runner = FakeRunner({AMD_SMI_LIST: ok((ROCM / "amd-smi-list.json").read_text())})
    inv = detect_inventory(environ={}, runner=runner, paths=paths)
    assert (inv.platform, inv.count, inv.source) == ("rocm", 2, "amd-smi")
    from pytest_pdserve.machine.gpu_probe import ROCM_SMI_QUERY

    runner = FakeRunner({ROCM_SMI_QUERY: ok((ROCM / "rocm-smi.json").read_text())})
    inv = detect_inventory(environ={}, runner=runner, paths=paths)
    assert (inv.source, [g.uuid for g in inv.gpus]) == ("rocm-smi", ROCM_UUIDS)


def test_dev_kfd_without_gpus_is_rocm_with_none(tmp_path: Path) -> None:
    kfd = tmp_path / "kfd"
    kfd.write_text("")
    inv = detect_inventory(environ={}, runner=FakeRunner({}), paths=SystemPaths(tmp_path / "p", kfd, tmp_path / "n"))
    assert (inv.platform, inv.count) == ("rocm", 0)


# --------------------------------------------------------------------------- simulation


@pytest.mark.parametrize(
    ("value", "platform", "expected"),
    [
        ("2", "auto", ("cuda", 2)),
        ("rocm:3", "auto", ("rocm", 3)),
        ("2", "rocm", ("rocm", 2)),
        ("cuda:0", "cuda", ("cuda", 0)),
    ],
)
def test_parse_simulate_gpus(value: str, platform: str, expected: tuple[str, int]) -> None:
    assert parse_simulate_gpus(value, platform) == expected


@pytest.mark.parametrize(
    ("value", "platform", "message"),
    [
        ("two", "auto", "use N, cuda:N or rocm:N"),
        ("cuda:-1", "auto", "use N, cuda:N or rocm:N"),
        ("tpu:2", "auto", "use N, cuda:N or rocm:N"),
        ("rocm:2", "cuda", "simulates rocm GPUs but the platform is set to cuda"),
        ("2", "cpu", "simulates cuda GPUs but the platform is set to cpu"),
    ],
)
def test_parse_simulate_gpus_rejects(value: str, platform: str, message: str) -> None:
    with pytest.raises(InventoryError, match=message):
        parse_simulate_gpus(value, platform)


def test_simulated_inventory() -> None:
    inv = simulated_inventory("rocm", 2, "simulated via --pd-simulate-gpus=rocm:2")
    assert inv.simulated
    assert [g.uuid for g in inv.gpus] == [
        "GPU-sim-0000-0000-0000-000000000000",
        "GPU-sim-0000-0000-0000-000000000001",
    ]
    assert inv.child_env([1])["HIP_VISIBLE_DEVICES"] == "1"
    assert inv.describe() == "rocm: 2 simulated GPUs [simulated via --pd-simulate-gpus=rocm:2]"
