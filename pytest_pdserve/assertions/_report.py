"""Failure texts: where two outputs diverge, and metric tables of what was checked.

:func:`first_divergence` finds the first differing token (or character) of two completions and
:func:`format_divergence` shows it with its context, token ids and top logprobs; :func:`compare_outputs`
and :func:`compare_logprobs` raise with that text. :class:`Check` is one metric row (before,
after, expected) and :func:`format_checks` renders them as a table per server. Pytest-free; the
public names are re-exported by :mod:`pytest_pdserve.assertions`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pytest_pdserve.assertions._completions import Completion
from pytest_pdserve.assertions._measure import ClusterLike as PDCluster
from pytest_pdserve.metrics import MetricsDelta

T = TypeVar("T")

FLASH_ATTN_HINT = (
    "hint: FLASH_ATTN is not batch-invariant on Hopper; try --attention-backend=FLASHINFER or "
    "TRITON_ATTN, or VLLM_BATCH_INVARIANT=1"
)
DIVERGENCE_MESSAGE = "{title}: outputs differ at {unit} {index} ({label_a}: {len_a}, {label_b}: {len_b} {unit}s)"
LOGPROB_DRIFT_MESSAGE = "{title}: top-1 logprob drift {drift:.4f} at token {index} exceeds the tolerance {tolerance}"
NO_LOGPROBS_MESSAGE = "{title}: logprob_tolerance needs top logprobs, but {label} returned none"
PRECONDITION_MESSAGE = "precondition not met: {what}"
FLIP_VERDICT_MESSAGE = (
    "  verdict: {verdict} (top-1/top-2 logprob gap {gap} at token {index}; a tie flip is a gap under {tolerance})"
)
TIE_FLIP = "tie flip"
CONFIDENT_FLIP = "confident flip"
UNKNOWN_FLIP = "unknown flip"
DEFAULT_TIE_TOLERANCE = 0.05
"""Nats: a top-1/top-2 gap under this at the first divergence is called a tie flip (batch variance can
flip near-ties; vLLM issues #47069, #51902 separate those from real bugs) unless a test passes its own."""
_WINDOW = 40  # characters of text shown around a divergence

# ---------------------------------------------------------------------------------------------
# Divergence
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    """Where two completions part: ``unit`` is ``"token"`` (ids compared) or ``"character"``."""

    unit: Literal["token", "character"]
    index: int
    char_index: int


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def first_divergence(a: Completion, b: Completion) -> Divergence | None:
    """``None`` when *a* and *b* agree (token ids when both have them, else text)."""
    char_index = _common_prefix(a.text, b.text)
    if a.token_ids is not None and b.token_ids is not None:
        index = _common_prefix(a.token_ids, b.token_ids)
        if index < max(len(a.token_ids), len(b.token_ids)):
            if a.tokens is not None:
                # Cut the text window at the token boundary when the token strings spell the text.
                head = "".join(a.tokens[:index])
                if a.text.startswith(head) and b.text.startswith(head):
                    char_index = len(head)
            return Divergence("token", index, char_index)
    if a.text != b.text:
        return Divergence("character", char_index, char_index)
    return None


@dataclass(frozen=True)
class FlipVerdict:
    """What kind of divergence two outputs show at their first differing token.

    ``gap`` is the larger of both runs' top-1/top-2 logprob gaps at ``index`` (``None`` without two top
    logprobs in either run); the verdict is ``"tie flip"`` when every available gap is under the
    tolerance, ``"confident flip"`` when one is not, and ``"unknown flip"`` without logprobs.
    """

    index: int
    token_a: int | str | None
    token_b: int | str | None
    gap: float | None
    tolerance: float
    verdict: str

    @property
    def is_tie(self) -> bool:
        return self.verdict == TIE_FLIP


def _gap(top: Sequence[Mapping[str, float]] | None, index: int) -> float | None:
    if top is None or index >= len(top) or len(top[index]) < 2:
        return None
    first, second = sorted(top[index].values(), reverse=True)[:2]
    return first - second


def classify_flip(a: Completion, b: Completion, div: Divergence, tolerance: float | None = None) -> FlipVerdict:
    """The :class:`FlipVerdict` of a token divergence (*tolerance* default :data:`DEFAULT_TIE_TOLERANCE`)."""
    tol = DEFAULT_TIE_TOLERANCE if tolerance is None else tolerance
    i = div.index
    gaps = [g for g in (_gap(a.top_logprobs, i), _gap(b.top_logprobs, i)) if g is not None]
    verdict = UNKNOWN_FLIP
    if div.unit == "token" and gaps:
        verdict = TIE_FLIP if max(gaps) < tol else CONFIDENT_FLIP
    return FlipVerdict(i, _token_at(a, i), _token_at(b, i), max(gaps) if gaps else None, tol, verdict)


def _token_at(c: Completion, i: int) -> int | str | None:
    return _at(c.token_ids, i) if c.token_ids is not None else (_at(c.tokens, i) if c.tokens is not None else None)


def _needs_flash_attn_hint(backend: str | None) -> bool:
    return backend is None or backend.strip().upper() in ("", "AUTO", "FLASH_ATTN")


def _at(seq: Sequence[T] | None, index: int) -> T | str:
    if seq is None:
        return "n/a"
    return seq[index] if index < len(seq) else "(ended)"


def _format_top(top: Mapping[str, float] | str) -> str:
    if isinstance(top, str):
        return top
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return "{" + ", ".join(f"{tok!r}: {lp:.4f}" for tok, lp in ranked) + "}"


def format_divergence(
    title: str,
    a: Completion,
    b: Completion,
    div: Divergence,
    *,
    labels: tuple[str, str],
    engine: str | None,
    backend: str | None,
    verdict: FlipVerdict | None = None,
) -> str:
    """The failure text for two diverging outputs (see :data:`DIVERGENCE_MESSAGE`)."""
    la, lb = labels
    width = max(len(la), len(lb), len("common prefix"))
    unit_len_a = len(a.token_ids) if div.unit == "token" and a.token_ids is not None else len(a.text)
    unit_len_b = len(b.token_ids) if div.unit == "token" and b.token_ids is not None else len(b.text)
    c = div.char_index
    lines = [
        DIVERGENCE_MESSAGE.format(
            title=title, unit=div.unit, index=div.index, label_a=la, label_b=lb, len_a=unit_len_a, len_b=unit_len_b
        ),
        f"  {'common prefix':>{width}}: ...{a.text[max(0, c - _WINDOW) : c]!r}",
        f"  {la:>{width}}: {a.text[c : c + _WINDOW]!r}...",
        f"  {lb:>{width}}: {b.text[c : c + _WINDOW]!r}...",
    ]
    if div.unit == "token":
        i = div.index
        lines.append(f"  token ids at {i}: {la}={_at(a.token_ids, i)} {lb}={_at(b.token_ids, i)}")
        if a.tokens is not None or b.tokens is not None:
            lines.append(f"  tokens at {i}: {la}={_at(a.tokens, i)!r} {lb}={_at(b.tokens, i)!r}")
        if a.top_logprobs is not None or b.top_logprobs is not None:
            lines.append(f"  top logprobs at {i}:")
            lines.append(f"    {la}: {_format_top(_at(a.top_logprobs, i))}")
            lines.append(f"    {lb}: {_format_top(_at(b.top_logprobs, i))}")
        if verdict is not None:
            gap = "n/a (no top-2 logprobs)" if verdict.gap is None else f"{verdict.gap:.4f}"
            lines.append(
                FLIP_VERDICT_MESSAGE.format(verdict=verdict.verdict, gap=gap, index=i, tolerance=verdict.tolerance)
            )
    else:
        lines.append("  (no token ids returned: compared text only)")
    lines.append(f"  engine={engine or 'unknown'} attention_backend={backend or 'auto'}")
    if _needs_flash_attn_hint(backend):
        lines.append(FLASH_ATTN_HINT)
    return "\n".join(lines)


def compare_outputs(
    title: str,
    outputs: Sequence[Completion],
    labels: Sequence[str],
    *,
    engine: str | None,
    backend: str | None,
    tie_tolerance: float | None = None,
) -> list[FlipVerdict]:
    """Raise at the first output that differs from the first one, unless it is a tie flip and
    *tie_tolerance* accepts those; returns the accepted tie flips."""
    __tracebackhide__ = True
    accepted: list[FlipVerdict] = []
    for i in range(1, len(outputs)):
        div = first_divergence(outputs[0], outputs[i])
        if div is not None:
            verdict = classify_flip(outputs[0], outputs[i], div, tie_tolerance)
            if tie_tolerance is not None and verdict.is_tie:
                accepted.append(verdict)
                continue
            raise AssertionError(
                format_divergence(
                    title,
                    outputs[0],
                    outputs[i],
                    div,
                    labels=(labels[0], labels[i]),
                    engine=engine,
                    backend=backend,
                    verdict=verdict,
                )
            )
    return accepted


def compare_logprobs(
    title: str, a: Completion, b: Completion, labels: tuple[str, str], tolerance: float, cluster: PDCluster
) -> None:
    __tracebackhide__ = True
    for completion, label in ((a, labels[0]), (b, labels[1])):
        if completion.top1_logprob(0) is None:
            raise AssertionError(NO_LOGPROBS_MESSAGE.format(title=title, label=label))
    div = first_divergence(a, b)
    ids_a = a.token_ids or a.tokens or ()
    ids_b = b.token_ids or b.tokens or ()
    n = min(len(ids_a), len(ids_b)) if ids_a and ids_b else min(len(a.top_logprobs or ()), len(b.top_logprobs or ()))
    # After the first differing token the contexts differ, so later logprobs are not comparable.
    last = n if div is None or div.unit != "token" else min(n, div.index + 1)
    for i in range(last):
        la, lb = a.top1_logprob(i), b.top1_logprob(i)
        if la is None or lb is None:
            continue
        drift = abs(la - lb)
        if drift > tolerance:
            detail = format_divergence(
                title,
                a,
                b,
                Divergence("token", i, _common_prefix(a.text, b.text)),
                labels=labels,
                engine=cluster.engine,
                backend=cluster.attention_backend,
            )
            raise AssertionError(
                LOGPROB_DRIFT_MESSAGE.format(title=title, drift=drift, index=i, tolerance=tolerance)
                + "\n"
                + detail.split("\n", 1)[1]
            )


# ---------------------------------------------------------------------------------------------
# Metric tables
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One row of a failure table: a metric's before/after on a server and what was expected."""

    server: str
    metric: str
    before: float | None
    after: float | None
    expected: str
    ok: bool

    @property
    def delta(self) -> float | None:
        if self.after is None:
            return None
        return self.after - (self.before or 0.0)


def fmt_num(v: float | None) -> str:
    if v is None:
        return "absent"
    return str(int(v)) if v == int(v) else f"{v:.4g}"


def _labels_text(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def metric_check(server: str, delta: MetricsDelta, name: str, op: str, target: float, **labels: str) -> Check:
    before = delta.before.get(name, **labels)
    after = delta.after.get(name, **labels)
    d = None if after is None else after - (before or 0.0)
    ok = (
        d is not None
        and {"==": d == target, ">": d > target, ">=": d >= target, "<": d < target, "<=": d <= target}[op]
    )
    return Check(server, name + _labels_text(labels), before, after, f"{op} {fmt_num(target)}", ok)


def format_checks(checks: Sequence[Check]) -> str:
    """A table ``metric | before | after | delta | expected`` grouped by server; bad rows marked."""
    header = ("metric", "before", "after", "delta", "expected", "")
    rows = [
        (c.metric, fmt_num(c.before), fmt_num(c.after), fmt_num(c.delta), c.expected, "ok" if c.ok else "<-- FAIL")
        for c in checks
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(5)]

    def line(r: Sequence[str]) -> str:
        cells = [str(r[0]).ljust(widths[0])] + [str(r[i]).rjust(widths[i]) for i in range(1, 5)]
        return "    " + " | ".join(cells) + (f"  {r[5]}" if r[5] else "")

    out: list[str] = []
    server = None
    for c, r in zip(checks, rows, strict=True):
        if c.server != server:
            server = c.server
            out.append(f"  {server}:")
            out.append(line(header))
        out.append(line(r))
    return "\n".join(out)


def failure(headline: str, checks: Sequence[Check]) -> AssertionError:
    return AssertionError(headline + ("\n" + format_checks(checks) if checks else ""))


def precondition_error(what: str, checks: Sequence[Check] = ()) -> AssertionError:
    """The error of a check that could not have measured what it claims (see :data:`PRECONDITION_MESSAGE`)."""
    return failure(PRECONDITION_MESSAGE.format(what=what), checks)
