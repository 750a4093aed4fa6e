"""Bounds a setting and a `ClusterSpec` field share, in a module that imports only stdlib modules of common/.
[pytest-free]

The settings table needs them when the plugin loads; `spec.py` (which imports the owned-flags and presets tables)
is loaded only when a cluster is described, so the shared values live here and spec.py re-exports them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pytest_pdserve.common.client_options import KEEPALIVE_EXPIRY_S
from pytest_pdserve.common.digits import is_int

#: Upper bounds shared by the session settings and `ClusterSpec`: beyond them a value only costs memory or time.
MAX_BLOCK_SIZE = 8192
MAX_MODEL_LEN = 1 << 24
#: What vLLM attention backend names look like (``FLASH_ATTN``, ``TRITON_ATTN``, ``auto``).
ATTENTION_BACKEND_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
#: The names vLLM's ``--attention-backend`` takes (the simulator refuses others in vLLM's words; the CPU rule
#: of config/effective.py knows which it replaces).
ATTENTION_BACKENDS: tuple[str, ...] = (
    "FLASH_ATTN",
    "FLASH_ATTN_DIFFKV",
    "TRITON_ATTN",
    "TRITON_ATTN_DIFFKV",
    "TRITON_FLASH_ATTN",
    "ROCM_ATTN",
    "ROCM_SEGMENTED_ATTN",
    "ROCM_AITER_MLA",
    "ROCM_AITER_TRITON_MLA",
    "ROCM_AITER_FA",
    "ROCM_AITER_MLA_SPARSE",
    "XPU_MLA_SPARSE",
    "TORCH_SDPA",
    "FLASHINFER",
    "FLASHINFER_TS",
    "TRITON_FLASHINFER",
    "FLASHINFER_MLA",
    "TOKENSPEED_MLA",
    "FLASHINFER_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE_SM120",
    "FLASHINFER_MLA_SPARSE_SM90",
    "TRITON_MLA",
    "CUTLASS_MLA",
    "FLASHMLA",
    "FLASHMLA_SPARSE",
    "FLASHMLA_SPARSE_DSV4",
    "FLASHINFER_MLA_SPARSE_DSV4",
    "ROCM_FLASHMLA_SPARSE_DSV4",
    "FLASHMLA_SPARSE_DSV41",
    "FLASHINFER_MLA_SPARSE_DSV41",
    "ROCM_FLASHMLA_SPARSE_DSV41",
    "FLASHMLA_MEGA_ATTN_DSV41",
    "B12X",
    "FLASH_ATTN_MLA",
    "FLASH_ATTN_MLA_SPARSE",
    "FLASH_ATTN_MLA_SPARSE_FA4",
    "MINIMAX_M3_SPARSE",
    "CUTLASS_MSA",
    "TRITON_MSA",
    "STEP5_DSA",
    "KIMI_K3_KV_BALANCED_MLA",
    "NO_ATTENTION",
    "FLEX_ATTENTION",
    "HPC_ATTN",
    "ROCM_AITER_UNIFIED_ATTN",
    "CPU_ATTN",
    "CPU_MLA",
    "AMX_MLA",
    "TURBOQUANT",
    "ROCM_OCTAVE",
    "ULTRAQUANT",
    "CUSTOM",
)
"""``AttentionBackendEnum`` members of vLLM 0.34 (``vllm/v1/attention/backends/registry.py``), in order (0.34 added
``FLASHINFER_TS`` and ``KIMI_K3_KV_BALANCED_MLA`` to 0.33's)."""

#: The variable vLLM (``vllm/envs.py``) and the simulator read their keep-alive from, in whole seconds.
SERVER_KEEPALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
#: The shortest server keep-alive a cluster may have: twice the clients' expiry.
MIN_SERVER_KEEPALIVE_S = 2


def server_keepalive_problem(env: Mapping[str, str]) -> str | None:
    """Why the servers' keep-alive in *env* (a mapping) would race the plugin's clients, or None.

    One rule for every door: ``ClusterSpec.env`` / ``prefill_env`` / ``decode_env`` and the environment pytest
    runs in (which the servers inherit).
    """
    value = env.get(SERVER_KEEPALIVE_ENV)
    if value is None:
        return None
    if not is_int(value):
        return f"{SERVER_KEEPALIVE_ENV}={value!r} is not a whole number of seconds in digits 0-9"
    seconds = int(value)
    if seconds < MIN_SERVER_KEEPALIVE_S:
        return (
            f"{SERVER_KEEPALIVE_ENV}={value!r} is below {MIN_SERVER_KEEPALIVE_S} s: the servers would close idle "
            f"connections that pdserve's clients still reuse (for up to {KEEPALIVE_EXPIRY_S:g} s), and requests would "
            f"fail with 'Server disconnected'; set it to {MIN_SERVER_KEEPALIVE_S} or more, or leave it unset (5)"
        )
    return None
