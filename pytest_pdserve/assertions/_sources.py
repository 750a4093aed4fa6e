"""Prompt-token sources: vLLM's multi-connector edge-case arithmetic and the checks built from it.

:func:`expected_prompt_token_sources` says how a decode server must split one request's prompt
tokens between ``local_compute``, ``local_cache_hit`` and ``external_kv_transfer``;
:func:`source_checks` turns a metrics delta into :class:`~pytest_pdserve.assertions._report.Check` rows
against it. Pytest-free; :func:`pytest_pdserve.assertions.assert_prompt_token_sources` runs the
scenarios and re-exports the public names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pytest_pdserve.assertions._report import Check, failure, metric_check, precondition_error
from pytest_pdserve.metrics import NIXL_BYTES_SUM, PROMPT_TOKENS_BY_SOURCE, MetricsDelta

PROMPT_SOURCES_MESSAGE = (
    "prompt token sources do not match expect={expect!r} (prompt_tokens={prompt_tokens},"
    " block_size={block_size}{extra})"
)

Expect = Literal["cold_decode", "full_hit", "partial_hit", "direct_decode"]
EXPECT_CHOICES: tuple[str, ...] = ("cold_decode", "full_hit", "partial_hit", "direct_decode")


def expected_prompt_token_sources(
    expect: str,
    *,
    prompt_tokens: int,
    block_size: int,
    prefix_tokens: int | None = None,
    local_cache_hit: int | None = None,
) -> dict[str, int]:
    """``{source: tokens}`` a decode server must count for one request.

    - ``cold_decode`` (D never saw the prompt): all P tokens arrive over NIXL.
    - ``full_hit`` (D primed directly with the same prompt): D hits whole blocks of at most P-1
      tokens, ``((P-1)//B)*B`` (vLLM always computes the last token); the rest arrives over NIXL.
    - ``partial_hit`` (D primed with a *prefix_tokens*-long prefix): ``(min(L, P-1)//B)*B`` hit.
    - ``direct_decode`` (sent to D directly, no proxy): nothing external; what missed
      *local_cache_hit* (observed) is computed locally.
    """
    if expect not in EXPECT_CHOICES:
        raise ValueError(f"expect={expect!r} is not valid; accepted: {', '.join(EXPECT_CHOICES)}")
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens!r} must be >= 1")
    if block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be >= 1")
    p, b = prompt_tokens, block_size
    if expect == "cold_decode":
        return {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": p}
    if expect == "direct_decode":
        hit = local_cache_hit or 0
        return {"local_compute": p - hit, "local_cache_hit": hit, "external_kv_transfer": 0}
    if expect == "full_hit":
        cached = ((p - 1) // b) * b
    else:
        if prefix_tokens is None or prefix_tokens < 1:
            raise ValueError(f"expect='partial_hit' needs prefix_tokens >= 1, got {prefix_tokens!r}")
        cached = (min(prefix_tokens, p - 1) // b) * b
    return {"local_compute": 0, "local_cache_hit": cached, "external_kv_transfer": p - cached}


def _arithmetic_precondition(expect: str, prompt_tokens: int, block_size: int, prefix_tokens: int | None) -> str | None:
    """Why *expect* cannot be observed for these sizes (``None`` when it can).

    A hit is whole blocks of at most ``P - 1`` tokens, so a full hit needs ``P > B`` and a partial hit a
    prefix of at least one block that is shorter than the prompt; otherwise the expected hit is 0 and the
    check would pass without any hit (the 37-token prompt at block 128 of issue 14).
    """
    p, b = prompt_tokens, block_size
    if expect == "full_hit" and p <= b:
        return (
            f"expect='full_hit' needs a prompt longer than one block: it has {p} tokens and block_size={b},"
            f" so no full block can hit (use at least {b + 1} tokens, e.g. prompt_with_tokens(cluster, {b + 1}))"
        )
    if expect == "partial_hit" and prefix_tokens is not None:
        if (min(prefix_tokens, p - 1) // b) * b < b:
            return (
                f"expect='partial_hit' needs a primed prefix of at least one block: prefix_tokens={prefix_tokens},"
                f" prompt_tokens={p}, block_size={b}, so no block can hit"
            )
        if prefix_tokens >= p:
            return (
                f"expect='partial_hit' needs a primed prefix shorter than the prompt: prefix_tokens={prefix_tokens}"
                f" >= prompt_tokens={p} (that is a full hit)"
            )
    return None


def require_arithmetic(expect: str, prompt_tokens: int, block_size: int, prefix_tokens: int | None) -> None:
    __tracebackhide__ = True
    why = _arithmetic_precondition(expect, prompt_tokens, block_size, prefix_tokens)
    if why is not None:
        raise precondition_error(why)


def source_checks(
    server: str, delta: MetricsDelta, expect: str, prompt_tokens: int, block_size: int, prefix_tokens: int | None
) -> list[Check]:
    observed_hit = delta.get(PROMPT_TOKENS_BY_SOURCE, source="local_cache_hit")
    expected = expected_prompt_token_sources(
        expect,
        prompt_tokens=prompt_tokens,
        block_size=block_size,
        prefix_tokens=prefix_tokens,
        local_cache_hit=int(observed_hit or 0),
    )
    checks = [
        metric_check(server, delta, PROMPT_TOKENS_BY_SOURCE, "==", expected[src], source=src)
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer")
    ]
    if expect == "direct_decode":
        max_hit = ((prompt_tokens - 1) // block_size) * block_size
        hit_check = checks[1]
        valid = observed_hit is not None and observed_hit % block_size == 0 and observed_hit <= max_hit
        checks[1] = Check(
            server,
            hit_check.metric,
            hit_check.before,
            hit_check.after,
            f"k*{block_size} <= {max_hit}",
            valid,
        )
        nixl = metric_check(server, delta, NIXL_BYTES_SUM, "==", 0)
        if nixl.after is None:  # a server without NixlConnector moved nothing, as expected
            nixl = Check(server, NIXL_BYTES_SUM, None, None, "== 0 (or absent)", True)
        checks.append(nixl)
    else:
        checks.append(metric_check(server, delta, NIXL_BYTES_SUM, ">", 0))
    return checks


def raise_if_failed(
    checks: Sequence[Check], expect: str, prompt_tokens: int, block_size: int, prefix_tokens: int | None
) -> None:
    __tracebackhide__ = True
    if all(c.ok for c in checks):
        return
    extra = f", prefix_tokens={prefix_tokens}" if prefix_tokens is not None else ""
    raise failure(
        PROMPT_SOURCES_MESSAGE.format(expect=expect, prompt_tokens=prompt_tokens, block_size=block_size, extra=extra),
        checks,
    )
