"""`Gpu`: one GPU the caller can see, the value the probes produce and the inventory holds. [pytest-free, stdlib]

Apart from gpu_probe.py (which re-exports it) so that an inventory that probes nothing (``--pd-simulate-gpus``,
``--pd-platform=cpu``) loads no probe code (gpu_probe.py is costly at import).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Gpu"]


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
