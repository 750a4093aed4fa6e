"""GPU planning: which GPUs each server of a cluster sees, the leases that hold them, and the release gate.

A plan names, for every server in the order P0..Pn, D0..Dm, the *positions* (in the caller's visible
list, see `inventory.Inventory.child_env`) it gets. Three ways to get one:

* **leased** (the default): every server gets ``TP`` GPUs of its own, leased machine-wide, so xdist
  workers and other runs never share one;
* **explicit** (``--pd-prefill-gpu-ids`` / ``PREFILL_GPU_ID``, ``--pd-decode-gpu-ids`` / ``DECODE_GPU_ID``):
  the given side runs on those GPUs (leased too); a side whose ids are not given gets ``TP`` leased GPUs
  *other than* the explicit ones, never "every GPU";
* **shared** (``--pd-share-gpus``): every server runs on one leased GPU (TP 1 only).

Servers that share a GPU are started one after another (see `manager.py`) and, unless a memory fraction
is given, get :data:`SHARED_GPU_MEMORY_UTILIZATION` each; a given fraction is checked to fit
(:func:`shared_utilization_problem`). This module is pytest-free; the settings layer turns its
configure-time checks into usage errors.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pytest_pdserve.errors import ClusterSpecError, ClusterUnavailable
from pytest_pdserve.machine import leases
from pytest_pdserve.machine.gpu_probe import GPU_RELEASE_TIMEOUT, pids_off_gpus
from pytest_pdserve.machine.inventory import Inventory

if TYPE_CHECKING:  # annotations only: config/ and spec.py sit above machine/
    from pytest_pdserve.config.cluster_settings import ClusterSettings
    from pytest_pdserve.spec import ClusterSpec

__all__ = [
    "GPU_RELEASE_TIMEOUT",
    "SHARED_GPU_MEMORY_UTILIZATION",
    "GpuPlan",
    "GpuPlanner",
    "explicit_ids_problem",
    "shared_utilization_problem",
]

log = logging.getLogger(__name__)

#: ``--gpu-memory-utilization`` of each server on a shared GPU when none is given. vLLM's own shared-GPU
#: P/D configs cap it at 0.35-0.4 per engine; 0.4 + 0.4 leaves a fifth of the GPU for the two CUDA
#: contexts and memory outside vLLM's budget (the second engine checks its fraction against what is
#: *free* after the first one took its share, so two halves would not start).
SHARED_GPU_MEMORY_UTILIZATION = 0.4
#: With more than two servers on one GPU each gets this total divided by their number.
_SHARED_TOTAL = 2 * SHARED_GPU_MEMORY_UTILIZATION

_IDS_FLAGS = {
    "prefill": "--pd-prefill-gpu-ids / PREFILL_GPU_ID",
    "decode": "--pd-decode-gpu-ids / DECODE_GPU_ID",
}


def explicit_ids_problem(
    inventory: Inventory, prefill_ids: Sequence[int] | None, decode_ids: Sequence[int] | None
) -> str | None:
    """Why explicit GPU ids cannot be used on *inventory* (an id that is not visible), or None.

    On a machine without a GPU platform (``cpu``) the ids do not apply and are not checked: the servers
    run on the CPU there.
    """
    if inventory.platform == "cpu":
        return None
    for side, ids in (("prefill", prefill_ids), ("decode", decode_ids)):
        missing = [i for i in ids or () if i >= inventory.count]
        if missing:
            visible = f"positions 0-{inventory.count - 1}" if inventory.count else "none"
            return (
                f"{side} GPU id{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                f"({_IDS_FLAGS[side]}) {'are' if len(missing) > 1 else 'is'} not visible: "
                f"{inventory.count} GPU{'' if inventory.count == 1 else 's'} ({visible}) in "
                f"{inventory.describe()}; ids are positions in the visible list (CUDA_VISIBLE_DEVICES)"
            )
    return None


def shared_utilization_problem(utilization: float, servers: int) -> str | None:
    """Why ``servers`` servers with ``--gpu-memory-utilization utilization`` each do not fit on one GPU."""
    total = utilization * servers
    if total <= 1 + 1e-9:
        return None
    return (
        f"{servers} servers share one GPU with --gpu-memory-utilization {utilization:g} each, "
        f"{total:g} of the GPU in all (more than 1); give at most {math.floor(100 / servers) / 100:g} each, "
        f"or leave it unset for {_shared_fraction(servers):g} each"
    )


def _shared_fraction(servers: int) -> float:
    """Default fraction of each of ``servers`` servers on one GPU, rounded down to hundredths."""
    return math.floor(100 * min(SHARED_GPU_MEMORY_UTILIZATION, _SHARED_TOTAL / servers)) / 100


@dataclass
class GpuPlan:
    """Where each server runs and what holds those GPUs.

    :ivar positions: per server (P0..Pn, D0..Dm), its positions in the inventory; empty on the CPU.
    :ivar leases: the GPU leases held for the plan (released through :meth:`GpuPlanner.release`).
    :ivar utilization: per server, the ``--gpu-memory-utilization`` to give it because it shares a GPU,
        or None to leave the spec's / session's value (or vLLM's default).
    """

    positions: tuple[tuple[int, ...], ...]
    leases: tuple[leases.GpuLease, ...] = ()
    utilization: tuple[float | None, ...] = field(default=())

    @property
    def shared(self) -> bool:
        """True when two servers see the same GPU (they must then start one after the other)."""
        counts = Counter(p for positions in self.positions for p in positions)
        return any(n > 1 for n in counts.values())

    @property
    def held(self) -> int:
        """Number of GPUs leased for the plan."""
        return sum(len(lease.positions) for lease in self.leases)

    @property
    def fds(self) -> tuple[int, ...]:
        """The lock fds of every lease (the watchdog holds them so they outlive a killed pytest)."""
        return tuple(fd for lease in self.leases for fd in lease.fds)

    @property
    def keys(self) -> list[str]:
        """The leased GPU keys (UUIDs, or indices where a GPU has none)."""
        return [key for lease in self.leases for key in lease.keys]


class GpuPlanner:
    """Plans, leases and releases the GPUs of clusters for one session (the launcher's, one per `ClusterManager`)."""

    def __init__(self, settings: ClusterSettings, report: Callable[[str], None] = lambda msg: None) -> None:
        self.settings = settings
        self.report = report

    @property
    def inventory(self) -> Inventory:
        """The GPUs this process sees (the settings')."""
        return self.settings.inventory

    # ------------------------------------------------------------------ plan

    def plan(self, spec: ClusterSpec, label: str, make_room: Callable[[int], None] = lambda need: None) -> GpuPlan:
        """Lease the GPUs of one cluster and say which server sees which.

        :param make_room: called with the number of GPUs a leased plan needs before it leases them (the
            manager stops its own least recently used clusters there).
        :raises ClusterUnavailable: too few GPUs visible, or none free with ``--pd-gpu-wait=skip``.
        :raises ClusterSpecError: the spec cannot run as asked (TP > 1 on a shared GPU, memory fractions
            that do not fit, explicit ids on a cluster other than 1P x 1D).
        """
        tps = [spec.prefill_tp] * spec.num_prefill + [spec.decode_tp] * spec.num_decode
        if not self.inventory.gpus:
            return GpuPlan(tuple(() for _ in tps), (), tuple(None for _ in tps))
        if self.settings.prefill_gpu_ids is not None or self.settings.decode_gpu_ids is not None:
            plan = self._explicit(spec, tps, label, make_room)
        elif self.settings.share_gpus:
            plan = self._shared(spec, tps, label, make_room)
        else:
            plan = self._leased(spec, tps, label, make_room)
        try:
            plan.utilization = self._utilization(spec, plan.positions)
        except BaseException:
            self.release(plan)
            raise
        return plan

    def _leased(self, spec: ClusterSpec, tps: list[int], label: str, make_room: Callable[[int], None]) -> GpuPlan:
        need = sum(tps)
        if need > self.inventory.count:
            share = ""
            if self.inventory.count >= 1 and all(tp == 1 for tp in tps):
                share = "; --pd-share-gpus (PDSERVE_SHARE_GPUS=1) runs every server on one GPU"
            raise _unavailable(
                f"cluster {spec.name} needs {need} GPUs ({spec.num_prefill}P x TP{spec.prefill_tp} + "
                f"{spec.num_decode}D x TP{spec.decode_tp}), {self.inventory.count} visible: "
                f"{self.inventory.describe()}{share}"
            )
        make_room(need)
        lease = self._acquire(list(range(self.inventory.count)), need, spec, label)
        positions = sorted(lease.positions)
        plan, at = [], 0
        for tp in tps:
            plan.append(tuple(positions[at : at + tp]))
            at += tp
        return GpuPlan(tuple(plan), (lease,))

    def _shared(self, spec: ClusterSpec, tps: list[int], label: str, make_room: Callable[[int], None]) -> GpuPlan:
        if any(tp > 1 for tp in tps):
            raise ClusterSpecError(
                f"cluster {spec.name} has prefill TP {spec.prefill_tp} and decode TP {spec.decode_tp}, but "
                "--pd-share-gpus puts every server on one GPU, and a tensor-parallel group needs that many GPUs "
                "of its own: use TP 1 with --pd-share-gpus, or drop --pd-share-gpus"
            )
        make_room(1)
        lease = self._acquire(list(range(self.inventory.count)), 1, spec, label)
        return GpuPlan(tuple(lease.positions for _ in tps), (lease,))

    def _explicit(self, spec: ClusterSpec, tps: list[int], label: str, make_room: Callable[[int], None]) -> GpuPlan:
        if spec.num_prefill != 1 or spec.num_decode != 1:
            raise ClusterSpecError(
                "PREFILL_GPU_ID / DECODE_GPU_ID (--pd-prefill-gpu-ids / --pd-decode-gpu-ids) only apply to a "
                f"1P x 1D cluster; cluster {spec.name} is {spec.num_prefill}P x {spec.num_decode}D"
            )
        prefill_ids, decode_ids = self.settings.prefill_gpu_ids, self.settings.decode_gpu_ids
        sides = {"prefill": (prefill_ids, tps[0]), "decode": (decode_ids, tps[1])}
        for side, (ids, tp) in sides.items():
            if ids is not None and len(ids) != tp:
                raise ClusterSpecError(
                    f"{side} GPU ids {list(ids)} ({_IDS_FLAGS[side]}) do not match cluster {spec.name}'s {side} "
                    f"tensor-parallel size {tp}: give {tp} id{'s' if tp > 1 else ''}"
                )
        problem = explicit_ids_problem(self.inventory, prefill_ids, decode_ids)
        if problem is not None:  # checked at configure time; kept for managers built without the settings
            raise ClusterSpecError(problem)
        # Every spec pins the same ids, so another of our clusters holds them: free all of ours first
        # (else the lease would wait for ourselves until --pd-gpu-wait-timeout).
        make_room(self.inventory.count)
        pinned = sorted({*(prefill_ids or ()), *(decode_ids or ())})
        held = [self._acquire(pinned, len(pinned), spec, label)]
        try:
            plan: list[tuple[int, ...]] = []
            for side, (ids, tp) in sides.items():
                if ids is not None:
                    plan.append(tuple(ids))
                    continue
                # The side without ids gets GPUs of its own, never the pinned ones (nor "every GPU").
                others = [p for p in range(self.inventory.count) if p not in pinned]
                if len(others) < tp:
                    given = "prefill" if side == "decode" else "decode"
                    raise _unavailable(
                        f"cluster {spec.name}: {side} needs {tp} GPU{'s' if tp > 1 else ''} other than the "
                        f"{given} GPU ids {pinned} ({_IDS_FLAGS[given]}), {len(others)} other visible: "
                        f"{self.inventory.describe()}; give {_IDS_FLAGS[side]} too (the same ids share a GPU)"
                    )
                lease = self._acquire(others, tp, spec, f"{label} {side}")
                held.append(lease)
                plan.append(tuple(sorted(lease.positions)))
        except BaseException:
            self.release(GpuPlan((), tuple(held)))
            raise
        return GpuPlan(tuple(plan), tuple(held))

    def _acquire(self, positions: list[int], count: int, spec: ClusterSpec, label: str) -> leases.GpuLease:
        """Lease ``count`` of the GPUs at ``positions``; the lease's positions are inventory positions."""
        keys = [self._key(p) for p in positions]
        if self.settings.gpu_wait == "skip":
            lease = leases.try_acquire_gpus(self.settings.lease_dir, keys, count, contiguous=False, purpose=label)
            if lease is None:
                raise _unavailable(
                    f"no {count} free GPU{'s' if count > 1 else ''} for cluster {spec.name} (leased by other "
                    "tests; --pd-gpu-wait=skip)"
                )
        else:
            lease = leases.acquire_gpus(
                self.settings.lease_dir, keys, count, contiguous=False, timeout=self.settings.gpu_wait_timeout,
                on_wait=self.report, purpose=label,
            )  # fmt: skip
        # Positions in `keys` -> positions in the inventory (what child_env takes).
        lease.positions = tuple(positions[p] for p in lease.positions)
        return lease

    def _key(self, position: int) -> str:
        gpu = self.inventory.gpus[position]
        return gpu.uuid or str(gpu.index)

    def _utilization(self, spec: ClusterSpec, plan: Sequence[tuple[int, ...]]) -> tuple[float | None, ...]:
        """The memory fraction of servers that share a GPU: the given one if it fits, else the shared default."""
        counts = Counter(p for positions in plan for p in positions)
        sharing = max(counts.values(), default=0)
        if sharing <= 1:
            return tuple(None for _ in plan)
        given = spec.gpu_memory_utilization
        if given is None:
            given = self.settings.defaults.gpu_memory_utilization
        if given is not None:
            problem = shared_utilization_problem(given, sharing)
            if problem is not None:
                raise ClusterSpecError(f"cluster {spec.name}: {problem}")
            return tuple(None for _ in plan)
        fraction = _shared_fraction(sharing)
        return tuple(fraction if any(counts[p] > 1 for p in positions) else None for positions in plan)

    # ------------------------------------------------------------------ release

    def release(self, plan: GpuPlan, our_pids: set[int] | None = None) -> float | None:
        """Hand the plan's GPUs back; on real CUDA only once nvidia-smi lists none of ``our_pids`` on them.

        :returns: seconds spent in the release gate, or None when no gate applied.
        """
        gate = self._release_gate(plan, our_pids or set()) if our_pids is not None else None
        waited = 0.0
        for lease in plan.leases:
            waited += lease.release(wait_until=gate, timeout=GPU_RELEASE_TIMEOUT)
        return waited if gate is not None and plan.leases else None

    def gated_keys(self, plan: GpuPlan) -> tuple[str, ...] | None:
        """The GPUs whose release waits for nvidia-smi (`gpu_probe.pids_off_gpus`): on real CUDA only."""
        if self.inventory.platform != "cuda" or self.inventory.simulated or not plan.leases:
            return None
        return tuple(plan.keys)

    def _release_gate(self, plan: GpuPlan, our_pids: set[int]) -> Callable[[], bool] | None:
        """On real CUDA: hand a GPU back only when nvidia-smi lists none of our pids on it."""
        uuids = self.gated_keys(plan)
        if uuids is None:
            return None
        return lambda: pids_off_gpus(uuids, our_pids)


def _unavailable(message: str) -> Exception:
    return ClusterUnavailable(message)
