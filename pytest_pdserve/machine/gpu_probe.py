"""Ask the machine which GPUs it has, per vendor, without torch; `Gpu` is what a probe finds. [pytest-free]

Every probe takes an injectable command runner / paths, so tests feed recorded outputs:

* **NVIDIA**: ``nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used
  --format=csv,noheader,nounits``; when nvidia-smi is missing or fails, the driver's
  ``/proc/driver/nvidia/gpus/<bus id>/information`` files. Compute processes come from
  ``nvidia-smi --query-compute-apps`` (the GPU release gate).
* **AMD**: the KFD topology in sysfs (``/sys/class/kfd/kfd/topology/nodes/*`` with
  ``gpu_id != 0``; no subprocess, enumerated in HIP's order, UUIDs in HIP's ``GPU-<hex>`` form),
  else ``amd-smi list --json``, else ``rocm-smi --showuniqueid ... --json``. ``/dev/kfd`` marks
  the platform as ROCm even when no tool answers.

The probes list physical GPUs; :mod:`pytest_pdserve.machine.inventory` applies the caller's visibility
variables and decides the platform.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pytest_pdserve.common.child_env import child_environ

__all__ = [
    "AMD_SMI_LIST",
    "GPU_RELEASE_TIMEOUT",
    "NVIDIA_QUERY_APPS",
    "NVIDIA_QUERY_GPU",
    "ROCM_SMI_QUERY",
    "CommandResult",
    "Gpu",
    "GpuProcess",
    "Runner",
    "SystemPaths",
    "gpu_processes",
    "parse_amd_smi_list",
    "parse_compute_apps",
    "parse_kfd_topology",
    "parse_nvidia_query_gpu",
    "parse_proc_nvidia",
    "parse_rocm_smi_json",
    "pids_off_gpus",
    "probe_cuda",
    "probe_rocm",
    "run_command",
    "wait_for_gate",
]


@dataclass(frozen=True)
class Gpu:
    """One GPU the caller can see.

    ``index`` is the machine-wide index (nvidia-smi's index; HIP's physical index on ROCm);
    ``token`` is how a child's visibility variable names it: the index, or the UUID when the
    caller selected GPUs by UUID.
    """

    index: int
    uuid: str
    name: str
    memory_mib: int | None
    token: str
    pci_bus_id: str | None = None
    memory_used_mib: int | None = None


SMI_TIMEOUT_S = 10.0
"""nvidia-smi can take seconds to initialise the driver when persistence mode is off; a wedged
driver must not hang the pytest session, so every tool call is bounded."""

NVIDIA_QUERY_GPU = (
    "nvidia-smi",
    "--query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used",
    "--format=csv,noheader,nounits",
)
NVIDIA_QUERY_APPS = (
    "nvidia-smi",
    "--query-compute-apps=pid,gpu_uuid,used_memory",
    "--format=csv,noheader,nounits",
)
AMD_SMI_LIST = ("amd-smi", "list", "--json")
ROCM_SMI_QUERY = (
    "rocm-smi",
    "--showuniqueid",
    "--showproductname",
    "--showmeminfo",
    "vram",
    "--showbus",
    "--json",
)


class CommandResult(NamedTuple):
    """What a command runner returns: exit status and decoded output."""

    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str]], "CommandResult | None"]
"""Runs argv; returns None when the executable does not exist."""


def run_command(argv: Sequence[str], timeout: float = SMI_TIMEOUT_S) -> CommandResult | None:
    """Run a GPU tool with a short timeout; None when it is not installed."""
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, *argv[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
            env=child_environ(),
        )
    except subprocess.TimeoutExpired:
        return CommandResult(-1, "", f"timed out after {timeout:g}s")
    except OSError as exc:
        return CommandResult(-1, "", str(exc))
    return CommandResult(proc.returncode, proc.stdout, proc.stderr)


@dataclass(frozen=True)
class SystemPaths:
    """Filesystem locations read during detection (tests point them at recorded trees)."""

    proc_nvidia_gpus: Path = Path("/proc/driver/nvidia/gpus")
    dev_kfd: Path = Path("/dev/kfd")
    kfd_nodes: Path = Path("/sys/class/kfd/kfd/topology/nodes")


class GpuProcess(NamedTuple):
    """A compute process on a GPU, from ``nvidia-smi --query-compute-apps``."""

    pid: int
    uuid: str
    used_mib: int | None


# --------------------------------------------------------------------------- parsers


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    try:
        return int(text)  # not via float: 64-bit unique ids would lose digits
    except ValueError:
        pass
    try:
        return int(float(text))
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_nvidia_query_gpu(text: str) -> list[Gpu]:
    """Parse ``nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used``."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 6 or not fields[0].isdigit():
            continue
        # A name could contain a comma; the last three and first two columns are fixed.
        name = ", ".join(fields[2:-3])
        index = int(fields[0])
        gpus.append(
            Gpu(
                index=index,
                uuid=fields[1],
                name=name,
                memory_mib=_int_or_none(fields[-2]),
                token=str(index),
                pci_bus_id=fields[-3],
                memory_used_mib=_int_or_none(fields[-1]),
            )
        )
    return gpus


def parse_compute_apps(text: str) -> list[GpuProcess]:
    """Parse ``nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits``.

    Lines that are not ``pid, GPU-uuid, MiB`` (blank lines, "No running processes found") are skipped.
    """
    procs: list[GpuProcess] = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit():
            continue
        if not fields[1].startswith(("GPU-", "MIG-")):
            continue
        procs.append(GpuProcess(int(fields[0]), fields[1], _int_or_none(fields[2])))
    return procs


def parse_proc_nvidia(gpus_dir: Path) -> list[Gpu]:
    """Read ``/proc/driver/nvidia/gpus/<bus id>/information`` (used when nvidia-smi is unusable).

    nvidia-smi numbers GPUs in PCI bus order, so the directories are sorted by bus id.
    """
    try:
        entries = sorted(p for p in gpus_dir.iterdir() if p.is_dir())
    except OSError:
        return []
    gpus: list[Gpu] = []
    for index, entry in enumerate(entries):
        info: dict[str, str] = {}
        try:
            for line in (entry / "information").read_text().splitlines():
                key, sep, value = line.partition(":")
                if sep:
                    info[key.strip()] = value.strip()
        except OSError:
            pass
        gpus.append(
            Gpu(
                index=index,
                uuid=info.get("GPU UUID", ""),
                name=info.get("Model", "NVIDIA GPU"),
                memory_mib=None,
                token=str(index),
                pci_bus_id=info.get("Bus Location", entry.name),
            )
        )
    return gpus


def _read_kv(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            out[key] = value.strip()
    return out


def parse_kfd_topology(nodes_dir: Path) -> list[Gpu]:
    """Read the KFD topology (``/sys/class/kfd/kfd/topology/nodes``); nodes with ``gpu_id`` 0 are CPUs.

    ROCr enumerates GPU agents in node order, so position in the result is HIP's device index.
    UUIDs are HIP's ``GPU-<unique_id as 16 hex digits>``.
    """
    try:
        nodes = sorted(
            (p for p in nodes_dir.iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name),
        )
    except OSError:
        return []
    gpus: list[Gpu] = []
    for node in nodes:
        try:
            props = _read_kv(node / "properties")
            gpu_id_file = node / "gpu_id"
            gpu_id = gpu_id_file.read_text().strip() if gpu_id_file.exists() else props.get("gpu_id", "0")
        except OSError:
            continue
        if _int_or_none(gpu_id) in (None, 0):
            continue
        index = len(gpus)
        unique = _int_or_none(props.get("unique_id", ""))
        uuid = f"GPU-{unique:016x}" if unique else ""
        try:
            name = (node / "name").read_text().strip() or "AMD GPU"
        except OSError:
            name = "AMD GPU"
        memory_mib: int | None = None
        try:
            bank = _read_kv(node / "mem_banks" / "0" / "properties")
            size = _int_or_none(bank.get("size_in_bytes", ""))
            memory_mib = size // (1024 * 1024) if size else None
        except OSError:
            pass
        location = _int_or_none(props.get("location_id", ""))
        domain = _int_or_none(props.get("domain", "0")) or 0
        bdf = None
        if location is not None:
            bdf = f"{domain:04x}:{location >> 8:02x}:{(location >> 3) & 0x1F:02x}.{location & 0x7}"
        gpus.append(Gpu(index, uuid, name, memory_mib, str(index), bdf))
    return gpus


def parse_amd_smi_list(text: str) -> list[Gpu]:
    """Parse ``amd-smi list --json`` (a list of ``{"gpu", "bdf", "uuid", "kfd_id", "node_id", ...}``).

    amd-smi's own ``gpu`` numbering can differ from HIP's; HIP follows the KFD node order, so the
    GPUs are sorted by ``node_id`` and numbered by position.
    """
    data: Any = json.loads(text)
    if isinstance(data, dict):  # some releases wrap the list: {"gpu_list": [...]}
        data = next((v for v in data.values() if isinstance(v, list)), [])
    rows = [r for r in data if isinstance(r, dict) and "gpu" in r]
    rows.sort(key=lambda r: (_int_or_none(str(r.get("node_id", ""))) or 0, int(r["gpu"])))
    gpus: list[Gpu] = []
    for pos, row in enumerate(rows):
        gpus.append(
            Gpu(
                index=pos,
                uuid=str(row.get("uuid", "")),
                name=str(row.get("name", "AMD GPU")),
                memory_mib=None,
                token=str(pos),
                pci_bus_id=str(row.get("bdf")) if row.get("bdf") else None,
            )
        )
    return gpus


def parse_rocm_smi_json(text: str) -> list[Gpu]:
    """Parse ``rocm-smi --showuniqueid --showproductname --showmeminfo vram --showbus --json``.

    The output is ``{"card0": {"Unique ID": "0x...", "Card Series": ..., "VRAM Total Memory (B)": ...,
    "PCI Bus": ...}, ..., "system": {...}}``; key spelling differs between releases, so keys are
    matched case-insensitively.
    """
    data: Any = json.loads(text)
    cards = sorted(
        ((k, v) for k, v in data.items() if k.startswith("card") and k[4:].isdigit() and isinstance(v, dict)),
        key=lambda kv: int(kv[0][4:]),
    )
    gpus: list[Gpu] = []
    for pos, (_, raw) in enumerate(cards):
        info = {str(k).lower(): str(v) for k, v in raw.items()}
        unique = info.get("unique id", "")
        uuid = ""
        if unique.lower().startswith("0x"):
            uuid = f"GPU-{int(unique, 16):016x}"
        name = info.get("card series") or info.get("card model") or "AMD GPU"
        total = _int_or_none(info.get("vram total memory (b)", ""))
        used = _int_or_none(info.get("vram total used memory (b)", ""))
        gpus.append(
            Gpu(
                index=pos,
                uuid=uuid,
                name=name,
                memory_mib=total // (1024 * 1024) if total else None,
                token=str(pos),
                pci_bus_id=info.get("pci bus"),
                memory_used_mib=used // (1024 * 1024) if used is not None else None,
            )
        )
    return gpus


# --------------------------------------------------------------------------- probes


def probe_cuda(runner: Runner, paths: SystemPaths) -> tuple[list[Gpu], str, bool]:
    """NVIDIA GPUs, where they were read from, and whether any NVIDIA stack was found at all."""
    result = runner(NVIDIA_QUERY_GPU)
    failure = ""
    if result is not None:
        if result.returncode == 0:
            return parse_nvidia_query_gpu(result.stdout), "nvidia-smi", True
        first = (result.stdout.strip() or result.stderr.strip()).splitlines()
        failure = f"nvidia-smi failed: {first[0] if first else f'exit {result.returncode}'}"
    proc_gpus = parse_proc_nvidia(paths.proc_nvidia_gpus)
    if proc_gpus:
        src = str(paths.proc_nvidia_gpus)
        return proc_gpus, f"{src} ({failure})" if failure else src, True
    if result is not None:
        return [], failure or "nvidia-smi", True
    return [], "no nvidia-smi", False


def probe_rocm(runner: Runner, paths: SystemPaths) -> tuple[list[Gpu], str, bool]:
    """AMD GPUs, where they were read from, and whether any ROCm stack was found at all."""
    gpus = parse_kfd_topology(paths.kfd_nodes)
    if gpus:
        return gpus, "sysfs kfd topology", True
    found_tool = False
    for argv, parse in ((AMD_SMI_LIST, parse_amd_smi_list), (ROCM_SMI_QUERY, parse_rocm_smi_json)):
        result = runner(argv)
        if result is None:
            continue
        found_tool = True
        if result.returncode == 0:
            try:
                gpus = parse(result.stdout)
            except (ValueError, KeyError, TypeError):
                continue
            if gpus:
                return gpus, argv[0], True
    has_kfd = paths.dev_kfd.exists()
    if has_kfd or found_tool:
        return [], "/dev/kfd present but no GPU listed" if has_kfd else "ROCm tools list no GPU", True
    return [], "no /dev/kfd", False


#: How long a release gate waits for nvidia-smi to stop listing our pids on a GPU (then it releases anyway).
GPU_RELEASE_TIMEOUT = 60.0


def pids_off_gpus(uuids: Collection[str], pids: Collection[int], runner: Runner = run_command) -> bool:
    """The release gate's rule: nvidia-smi lists none of ``pids`` on the GPUs ``uuids`` (True when it fails:
    nothing to wait on). A GPU goes back to the leases only then, so the next server's memory check (vLLM's
    ``--gpu-memory-utilization`` against free memory) does not see the last one's."""
    apps = gpu_processes(runner)
    if apps is None:
        return True
    return not any(a.uuid in uuids and a.pid in pids for a in apps)


def wait_for_gate(gate: Callable[[], bool], timeout: float, poll: float = 0.2) -> str | None:
    """Poll ``gate`` every ``poll`` s until it holds or ``timeout`` passes; None when it held, else why not.

    The caller releases either way (holding a GPU forever would be worse) and logs the reason; the leases'
    release and the keeper's stop share this loop.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            if gate():
                return None
        except Exception as exc:  # a gate that breaks must not keep the GPU
            return f"the gate failed ({type(exc).__name__}: {exc})"
        if time.monotonic() >= deadline:
            return f"not satisfied after {timeout:.1f}s"
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def gpu_processes(runner: Runner = run_command) -> list[GpuProcess] | None:
    """Compute processes on the NVIDIA GPUs, or None when nvidia-smi is missing or fails.

    The GPU release gate uses this: a leased GPU goes back only once none of our pids use it.
    """
    result = runner(NVIDIA_QUERY_APPS)
    if result is None or result.returncode != 0:
        return None
    return parse_compute_apps(result.stdout)
