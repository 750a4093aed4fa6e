"""One-line checks for P/D tests that cannot pass vacuously and explain their failures.

Every check measures what it claims: a prefix-cache assertion first proves the cache was queried,
a KV-transfer assertion proves bytes moved over NIXL, a cold/warm comparison proves the warm run
hit the cache. Metrics are read with :func:`pytest_pdserve.metrics.wait_settled` (vLLM updates
them after the response), never after a fixed sleep.

Failures raise a plain :class:`AssertionError`; their texts are the module-level ``*_MESSAGE``
templates, so tests can match them. Pytest-free.

The package holds its private parts: ``_completions`` (requests and responses), ``_measure`` (metrics around
a request, the ``ClusterLike``/``ServerLike`` protocols), ``_report`` (failure texts, flip verdicts),
``_sources`` (prompt-token-source arithmetic), ``_preconditions``, ``_determinism``, ``_cache``, ``_faithful`` and
``_faults`` (the checks; ``_faults``: what P/D must do about a fault a test caused, ``ServerHandle.pause``/``kill``/
``restart``). Everything public is imported here; import it from ``pytest_pdserve.assertions``.
``PDCluster`` / ``ServerHandle`` here are ``pytest_pdserve.PDCluster`` / ``ServerHandle`` themselves; the checks
accept anything shaped like them (``ClusterLike`` / ``ServerLike``).
"""

from __future__ import annotations

from pytest_pdserve.assertions._cache import (
    FIRST_TRANSFER_ZERO_MESSAGE,
    NO_CACHE_HIT_MESSAGE,
    NO_KV_TRANSFER_MESSAGE,
    NOT_REACHED_MESSAGE,
    TRANSFER_NOT_SHRUNK_MESSAGE,
    VACUOUS_NO_QUERIES_MESSAGE,
    MeasuredResult,
    assert_kv_transferred,
    assert_prefix_cache_hit,
    assert_prompt_token_sources,
    assert_transfer_shrinks,
)
from pytest_pdserve.assertions._completions import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEED,
    DEFAULT_TOP_LOGPROBS,
    REQUEST_FAILED_MESSAGE,
    Completion,
    complete,
)
from pytest_pdserve.assertions._determinism import (
    COLD_NOT_COLD_MESSAGE,
    VACUOUS_WARM_MESSAGE,
    ComparisonResult,
    assert_batch_invariant,
    assert_cold_warm_match,
    assert_deterministic,
    assert_pd_matches_single,
)
from pytest_pdserve.assertions._faithful import (
    CONTEXT_EFFECT_MESSAGE,
    DEFAULT_FAITHFUL_TOP_K,
    KV_MISMATCH_MESSAGE,
    MIN_CONTEXT_EFFECT,
    NOT_TRANSFERRED_MESSAGE,
    TOLERANCES,
    FaithfulResult,
    assert_kv_faithful,
    logprob_distance,
)
from pytest_pdserve.assertions._faults import (
    HANG_AFTER,
    HUNG_MESSAGE,
    NOT_PD_READY_MESSAGE,
    NOT_RECOMPUTED_MESSAGE,
    SILENT_MESSAGE,
    SUCCEEDED_MESSAGE,
    FastFailure,
    assert_fails_fast,
    assert_kv_recomputed,
    assert_pd_ready,
)
from pytest_pdserve.assertions._measure import ClusterLike, ServerLike
from pytest_pdserve.assertions._report import (
    CONFIDENT_FLIP,
    DEFAULT_TIE_TOLERANCE,
    DIVERGENCE_MESSAGE,
    FLASH_ATTN_HINT,
    LOGPROB_DRIFT_MESSAGE,
    NO_LOGPROBS_MESSAGE,
    PRECONDITION_MESSAGE,
    TIE_FLIP,
    UNKNOWN_FLIP,
    Check,
    Divergence,
    FlipVerdict,
    classify_flip,
    first_divergence,
    format_checks,
    format_divergence,
)
from pytest_pdserve.assertions._sources import (
    EXPECT_CHOICES,
    PROMPT_SOURCES_MESSAGE,
    Expect,
    expected_prompt_token_sources,
)
from pytest_pdserve.clients import RESET_FAILED_MESSAGE
from pytest_pdserve.cluster import PDCluster, ServerHandle

__all__ = [
    "COLD_NOT_COLD_MESSAGE",
    "CONFIDENT_FLIP",
    "CONTEXT_EFFECT_MESSAGE",
    "DEFAULT_FAITHFUL_TOP_K",
    "DEFAULT_TIE_TOLERANCE",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_SEED",
    "DEFAULT_TOP_LOGPROBS",
    "DIVERGENCE_MESSAGE",
    "EXPECT_CHOICES",
    "FIRST_TRANSFER_ZERO_MESSAGE",
    "FLASH_ATTN_HINT",
    "HANG_AFTER",
    "HUNG_MESSAGE",
    "KV_MISMATCH_MESSAGE",
    "LOGPROB_DRIFT_MESSAGE",
    "MIN_CONTEXT_EFFECT",
    "NOT_PD_READY_MESSAGE",
    "NOT_REACHED_MESSAGE",
    "NOT_RECOMPUTED_MESSAGE",
    "NO_CACHE_HIT_MESSAGE",
    "NO_KV_TRANSFER_MESSAGE",
    "NOT_TRANSFERRED_MESSAGE",
    "NO_LOGPROBS_MESSAGE",
    "PRECONDITION_MESSAGE",
    "PROMPT_SOURCES_MESSAGE",
    "REQUEST_FAILED_MESSAGE",
    "RESET_FAILED_MESSAGE",
    "SETTLE_TIMEOUT",
    "SILENT_MESSAGE",
    "SUCCEEDED_MESSAGE",
    "TIE_FLIP",
    "TOLERANCES",
    "TRANSFER_NOT_SHRUNK_MESSAGE",
    "UNKNOWN_FLIP",
    "VACUOUS_NO_QUERIES_MESSAGE",
    "VACUOUS_WARM_MESSAGE",
    "Check",
    "ClusterLike",
    "Completion",
    "ComparisonResult",
    "Divergence",
    "Expect",
    "FaithfulResult",
    "FastFailure",
    "FlipVerdict",
    "MeasuredResult",
    "PDCluster",
    "ServerHandle",
    "ServerLike",
    "assert_batch_invariant",
    "assert_cold_warm_match",
    "assert_deterministic",
    "assert_fails_fast",
    "assert_kv_faithful",
    "assert_kv_recomputed",
    "assert_kv_transferred",
    "assert_pd_matches_single",
    "assert_pd_ready",
    "assert_prefix_cache_hit",
    "assert_prompt_token_sources",
    "assert_transfer_shrinks",
    "classify_flip",
    "complete",
    "expected_prompt_token_sources",
    "first_divergence",
    "format_checks",
    "format_divergence",
    "logprob_distance",
]

SETTLE_TIMEOUT = 30.0
"""Seconds to wait for a request to show up in metrics (vLLM records them after responding).
Read at call time, so a suite can raise it for slow machines."""
