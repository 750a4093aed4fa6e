"""The session's GPU inventory: detected once, in a background thread started at configure time.

:mod:`pytest_pdserve.machine.inventory` does the detection (pytest-free); this module runs it for one pytest session,
keeps the result in ``config.stash`` and turns a crash or an explicit GPU id that is not there into a usage error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_pdserve.config.settings import PDSERVE_CONFIG
from pytest_pdserve.machine.inventory import Inventory, detect_inventory, simulated_inventory

__all__ = ["InventoryHolder", "get_inventory", "start_inventory_detection"]


class InventoryHolder:
    """Detects the inventory once, in a background thread started at configure time.

    nvidia-smi takes tens of milliseconds to seconds; running it while pytest loads conftests keeps
    that off the critical path, and callers that never ask for the inventory never wait for it.
    A crash in detection is kept and raised to every caller: turning it into a CPU inventory would
    skip every GPU test and leave CI green on a broken GPU machine.
    """

    def __init__(self, detect: Callable[[], Inventory], what: str, *, ready: Inventory | None = None) -> None:
        """:param ready: an inventory known already (a simulated one): no thread, nothing to detect."""
        self._detect = detect
        self._what = what
        self._result: Inventory | None = ready
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if ready is None:
            self._thread = threading.Thread(target=self._run, name="pdserve-inventory", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._detect()
        except Exception as exc:  # re-raised by get(), in the caller's thread
            self._error = exc

    def get(self) -> Inventory:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise pytest.UsageError(
                f"pdserve: GPU detection ({self._what}) crashed: {_where_raised(self._error)}. Fix the GPU "
                "stack (nvidia-smi / amd-smi must answer), or set --pd-platform=cpu (PDSERVE_PLATFORM=cpu) "
                "to run without GPUs"
            ) from self._error
        assert self._result is not None
        return self._result


def _where_raised(exc: BaseException) -> str:
    """``TypeError: msg (at inventory.py:123 in parse_x)``: the error and the innermost frame that raised it."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return f"{type(exc).__name__}: {exc}"
    code = tb.tb_frame.f_code
    return f"{type(exc).__name__}: {exc} (at {Path(code.co_filename).name}:{tb.tb_lineno} in {code.co_name})"


_INVENTORY = pytest.StashKey[InventoryHolder]()


def start_inventory_detection(config: pytest.Config) -> None:
    """Begin detecting the inventory for *config* (idempotent); needs PDSERVE_CONFIG set."""
    if _INVENTORY in config.stash:
        return
    cfg = config.stash[PDSERVE_CONFIG]
    if cfg.simulate_gpus is not None:
        plat, count = cfg.simulate_gpus
        where = f"{cfg.source_of('simulate_gpus')}={plat}:{count}"
        inv = simulated_inventory(plat, count, f"simulated via {where}")
        config.stash[_INVENTORY] = InventoryHolder(lambda: inv, "simulated", ready=inv)
    else:
        platform = cfg.platform
        # The environment pytest configured with, not os.environ when the thread gets to it: a conftest imported
        # meanwhile must not change what the settings were checked against (settings.env_drift holds it).
        environ = {k: v for k, v in cfg.read_env.items() if v is not None}
        config.stash[_INVENTORY] = InventoryHolder(
            lambda: detect_inventory(platform, environ=environ), f"platform {platform}"
        )
    if (cfg.prefill_gpu_ids is not None or cfg.decode_gpu_ids is not None) and not cfg.attach_mode:
        get_inventory(config)  # explicit GPU ids are checked against the inventory now, at configure time


def get_inventory(config: pytest.Config) -> Inventory:
    """The platform and GPU inventory for this session (detected at most once, cached).

    :raises pytest.UsageError: detection crashed, or an explicit GPU id is not in the inventory.
    """
    start_inventory_detection(config)
    inventory = config.stash[_INVENTORY].get()
    cfg = config.stash[PDSERVE_CONFIG]
    if (cfg.prefill_gpu_ids is not None or cfg.decode_gpu_ids is not None) and not cfg.attach_mode:
        # Lazy: gpu_plan.py (and the lease machinery) loaded only when GPU ids are given.
        from pytest_pdserve.machine.gpu_plan import explicit_ids_problem

        problem = explicit_ids_problem(inventory, cfg.prefill_gpu_ids, cfg.decode_gpu_ids)
        if problem is not None:
            given = " and ".join(
                f"{cfg.source_of(n)}={','.join(map(str, getattr(cfg, n)))}"
                for n in ("prefill_gpu_ids", "decode_gpu_ids") if getattr(cfg, n) is not None
            )  # fmt: skip
            raise pytest.UsageError(f"pdserve: {problem} (given by {given})")
    return inventory
