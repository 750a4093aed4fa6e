"""The platform and the GPUs visible to this process, and the GPU environment a child server gets.

The probes in :mod:`pytest_pdserve.machine.gpu_probe` list the machine's GPUs; here the platform is decided
(``auto``: CUDA, then ROCm, else cpu) and visibility is applied.

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

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pytest_pdserve.common.digits import is_int, parse_int
from pytest_pdserve.errors import InventoryError
from pytest_pdserve.machine.gpu_probe import Gpu, Runner, SystemPaths, probe_cuda, probe_rocm, run_command

__all__ = [
    "Gpu",
    "Inventory",
    "Platform",
    "detect_inventory",
    "parse_simulate_gpus",
    "select_visible",
    "simulated_inventory",
]

Platform = Literal["cuda", "rocm", "cpu"]
PLATFORMS: tuple[Platform, ...] = ("cuda", "rocm", "cpu")

ROCM_SELECTORS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
"""vLLM raises when HIP and CUDA selectors disagree, so a ROCm child gets exactly one of these."""


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


# --------------------------------------------------------------------------- visibility


def _match_entry(entry: str, gpus: Sequence[Gpu]) -> tuple[int | None, str]:
    """Position of *entry* in *gpus* and a reason when it does not match."""
    if is_int(entry):
        idx = parse_int(entry)
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


# --------------------------------------------------------------------------- the inventory


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
    if plat_text not in ("cuda", "rocm") or not is_int(count_text):
        raise InventoryError(f"{value!r} is not a GPU simulation; use N, cuda:N or rocm:N with N a whole number >= 0")
    if platform in ("cuda", "rocm", "cpu") and plat_text != platform:
        raise InventoryError(f"{value!r} simulates {plat_text} GPUs but the platform is set to {platform}")
    plat: Platform = "rocm" if plat_text == "rocm" else "cuda"
    return plat, parse_int(count_text)


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
    runner: Runner | None = None,
    paths: SystemPaths | None = None,
) -> Inventory:
    """Detect the platform and the GPUs visible to this process. Never raises for a missing stack.

    :param platform: ``auto`` (try CUDA, then ROCm, else cpu) or a forced ``cuda``/``rocm``/``cpu``.
    :param environ: the caller's environment (default ``os.environ``).
    :param runner: runs a tool's argv (default: :func:`pytest_pdserve.machine.gpu_probe.run_command`).
    :param paths: filesystem locations; see :class:`SystemPaths`.
    """
    if platform == "cpu":
        return Inventory("cpu", (), None, "platform set to cpu")

    env = os.environ if environ is None else environ
    runner = run_command if runner is None else runner
    sys_paths = paths or SystemPaths()
    cuda_found = False
    cuda_source = ""
    if platform in ("auto", "cuda"):
        cuda_gpus, cuda_source, cuda_found = probe_cuda(runner, sys_paths)
        # An NVIDIA stack without GPUs under "auto": look for ROCm before settling on cuda.
        if cuda_gpus or platform == "cuda":
            return _cuda_inventory(cuda_gpus, cuda_source, env)
    rocm_gpus, rocm_source, rocm_found = probe_rocm(runner, sys_paths)
    if rocm_gpus or rocm_found or platform == "rocm":
        return _rocm_inventory(rocm_gpus, rocm_source, env)
    if cuda_found:
        return _cuda_inventory([], cuda_source, env)
    return Inventory("cpu", (), None, f"{cuda_source}, {rocm_source}")
