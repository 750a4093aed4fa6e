"""A stand-in torch for rehearsing tests/gpu without GPUs (scripts/gpu-proof.sh --fake): only what
``PDSERVE_SIM_GPU=1`` and tests/gpu use. ``CUDA_VISIBLE_DEVICES`` is applied like CUDA does (indices or
UUIDs, stop at the first bad entry); "allocating" records this pid's GPU in $FAKE_GPU_DIR, which the fake
nvidia-smi lists as a compute app while the pid lives."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

#: One GPU as the fake nvidia-smi lists it: (index, uuid, name).
Gpu = tuple[str, ...]

__version__ = "0.0+fake"
float32 = "float32"


def _physical() -> list[Gpu]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [tuple(x.strip() for x in line.split(",")) for line in out.splitlines() if line.strip()]


def _visible() -> list[Gpu]:
    phys = _physical()
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return phys
    out: list[Gpu] = []
    for entry in cvd.split(","):
        entry = entry.strip()
        by_uuid = entry.startswith("GPU-")
        hit = [p for p in phys if (entry.isdigit() and p[0] == entry) or (by_uuid and p[1].startswith(entry))]
        if len(hit) != 1 or hit[0] in out:
            break
        out.append(hit[0])
    return out


class _Props:
    def __init__(self, gpu: Gpu) -> None:
        self.uuid = gpu[1][len("GPU-") :]  # real torch prints the UUID without the GPU- prefix
        self.name = gpu[2]
        self.total_memory = 143771 * 1024 * 1024


class _Tensor:
    def __init__(self, n: int) -> None:
        self._n = n

    def numel(self) -> int:
        return self._n

    def element_size(self) -> int:
        return 4


class cuda:  # noqa: N801 - mimics the torch.cuda namespace
    @staticmethod
    def is_available() -> bool:
        return bool(_visible())

    @staticmethod
    def device_count() -> int:
        return len(_visible())

    @staticmethod
    def get_device_properties(index: int) -> _Props:
        return _Props(_visible()[index])


def ones(n: int, dtype: str | None = None, device: str = "cpu") -> _Tensor:
    if str(device).startswith("cuda"):
        index = int(str(device).partition(":")[2] or 0)
        gpu = _visible()[index]
        root = Path(os.environ.get("FAKE_GPU_DIR", "/tmp/fake-gpu"))
        root.mkdir(parents=True, exist_ok=True)
        (root / str(os.getpid())).write_text(gpu[1])
    return _Tensor(n)
