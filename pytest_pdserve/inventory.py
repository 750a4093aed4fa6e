"""Platform and GPU inventory without torch, and the GPU environment a child server gets.

Detection (each step takes injectable command runners / paths so tests feed recorded outputs):

* **CUDA**: ``nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used
  --format=csv,noheader,nounits``; when nvidia-smi is missing or fails, the driver's
  ``/proc/driver/nvidia/gpus/<bus id>/information`` files.
* **ROCm**: the KFD topology in sysfs (``/sys/class/kfd/kfd/topology/nodes/*`` with
  ``gpu_id != 0``; no subprocess, enumerated in HIP's order, UUIDs in HIP's ``GPU-<hex>`` form),
  else ``amd-smi list --json``, else ``rocm-smi --showuniqueid ... --json``. ``/dev/kfd`` marks
  the platform as ROCm even when no tool answers.
* **cpu**: neither of the above.

Visibility: the caller's ``CUDA_VISIBLE_DEVICES`` (ROCm: ``ROCR_VISIBLE_DEVICES`` first, then
``HIP_VISIBLE_DEVICES`` or ``CUDA_VISIBLE_DEVICES`` inside that) is applied with CUDA's rules:
entries are indices or GPU UUIDs (full ``GPU-...`` or a unique prefix), an empty value hides
every GPU, and parsing stops at the first entry that is invalid, unknown, ambiguous or repeated
(``CUDA_VISIBLE_DEVICES=GPU-x`` on a machine without such a GPU gives no GPUs at all).

A simulated inventory (``N``, ``cuda:N`` or ``rocm:N``) stands in for real GPUs on CPU-only CI;
it ignores the visibility variables so that a CI job that hides GPUs can still simulate them.
This module is pytest-free.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

__all__ = [
    "CommandResult",
    "Gpu",
    "GpuProcess",
    "Inventory",
    "InventoryError",
    "Platform",
    "SystemPaths",
    "detect_inventory",
    "gpu_processes",
    "parse_amd_smi_list",
    "parse_compute_apps",
    "parse_kfd_topology",
    "parse_nvidia_query_gpu",
    "parse_proc_nvidia",
    "parse_rocm_smi_json",
    "parse_simulate_gpus",
    "run_command",
    "select_visible",
    "simulated_inventory",
]

Platform = Literal["cuda", "rocm", "cpu"]
PLATFORMS: tuple[Platform, ...] = ("cuda", "rocm", "cpu")

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
ROCM_SELECTORS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
"""vLLM raises when HIP and CUDA selectors disagree, so a ROCm child gets exactly one of these."""


class InventoryError(ValueError):
    """A value describing GPUs (simulation spec, positions) is invalid."""


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


class GpuProcess(NamedTuple):
    """A compute process on a GPU, from ``nvidia-smi --query-compute-apps``."""

    pid: int
    uuid: str
    used_mib: int | None


@dataclass(frozen=True)
class Inventory:
    """Platform plus the GPUs visible to this process, in the caller's visible order.

    A GPU lease names *positions* in ``gpus``; :meth:`child_env` turns positions into the
    environment a child server needs.
    """

    platform: Platform
    gpus: tuple[Gpu, ...]
    selector_var: str | None
    source: str
    simulated: bool = False
    visibility: str = ""
    physical_count: int = 0
    note: str = ""

    @property
    def count(self) -> int:
        """Number of visible GPUs."""
        return len(self.gpus)

    @property
    def child_selector(self) -> str:
        """The variable a child server gets: the caller's (ROCm default HIP), CUDA on CUDA."""
        if self.platform == "rocm":
            return self.selector_var or "HIP_VISIBLE_DEVICES"
        return "CUDA_VISIBLE_DEVICES"

    def child_env(self, positions: Sequence[int]) -> dict[str, str | None]:
        """Environment overrides for a child that should see the GPUs at *positions*.

        ``None`` means "remove the variable". On ROCm exactly one selector is set and the other
        two are removed; on CUDA ``CUDA_VISIBLE_DEVICES`` is set.
        """
        seen: set[int] = set()
        tokens: list[str] = []
        for pos in positions:
            if not 0 <= pos < len(self.gpus):
                raise InventoryError(
                    f"GPU position {pos} is out of range: {len(self.gpus)} GPUs visible ({self.describe()})"
                )
            if pos in seen:
                raise InventoryError(f"GPU position {pos} given twice in {list(positions)}")
            seen.add(pos)
            tokens.append(self.gpus[pos].token)
        value = ",".join(tokens)
        if self.platform == "rocm":
            chosen = self.child_selector
            return {var: (value if var == chosen else None) for var in ROCM_SELECTORS}
        return {"CUDA_VISIBLE_DEVICES": value}

    def describe(self) -> str:
        """One line for the report header, e.g. ``cuda: 2 GPUs (CUDA_VISIBLE_DEVICES=1,0) NVIDIA H200 x2``."""
        if self.platform == "cpu" and not self.gpus:
            return f"cpu: no GPUs ({self.source})"
        kind = "simulated GPU" if self.simulated else "GPU"
        plural = "" if self.count == 1 else "s"
        parts = [f"{self.platform}: {self.count} {kind}{plural}"]
        if self.visibility:
            parts.append(f"({self.visibility})")
        if self.gpus and not self.simulated:
            counts = Counter(g.name for g in self.gpus)
            parts.append(", ".join(f"{name} x{n}" for name, n in counts.items()))
        parts.append(f"[{self.source}]")
        text = " ".join(parts)
        return f"{text}; {self.note}" if self.note else text


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


# --------------------------------------------------------------------------- visibility


def _match_entry(entry: str, gpus: Sequence[Gpu]) -> tuple[int | None, str]:
    """Position of *entry* in *gpus* and a reason when it does not match."""
    if entry.isdigit():
        idx = int(entry)
        if idx < len(gpus):
            return idx, ""
        return None, f"is index {idx} but only {len(gpus)} GPU(s) exist"
    if entry.upper().startswith("GPU-") and len(entry) > 4:
        hits = [i for i, g in enumerate(gpus) if g.uuid.lower().startswith(entry.lower())]
        if len(hits) == 1:
            return hits[0], ""
        if hits:
            return None, f"is a prefix of {len(hits)} GPU UUIDs"
        return None, "matches no GPU UUID"
    return None, "is neither a GPU index nor a GPU UUID"


def select_visible(gpus: Sequence[Gpu], var: str, value: str) -> tuple[list[Gpu], str]:
    """Apply a visibility variable to *gpus* (CUDA's rules, see the module docstring).

    :returns: the visible GPUs in the order the variable lists them, each with ``token`` set
        to how a child's selector should name it, and a note explaining a truncated list.
    """
    if not value.strip():
        return [], f"{var} is empty, which hides every GPU"
    chosen: list[Gpu] = []
    taken: set[int] = set()
    for raw in value.split(","):
        entry = raw.strip()
        pos, why = _match_entry(entry, gpus)
        if pos is not None and pos in taken:
            pos, why = None, "repeats an earlier entry"
        if pos is None:
            return chosen, (f"{var} entry {entry!r} {why}; CUDA/HIP ignore it and every entry after it")
        taken.add(pos)
        gpu = gpus[pos]
        token = gpu.uuid if not entry.isdigit() else str(gpu.index)
        chosen.append(replace(gpu, token=token))
    return chosen, ""


# --------------------------------------------------------------------------- detection


def _detect_cuda(runner: Runner, paths: SystemPaths) -> tuple[list[Gpu], str, bool]:
    """GPUs, source description, and whether any NVIDIA stack was found at all."""
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


def _detect_rocm(runner: Runner, paths: SystemPaths) -> tuple[list[Gpu], str, bool]:
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


def _cuda_inventory(gpus: list[Gpu], source: str, environ: Mapping[str, str]) -> Inventory:
    value = environ.get("CUDA_VISIBLE_DEVICES")
    visible, note = (gpus, "") if value is None else select_visible(gpus, "CUDA_VISIBLE_DEVICES", value)
    if len({g.name for g in visible}) > 1 and environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        # CUDA's default FASTEST_FIRST order can differ from nvidia-smi's PCI order when the models
        # differ; a UUID names the same device under either order.
        visible = [replace(g, token=g.uuid) if g.uuid else g for g in visible]
        extra = "GPU models differ and CUDA_DEVICE_ORDER is not PCI_BUS_ID: children get UUIDs"
        note = f"{note}; {extra}" if note else extra
    return Inventory(
        platform="cuda",
        gpus=tuple(visible),
        selector_var=None if value is None else "CUDA_VISIBLE_DEVICES",
        source=source,
        visibility="" if value is None else f"CUDA_VISIBLE_DEVICES={value}",
        physical_count=len(gpus),
        note=note,
    )


def _rocm_inventory(gpus: list[Gpu], source: str, environ: Mapping[str, str]) -> Inventory:
    notes: list[str] = []
    shown: list[str] = []
    visible = list(gpus)
    rocr = environ.get("ROCR_VISIBLE_DEVICES")
    if rocr is not None:
        # ROCr filters the physical list first; HIP (or CUDA) selects within what remains.
        visible, note = select_visible(visible, "ROCR_VISIBLE_DEVICES", rocr)
        notes.append(note)
        shown.append(f"ROCR_VISIBLE_DEVICES={rocr}")
    inner_var = next((v for v in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if v in environ), None)
    if inner_var is not None:
        inner = environ[inner_var]
        by_position = [replace(g, index=i) for i, g in enumerate(visible)]
        picked, note = select_visible(by_position, inner_var, inner)
        # The child gets one selector and no ROCR filter, so an index token must be physical.
        visible = [
            replace(visible[p.index], token=p.token if p.token != str(p.index) else str(visible[p.index].index))
            for p in picked
        ]
        notes.append(note)
        shown.append(f"{inner_var}={inner}")
    return Inventory(
        platform="rocm",
        gpus=tuple(visible),
        selector_var=next((v for v in ROCM_SELECTORS if v in environ), None),
        source=source,
        visibility=" ".join(shown),
        physical_count=len(gpus),
        note="; ".join(n for n in notes if n),
    )


def parse_simulate_gpus(value: str, platform: str = "auto") -> tuple[Platform, int]:
    """Parse a ``--pd-simulate-gpus`` value: ``N``, ``cuda:N`` or ``rocm:N`` (N >= 0).

    A bare ``N`` takes the platform override when it names cuda or rocm, else cuda.
    """
    text = value.strip()
    plat_text, sep, count_text = text.rpartition(":")
    plat_text = plat_text.strip().lower()
    if not sep:
        plat_text = platform if platform in ("cuda", "rocm") else "cuda"
    if plat_text not in ("cuda", "rocm") or not count_text.strip().isdigit():
        raise InventoryError(f"{value!r} is not a GPU simulation; use N, cuda:N or rocm:N with N a whole number >= 0")
    if platform in ("cuda", "rocm", "cpu") and plat_text != platform:
        raise InventoryError(f"{value!r} simulates {plat_text} GPUs but the platform is set to {platform}")
    plat: Platform = "rocm" if plat_text == "rocm" else "cuda"
    return plat, int(count_text)


def simulated_inventory(platform: Platform, count: int, source: str = "simulated") -> Inventory:
    """An inventory of *count* fake GPUs (uuids ``GPU-sim-0000-0000-0000-00000000000N``)."""
    gpus = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-sim-0000-0000-0000-{i:012d}",
            name="simulated GPU",
            memory_mib=None,
            token=str(i),
        )
        for i in range(count)
    )
    return Inventory(platform, gpus, None, source, simulated=True, physical_count=count)


def detect_inventory(
    platform: str = "auto",
    *,
    environ: Mapping[str, str] | None = None,
    runner: Runner = run_command,
    paths: SystemPaths | None = None,
) -> Inventory:
    """Detect the platform and the GPUs visible to this process. Never raises for a missing stack.

    :param platform: ``auto`` (try CUDA, then ROCm, else cpu) or a forced ``cuda``/``rocm``/``cpu``.
    :param environ: the caller's environment (default ``os.environ``).
    :param runner: runs a tool's argv; see :func:`run_command`.
    :param paths: filesystem locations; see :class:`SystemPaths`.
    """
    env = os.environ if environ is None else environ
    sys_paths = paths or SystemPaths()
    if platform == "cpu":
        return Inventory("cpu", (), None, "platform set to cpu")
    cuda_found = False
    cuda_source = ""
    if platform in ("auto", "cuda"):
        cuda_gpus, cuda_source, cuda_found = _detect_cuda(runner, sys_paths)
        # An NVIDIA stack without GPUs under "auto": look for ROCm before settling on cuda.
        if cuda_gpus or platform == "cuda":
            return _cuda_inventory(cuda_gpus, cuda_source, env)
    rocm_gpus, rocm_source, rocm_found = _detect_rocm(runner, sys_paths)
    if rocm_gpus or rocm_found or platform == "rocm":
        return _rocm_inventory(rocm_gpus, rocm_source, env)
    if cuda_found:
        return _cuda_inventory([], cuda_source, env)
    return Inventory("cpu", (), None, f"{cuda_source}, {rocm_source}")


def gpu_processes(runner: Runner = run_command) -> list[GpuProcess] | None:
    """Compute processes on the NVIDIA GPUs, or None when nvidia-smi is missing or fails.

    The GPU release gate uses this: a leased GPU goes back only once none of our pids use it.
    """
    result = runner(NVIDIA_QUERY_APPS)
    if result is None or result.returncode != 0:
        return None
    return parse_compute_apps(result.stdout)
