"""One server's start, as vLLM judges it: every rule of this package at once, in vLLM's order. [stdlib]

Both doors build :class:`ServerFacts` from what the server gets (its argv and environment) and ask
:func:`check_server`: the plugin before it starts anything (`config/acceptance.py`, which refuses with vLLM's
reason and names what vLLM replaces in the ready line), the simulator at its start (`sim/server.py`, which exits as
vLLM exits and runs what vLLM runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_pdserve.rules import connectors, conv_state, kv_layout, mamba
from pytest_pdserve.rules.block_size import default_block_size
from pytest_pdserve.rules.verdict import Refusal, Replacement
from pytest_pdserve.rules.versions import shown

__all__ = ["ServerFacts", "Verdict", "check_server"]

_STAGES = ("argparse", "config", "engine", "request")


@dataclass(frozen=True)
class ServerFacts:
    """What one server is started with, as far as the rules look.

    :param version: the vLLM version it runs (or the simulator reports).
    :param platform: ``cpu``, ``cuda``, ``rocm`` or ``xpu``.
    :param kv_transfer_config: ``--kv-transfer-config`` parsed, or None.
    :param environ: its whole environment.
    :param attention_backend: the backend it runs (``CPU_ATTN`` on the CPU platform), None when not known.
    :param hybrid: a hybrid (Mamba) model; None when not known (a model the plugin does not build).
    :param mamba_cache_mode: ``--mamba-cache-mode``, or None.
    :param prefix_caching: ``--[no-]enable-prefix-caching``; None: not given (vLLM's default, on).
    :param block_size: ``--block-size``; None: not given (vLLM's default for its version and backend,
        `block_size.default_block_size`).
    """

    version: object
    platform: str
    kv_transfer_config: Mapping[str, Any] | None = None
    environ: Mapping[str, str] = field(default_factory=dict)
    attention_backend: str | None = None
    hybrid: bool | None = None
    mamba_cache_mode: str | None = None
    prefix_caching: bool | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class Verdict:
    """Every refusal (the first is what vLLM reports) and every replacement, plus limits that apply to requests."""

    refusals: tuple[Refusal, ...] = ()
    replacements: tuple[Replacement, ...] = ()
    #: Limits the server will have under requests (the CPU Mamba prefill), one line each.
    limits: tuple[str, ...] = ()

    @property
    def first(self) -> Refusal | None:
        """The refusal vLLM reports: the earliest stage's first."""
        if not self.refusals:
            return None
        return min(self.refusals, key=lambda r: _STAGES.index(r.stage))


def _nixl(config: Mapping[str, Any] | None) -> bool:
    return config is not None and any(c.name in connectors.NIXL_CONNECTORS for c in connectors.connectors(config))


def check_server(facts: ServerFacts) -> Verdict:
    """vLLM's verdict on one server (see the modules of this package for each rule and its vLLM source)."""
    refusals: list[Refusal] = []
    replacements: list[Replacement] = []
    limits: list[str] = []
    if (bad_mode := mamba.check_mode(facts.mamba_cache_mode, facts.version)) is not None:
        refusals.append(bad_mode)
    if facts.kv_transfer_config is not None:
        refusals += connectors.check(facts.kv_transfer_config, version=facts.version, platform=facts.platform)
    layout_refusals, layout_replacements = kv_layout.check(
        facts.environ, version=facts.version, backend=facts.attention_backend, nixl=_nixl(facts.kv_transfer_config)
    )
    refusals += layout_refusals
    replacements += layout_replacements
    conv = conv_state.check(facts.environ, version=facts.version, hybrid=facts.hybrid,
                            nixl=_nixl(facts.kv_transfer_config))  # fmt: skip
    if conv is not None:
        refusals.append(conv)
    prefix_caching = facts.prefix_caching is not False
    if facts.hybrid is not False and bad_mode is None:
        changed = mamba.replacement(facts.mamba_cache_mode, prefix_caching=prefix_caching, version=facts.version)
        if changed is not None:
            replacements.append(changed)
    if facts.hybrid:
        block = facts.block_size or default_block_size(facts.version, facts.attention_backend)
        mode = mamba.running_mode(facts.mamba_cache_mode, prefix_caching=prefix_caching, version=facts.version)
        if mamba.cpu_prefill_dies(
            version=facts.version, platform=facts.platform, hybrid=True, mode=mode, query_start=0,
            query_end=block + 1, block_size=block,
        ):  # fmt: skip
            limits.append(
                f"vLLM {shown(facts.version)} for CPU's engine dies on a hybrid prefill of more than "
                f"{block} tokens (one Mamba block) with prefix caching: its CPU Mamba kernel drops the "
                "checkpoint states"
            )
    return Verdict(tuple(refusals), tuple(replacements), tuple(limits))
