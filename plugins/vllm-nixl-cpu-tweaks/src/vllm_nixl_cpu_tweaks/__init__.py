"""vLLM general plugin: run NIXL without its busy-polling UCX progress thread, and let workers use AMX.

Why: NIXL's Python API creates every agent with ``enable_prog_thread=True`` and a zero poll delay, so each
vLLM server that loads NixlConnector keeps one core at 100 % forever, even when idle (gdb shows
``nixlUcxSharedThread::run()`` in ``poll(..., timeout=0)``). On a 2-core CI machine a P/D pair then starves
everything else and decode gets ~5x slower. vLLM does not need the thread: it drives transfers itself by
polling their state (``check_xfer_state``), so transfers still complete without it.

How: vLLM calls :func:`register` in each of its processes (API server, EngineCore, workers). We do not
import NIXL here (that costs ~1.4 s per process and most processes never use it); instead an import hook
waits for NIXL's real API module to load and then wraps ``nixl_agent_config.__init__`` so that
``enable_prog_thread`` is always ``False``. No installed file is modified.

Opt-out: ``VLLM_NIXL_KEEP_PROG_THREAD=1`` leaves NIXL untouched. Meant for CPU-only hosts; GPU hosts
usually want the progress thread.

AMX: for bfloat16, vLLM's CPU attention uses AMX tile instructions whenever the CPU has ``amx_tile``, but
Linux lets a process execute them only after ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, which
vLLM 0.32's CPU worker never calls; the first AMX attention call then dies with SIGILL (exit code -4). oneDNN
asks on its own AMX GEMM paths, so only processes whose first work is not such a GEMM die (a P/D decode server
whose first step follows a KV pull). :func:`request_amx_permission` asks in every vLLM process.

Affinity: on the CPU platform, vLLM's NIXL worker calls ``os.sched_setaffinity(0, [last core of each NUMA
node])`` "to reserve cores for start_load_kv()". That pins the worker's main thread and every thread created
after it (NIXL's UCX progress and worker threads) to one core, and every server on the host picks the same
core: prefill and decode workers then spin (``sched_yield`` in vLLM's message queue, a UCX spinlock in NIXL's
progress thread) on one core while the others idle. Measured on 2 cores: P/D requests stalled 10-50 s
(decode's ``postXfer`` held the UCX lock in ``sendmsg`` while its progress thread spun on the lock), the
prefill's 30 s KV lease expired, and decode answered HTTP 500. :func:`keep_cpu_affinity` skips that one call;
``VLLM_NIXL_CPU_PIN_KV_CORE=1`` keeps vLLM's pin.

Message-queue spin: a reader of vLLM's shared-memory message queue (each worker waiting for the next step,
EngineCore waiting for the workers' output) spins on ``sched_yield`` for 1 s after each read before it parks on
the queue's notify socket (``SpinCondition.busy_loop_s``, not settable in vLLM 0.32), and a writer waiting for its
readers spins too. With more vLLM processes than cores that time is taken from the processes doing the work:
measured on 2 cores, each idle worker of a P/D pair used a whole core for about 1 s after every request (~2 CPU-s
per request for the pair, and CI's real-vLLM servers are up beside the simulator tier). Parking at once
(``busy_loop_s = 0``) was tried first and deadlocked vLLM 0.32 (EngineCore waiting for a worker's answer, the
worker waiting for the next step, both in ``poll``, for minutes). :func:`polite_shm_spin` keeps vLLM's protocol
and timing and only makes each spin sleep ``VLLM_CPU_SHM_SPIN_SLEEP_US`` (default 200 us) instead of
``sched_yield``: a waiting process then costs a few per cent of a core, and a step is seen at most that much later.

Start method: vLLM for CPU sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` in ``CpuPlatform.check_and_update_config``
whatever the user chose, so EngineCore and each worker are fresh interpreters that import torch and vLLM again
(12-15 s of CPU each on 2 cores; a server is three such imports). ``vllm serve`` elsewhere honours an explicit
value (it sets ``spawn`` only when the variable is unset: ``cli_env_setup``). vLLM gives no reason at the CPU
override; one thing spawn does there is carry the ``LD_PRELOAD`` set just after it (PyTorch's libgomp, tcmalloc)
into the children, which is about thread binding and speed, not what the server answers.
:func:`honour_fork_start_method` makes the CPU platform keep an explicit ``VLLM_WORKER_MULTIPROC_METHOD=fork``:
EngineCore is then a fork of the API server and the worker a fork of EngineCore. Measured on 2 cores (tiny Llama,
``--enforce-eager``, one thread): a server ready in 19 s with 18 s of CPU, against 50 s and 45 s spawned. Unset, or
``spawn``, keeps vLLM's spawn.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = [
    "KEEP_ENV",
    "PIN_ENV",
    "SPIN_SLEEP_ENV",
    "START_METHOD_ENV",
    "honour_fork_start_method",
    "keep_cpu_affinity",
    "polite_shm_spin",
    "register",
    "request_amx_permission",
]

KEEP_ENV = "VLLM_NIXL_KEEP_PROG_THREAD"
#: ``1`` keeps vLLM's pin of the NIXL worker to the last core of each NUMA node (see the module docstring).
PIN_ENV = "VLLM_NIXL_CPU_PIN_KV_CORE"
# Calls to os.sched_setaffinity made by code in this package are the pin we skip; nothing else is touched.
_NIXL_CONNECTOR_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_WRAPPED_FLAG = "_vllm_nixl_cpu_tweaks_wrapped"

# The module that really defines nixl_agent_config. The `nixl` meta package re-exports one of these as
# `nixl._api` (it picks the CUDA 13, CUDA 12 or ROCm build at import time).
_API_MODULES = frozenset({"nixl_cu13._api", "nixl_cu12._api", "nixl_rocm._api", "nixl._api"})
_PATCHED_FLAG = "_vllm_nixl_cpu_tweaks_patched"
#: NIXL's progress thread sleeps up to this long between polls when idle (its default, 0, means spin).
DELAY_ENV = "VLLM_NIXL_PROG_THREAD_DELAY_US"
DEFAULT_DELAY_US = 1000

#: Microseconds each spin of vLLM's shared-memory message queue sleeps instead of ``sched_yield`` (0: vLLM's own).
SPIN_SLEEP_ENV = "VLLM_CPU_SHM_SPIN_SLEEP_US"
DEFAULT_SPIN_SLEEP_US = 200
_SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"

#: vLLM's own variable for how EngineCore and workers are started; ``fork`` is kept on the CPU platform.
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
_CPU_PLATFORM_MODULE = "vllm.platforms.cpu"

# A child of vLLM's "vllm" logger, so the line appears in the server log with vLLM's format.
logger = logging.getLogger("vllm.plugins.nixl_cpu_tweaks")


# Linux x86_64 ABI values (arch/x86/include/uapi/asm/prctl.h, asm/unistd_64.h).
_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _cpu_has_amx_tile() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile data in this process; True when granted (idempotent, inherited on fork)."""
    if sys.platform != "linux" or platform.machine() != "x86_64" or not _cpu_has_amx_tile():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    perm = ctypes.c_ulong(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(perm)) == 0 and perm.value >> 18 & 1:
        return True
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        logger.warning(
            "AMX permission refused by the kernel (errno %d); bfloat16 CPU attention may die with "
            "SIGILL: serve with --dtype float32",
            ctypes.get_errno(),
        )
        return False
    logger.info("AMX tile data permission granted to pid %d (vLLM's CPU attention uses AMX for bfloat16)", os.getpid())
    return True


def keep_cpu_affinity() -> bool:
    """Make ``os.sched_setaffinity`` skip calls from vLLM's NIXL connector; True when the wrapper is in place.

    Only calls whose caller is a module of ``vllm.distributed.kv_transfer.kv_connector.v1.nixl`` and that
    target this process (pid 0) are skipped; every other caller gets the real function. Idempotent.
    """
    if os.environ.get(PIN_ENV) == "1" or not hasattr(os, "sched_setaffinity"):
        return False
    real = os.sched_setaffinity
    if getattr(real, _WRAPPED_FLAG, False):
        return True

    def sched_setaffinity(pid: int, mask: Any, /) -> None:
        try:
            caller = sys._getframe(1).f_globals.get("__name__", "")
        except ValueError:  # no Python frame above (a call from C): not vLLM's pin
            caller = ""
        if pid == 0 and (caller == _NIXL_CONNECTOR_PACKAGE or caller.startswith(_NIXL_CONNECTOR_PACKAGE + ".")):
            logger.info(
                "kept CPU affinity %s instead of %s's pin to cores %s (it puts every server's NIXL "
                "worker on one core; %s=1 keeps the pin)",
                sorted(os.sched_getaffinity(0)),
                caller,
                sorted(mask),
                PIN_ENV,
            )
            return None
        return real(pid, mask)

    sched_setaffinity.__doc__ = real.__doc__
    setattr(sched_setaffinity, _WRAPPED_FLAG, True)
    os.sched_setaffinity = sched_setaffinity
    return True


def _spin_sleep_us() -> int:
    raw = os.environ.get(SPIN_SLEEP_ENV, "").strip()
    if not raw:
        return DEFAULT_SPIN_SLEEP_US
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 100_000:
        logger.warning(
            "%s=%r is not a whole number of microseconds in [0, 100000]; using %d",
            SPIN_SLEEP_ENV, raw, DEFAULT_SPIN_SLEEP_US,
        )  # fmt: skip
        return DEFAULT_SPIN_SLEEP_US
    return value


def _patch_shm_module(module: ModuleType) -> None:
    real = getattr(module, "sched_yield", None)
    if not callable(real) or getattr(real, _WRAPPED_FLAG, False):
        return
    if not isinstance(getattr(module, "SpinCondition", None), type):  # not the queue this was measured on
        logger.warning("vLLM's message queue has no SpinCondition; its spin left as is")
        return
    micros = _spin_sleep_us()
    if micros == 0:
        return
    seconds = micros / 1e6

    def sched_yield() -> None:
        time.sleep(seconds)  # releases the GIL and the core; the caller rechecks its flag as after a yield

    setattr(sched_yield, _WRAPPED_FLAG, True)
    module.sched_yield = sched_yield
    logger.info("shared-memory message-queue spins sleep %d us instead of sched_yield (%s)", micros, SPIN_SLEEP_ENV)


def polite_shm_spin() -> None:
    """Make vLLM's shared-memory message queue sleep ``VLLM_CPU_SHM_SPIN_SLEEP_US`` per spin instead of yielding:
    now if the module is loaded (a worker imports it before plugins load), else when it loads."""
    module = sys.modules.get(_SHM_MODULE)
    if module is not None:
        _patch_shm_module(module)
    _install_import_hook()


def _install_import_hook() -> None:
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def _patch_cpu_platform(module: ModuleType) -> None:
    platform_class: Any = getattr(module, "CpuPlatform", None)
    real = getattr(getattr(platform_class, "check_and_update_config", None), "__func__", None)
    if real is None or getattr(real, _WRAPPED_FLAG, False):  # not the classmethod this was measured on, or done
        return

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        asked = os.environ.get(START_METHOD_ENV)
        real(cls, vllm_config)
        if asked == "fork" and os.environ.get(START_METHOD_ENV) != "fork":
            os.environ[START_METHOD_ENV] = "fork"
            if getattr(check_and_update_config, "said", False):
                return
            check_and_update_config.said = True  # type: ignore[attr-defined]  # once per process, not per config
            logger.info(
                "EngineCore and workers start by fork, as %s=fork asks (vLLM for CPU would spawn them, each "
                "importing torch and vLLM again)",
                START_METHOD_ENV,
            )

    setattr(check_and_update_config, _WRAPPED_FLAG, True)
    platform_class.check_and_update_config = classmethod(check_and_update_config)


def honour_fork_start_method() -> None:
    """Make vLLM's CPU platform keep ``VLLM_WORKER_MULTIPROC_METHOD=fork`` when it is set (see the module
    docstring): now if the platform module is loaded, else when it loads. Nothing changes without ``fork``."""
    if os.environ.get(START_METHOD_ENV) != "fork":
        return
    module = sys.modules.get(_CPU_PLATFORM_MODULE)
    if module is not None:
        _patch_cpu_platform(module)
    _install_import_hook()


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; idempotent (vLLM may call it more than once)."""
    request_amx_permission()
    keep_cpu_affinity()
    polite_shm_spin()
    honour_fork_start_method()
    if os.environ.get(KEEP_ENV) == "1":
        return
    # vLLM sets this only when NIXL is not imported yet; setting it here too covers anything that imports
    # NIXL before vLLM's nixl_utils does (UCX reads it once, when the library loads).
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    for name in _API_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            _patch_module(module)
    _install_import_hook()


def _delay_us() -> int:
    raw = os.environ.get(DELAY_ENV, str(DEFAULT_DELAY_US))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        logger.warning("%s=%r is not a whole number of microseconds >= 1; using %d", DELAY_ENV, raw, DEFAULT_DELAY_US)
        return DEFAULT_DELAY_US
    return value


def _patch_module(module: ModuleType) -> None:
    bindings: Any = getattr(module, "nixlBind", None)
    base = getattr(bindings, "nixlAgentConfig", None)
    if not isinstance(base, type) or getattr(base, _PATCHED_FLAG, False):
        return
    delay_property = base.__dict__.get("pthrDelay")
    if not isinstance(delay_property, property) or delay_property.fget is None or delay_property.fset is None:
        # A NIXL release without this field: do nothing rather than guess.
        logger.warning("nixlAgentConfig has no pthrDelay field; NIXL progress thread left as is")
        return
    get_delay, set_delay = delay_property.fget, delay_property.fset
    delay = _delay_us()

    class _PolitePollConfig(base):  # type: ignore[misc,valid-type]
        """nixl_agent.__init__ assigns ``pthrDelay = 0`` (spin); keep our delay as the floor instead."""

        @property
        def pthrDelay(self) -> int:  # noqa: N802 (NIXL's name)
            return int(get_delay(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            set_delay(self, max(int(value), delay))

    _PolitePollConfig.__name__ = _PolitePollConfig.__qualname__ = base.__name__
    setattr(_PolitePollConfig, _PATCHED_FLAG, True)
    bindings.nixlAgentConfig = _PolitePollConfig
    logger.info("NIXL progress thread will poll every %d us instead of spinning (%s)", delay, DELAY_ENV)


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then patches the freshly executed module."""

    def __init__(self, wrapped: importlib.abc.Loader) -> None:
        self._wrapped = wrapped

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._wrapped.exec_module(module)
        if module.__name__ == _SHM_MODULE:
            _patch_shm_module(module)
        elif module.__name__ == _CPU_PLATFORM_MODULE:
            _patch_cpu_platform(module)
        elif os.environ.get(KEEP_ENV) != "1":
            _patch_module(module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, ... used by tracebacks and tools
        return getattr(self._wrapped, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds NIXL's API modules, vLLM's message-queue module and its CPU platform with the other finders and wraps
    their loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _API_MODULES and fullname not in (_SHM_MODULE, _CPU_PLATFORM_MODULE):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _PatchingLoader):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None
