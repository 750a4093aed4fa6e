"""What a rule decides about one server: vLLM refuses it (and how), or runs something other than what was asked.
[stdlib]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Refusal", "Replacement", "Stage"]

Stage = Literal["argparse", "config", "engine", "request"]
"""When vLLM refuses: ``argparse`` (``vllm serve: error: ...``, exit 2, before anything loads), ``config`` (while it
builds its config, exit 1 before the model loads), ``engine`` (the engine core dies at start, exit 1 after the model
loaded: 30-90 s of a real start on 2 cores) or ``request`` (the engine dies under a request: HTTP 500, then exit)."""


@dataclass(frozen=True)
class Refusal:
    """vLLM refuses (or dies on) a configuration: the reason in vLLM's words, and where vLLM says it.

    :param rule: the rule's id (``connector-kv-role``), the same in the plugin's error and the simulator's log.
    :param message: vLLM's message, as its log prints it after the exception type.
    :param exception: the exception type vLLM raises (``ValueError``), or ``argparse``.
    :param source: the vLLM source line the rule follows
        (``config/kv_transfer.py:120 (KVTransferConfig.__post_init__)``).
    :param validates: the pydantic config class whose validation raises it (``VllmConfig``: vLLM prints
        ``1 validation error for VllmConfig`` and ``Value error, <message>``), or None.
    :param where: what in the configuration it is about, when vLLM's words do not say
        (``kv_transfer_config.kv_connector_extra_config.connectors[1]``), or None.
    """

    rule: str
    stage: Stage
    message: str
    exception: str
    source: str
    validates: str | None = None
    where: str | None = None

    @property
    def exit_status(self) -> int:
        """What the server exits with: argparse's 2, else 1."""
        return 2 if self.stage == "argparse" else 1

    @property
    def stage_words(self) -> str:
        """How vLLM meets it, for a sentence: ``refuses its arguments:``."""
        return {
            "argparse": "refuses its arguments:",
            "config": "refuses its configuration:",
            "engine": "would load the model, then its engine core dies with",
            "request": "dies under a request with",
        }[self.stage]

    def describe(self) -> str:
        """``ValueError: <vLLM's message>`` (argparse: ``vllm serve: error: <message>``)."""
        if self.stage == "argparse":
            return f"vllm serve: error: {self.message}"
        if self.validates is not None:
            return f"ValidationError: 1 validation error for {self.validates}\n  Value error, {self.message}"
        return f"{self.exception}: {self.message}"


@dataclass(frozen=True)
class Replacement:
    """vLLM silently runs ``runs`` where ``asked`` was asked (an alias, a fallback, a no-op flag).

    :param what: what changes (``VLLM_KV_CACHE_LAYOUT``, ``--mamba-cache-mode``).
    """

    rule: str
    what: str
    asked: str
    runs: str
    why: str
    source: str

    def describe(self) -> str:
        """``VLLM_KV_CACHE_LAYOUT HND runs as LBHNC (vLLM 0.32 reads HND as its alias LBHNC)``."""
        return f"{self.what} {self.asked} runs as {self.runs} ({self.why})"
