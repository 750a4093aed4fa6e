"""assert_kv_faithful: decode computed with the right KV, not just with some KV that moved.

The check of vLLM's MoRIIO end-to-end test (0.34), for any P/D cluster: the first token's top-k logprobs of a P/D
request must equal those of a direct serve of the same prompt on the decode server that answered it, within a
tolerance; decode must have loaded from prefill every token prefill computed (not recomputed them); and a changed
beginning of the prompt must move the direct serve's logprobs by a visible amount, or the comparison could not
have seen a wrong KV (``precondition not met``). docs/faithful-kv.md has the measurements behind the defaults and
the break matrix that proves each way a transfer can go wrong fails here.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from pytest_pdserve.assertions._completions import Completion, complete, from_json
from pytest_pdserve.assertions._measure import ClusterLike as PDCluster
from pytest_pdserve.assertions._measure import ServerLike as ServerHandle
from pytest_pdserve.assertions._measure import measured, servers_of
from pytest_pdserve.assertions._report import (
    Check,
    classify_flip,
    failure,
    first_divergence,
    fmt_num,
    format_divergence,
    metric_check,
    precondition_error,
)
from pytest_pdserve.common.client_options import OPTIONS
from pytest_pdserve.metrics import PROMPT_TOKENS_BY_SOURCE, MetricsDelta

DEFAULT_FAITHFUL_TOP_K = 20
"""Top logprobs compared (vLLM's default ``--max-logprobs``, MoRIIO's ``TOP_K``)."""
MIN_CONTEXT_EFFECT = 0.05
"""Nats a changed first half of the prompt must move the first token's logprobs by (MoRIIO's guard), at least: with
a larger tolerance the default guard is :data:`CONTEXT_OVER_TOLERANCE` times the tolerance (a wrong context that
moved the logprobs by less than the tolerance could not fail the check)."""
CONTEXT_OVER_TOLERANCE = 1.2
"""The default guard's margin over the tolerance (:func:`default_min_context_effect`)."""
TOLERANCES = {"sim": 1e-6, "vllm-cpu": 1e-4, "vllm-gpu": 0.25}
"""Default tolerance per engine and platform, in nats over the centered top-k logprobs (docs/faithful-kv.md,
"Tolerances", has the measurements): the simulator is exact; vLLM for CPU (float32) computes P/D and the direct
serve alike to 1e-5. On a GPU (bfloat16) correct clusters differ where the direct serve cannot compute as P/D did (a
prompt of one block or less, ``split="cold"``: the last token computed with the others, not alone) by about a
tenth of a nat, and wrong KV by a nat or more; the tolerance sits between the two."""

NOT_TRANSFERRED_MESSAGE = (
    "KV not transferred: decode loaded {loaded} of the {expected} prompt tokens prefill computed "
    "(external_kv_transfer) and computed {computed} itself; {why}"
)
KV_MISMATCH_MESSAGE = (
    "decode did not compute with the right KV: P/D's first-token logprobs differ from a direct serve's on {server} "
    "by {distance} over the top {top_k} (tolerance {tolerance} nats; {split})"
)
CONTEXT_EFFECT_MESSAGE = (
    "assert_kv_faithful: changing the first half of the prompt moved the first token's logprobs by only {effect} "
    "nats on {server} (at least {minimum} needed), so a wrong KV would not show either; the model barely reads "
    "its context (pytest-pdserve's tiny models do; a model with near-uniform outputs does not) or the prompt is "
    "too short"
)

Split = Literal["matched", "cold"]
Deltas = dict[str, MetricsDelta]


@dataclass(frozen=True)
class FaithfulResult:
    """What :func:`assert_kv_faithful` compared and measured.

    ``distance``: centered first-token logprob difference, P/D against direct, over the direct serve's top-k
    (:func:`logprob_distance`); ``context_effect``: the same measure between the direct serve and one of the prompt
    with its first half changed (``None`` when the guard was off); ``split``: how the direct serve split the prompt.
    """

    prompt_tokens: int
    split: str
    distance: float
    tolerance: float
    context_effect: float | None
    transferred_tokens: int
    prefill_tokens: int
    decode: str
    pd: Completion
    direct: Completion


def logprob_distance(reference: Mapping[str, float], other: Mapping[str, float]) -> float:
    """The largest difference of centered logprobs over the tokens both top-k lists hold (MoRIIO's ``_distance``).

    Centering removes the log-sum-exp offset, leaving the logit differences the KV determines. ``inf`` when fewer
    than half of the reference's tokens are in both lists (the distributions are not comparable at all).
    """
    common = sorted(reference.keys() & other.keys())
    if not common or len(common) < len(reference) // 2:
        return math.inf
    ref_mean = sum(reference[t] for t in common) / len(common)
    other_mean = sum(other[t] for t in common) / len(common)
    return max(abs((reference[t] - ref_mean) - (other[t] - other_mean)) for t in common)


def default_tolerance(engine: str | None, platform: str | None) -> float:
    """The tolerance :func:`assert_kv_faithful` uses unless given (:data:`TOLERANCES`)."""
    if engine == "sim":
        return TOLERANCES["sim"]
    return TOLERANCES["vllm-cpu" if platform == "cpu" else "vllm-gpu"]


def default_min_context_effect(tolerance: float) -> float:
    """The context guard :func:`assert_kv_faithful` uses unless given: :data:`MIN_CONTEXT_EFFECT`, or
    :data:`CONTEXT_OVER_TOLERANCE` times the tolerance where that is larger (the guard must exceed the tolerance)."""
    return max(MIN_CONTEXT_EFFECT, CONTEXT_OVER_TOLERANCE * tolerance)


def _first_top(c: Completion, label: str) -> Mapping[str, float]:
    __tracebackhide__ = True
    if not c.top_logprobs or not c.top_logprobs[0]:
        raise AssertionError(f"assert_kv_faithful: {label} returned no top logprobs for its first token")
    return c.top_logprobs[0]


def _prompt_ids(cluster: PDCluster, server: ServerHandle, request: Mapping[str, Any]) -> list[int]:
    __tracebackhide__ = True
    if "messages" in request:
        raise ValueError("assert_kv_faithful compares completions of one prompt: give 'prompt' (text or token ids)")
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"assert_kv_faithful needs a text or token-id prompt, got {prompt!r:.80}")
    response = server.client.post("/tokenize", json={"model": cluster.model, "prompt": prompt})
    if response.status_code != 200:
        raise AssertionError(f"POST {server.url}/tokenize answered {response.status_code}: {response.text[:500]}")
    return [int(t) for t in response.json()["tokens"]]


def _changed_beginning(ids: Sequence[int]) -> list[int] | None:
    """The prompt with its first half changed (reversed, else rotated), or None when no change is possible."""
    half = len(ids) // 2
    head = list(ids[:half])
    for changed in (head[::-1], head[1:] + head[:1]):
        if changed != head:
            return changed + list(ids[half:])
    return None


def _salts(request: Mapping[str, Any]) -> tuple[str, str, str]:
    """Fresh cache salts for the P/D, direct and context legs: none of them may hit a cache another filled."""
    base = str(request.get("cache_salt") or OPTIONS.salt or "pdserve")[:80]
    tag = uuid.uuid4().hex[:12]
    return f"{base}-kvf{tag}-pd", f"{base}-kvf{tag}-direct", f"{base}-kvf{tag}-context"


def _tokens(deltas: Mapping[str, MetricsDelta], servers: Sequence[ServerHandle], source: str) -> int:
    counted = (deltas[s.name].get(PROMPT_TOKENS_BY_SOURCE, source=source) or 0 for s in servers if s.name in deltas)
    return int(sum(counted))


def _server_that_answered(cluster: PDCluster, deltas: Mapping[str, MetricsDelta]) -> ServerHandle:
    """The decode server whose prompt-token counters moved most (the one the proxy chose)."""

    def moved(server: ServerHandle) -> float:
        d = deltas.get(server.name)
        return sum((d.get(PROMPT_TOKENS_BY_SOURCE, source=s) or 0) for s in SOURCES) if d is not None else 0.0

    return max(cluster.decode, key=moved)


SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def assert_kv_faithful(
    cluster: PDCluster,
    request: Mapping[str, Any],
    *,
    top_k: int = DEFAULT_FAITHFUL_TOP_K,
    tolerance: float | None = None,
    min_context_effect: float | None = None,
    split: Split = "matched",
    route: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None,
) -> FaithfulResult:
    """P/D must compute *request*'s first token as the decode server computes it alone: the KV was right.

    Three requests, each under a cache salt of its own (so none hits a cache another filled): the P/D one through
    the proxy; a direct serve of the same prompt on the decode server that answered it; and the same prompt with
    its first half changed, on that server. Then, in this order:

    1. decode loaded every token prefill computed (``prompt_tokens_by_source{source="external_kv_transfer"}`` on
       decode equals prefill's computed and cached prompt tokens; a hybrid model's prefill stops one token short
       and so does this count). A pull that failed under ``kv_load_failure_policy="recompute"`` gives the right
       answer from KV decode recomputed: that fails here, saying so;
    2. precondition: the changed beginning moved the direct serve's first-token logprobs by ``min_context_effect``
       nats or more (default :func:`default_min_context_effect`; ``0`` turns this guard and its request off);
    3. the P/D and direct first-token logprobs are within ``tolerance`` nats (:func:`logprob_distance` over the
       direct serve's ``top_k``); the failure shows both outputs, where they part and whether that was a tie flip
       or a confident flip.

    :param request: a completion request with a ``prompt`` (text, tokenized by the decode server, or token ids);
        ``max_tokens`` (default 16) only adds context to a failure. Sent with temperature 0.
    :param split: ``"matched"`` (default): the prompt is cut to ``k * block_size + 1`` tokens; the direct serve
        first computes what P/D's prefill computed (the whole prompt, or a hybrid model's first ``k`` blocks), so
        that its cache holds the first ``k`` blocks as computed in a batch of prefill's size, then the prompt again
        with its last token computed alone from that cache, as P/D's decode does (MoRIIO's matched split); a prompt
        of one block or less is served cold. ``"cold"``: the whole prompt at once.
    :param tolerance: nats; default by engine and platform (:data:`TOLERANCES`).
    :param route: how the P/D request is sent (default: through the proxy): a callable taking the request body and
        returning the response JSON, for tests that drive prefill and decode themselves (a negative control that
        edits ``kv_transfer_params``, say). It must send one request to a prefill and one to a decode server.
    """
    __tracebackhide__ = True
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 2 <= top_k <= 20:
        raise ValueError(f"top_k={top_k!r} must be a whole number from 2 to 20 (vLLM's default --max-logprobs)")
    if split not in ("matched", "cold"):
        raise ValueError(f"split={split!r} must be 'matched' or 'cold'")
    tol = default_tolerance(cluster.engine, getattr(cluster, "platform", None)) if tolerance is None else tolerance
    if min_context_effect is None:
        min_context_effect = default_min_context_effect(tol)
    if not tol >= 0 or not min_context_effect >= 0:
        raise ValueError(f"tolerance={tolerance!r} and min_context_effect={min_context_effect!r} must be >= 0 (nats)")
    if min_context_effect and min_context_effect <= tol:
        raise ValueError(
            f"min_context_effect={min_context_effect} must exceed the tolerance {tol}: a wrong context that moves "
            "the logprobs by less than the tolerance could not fail the check"
        )
    servers = servers_of(cluster)
    ids = _prompt_ids(cluster, cluster.decode[0], request)
    block = cluster.block_size
    cached = 0
    if split == "matched" and len(ids) > block:
        cached = (len(ids) - 1) // block * block
        ids = ids[: cached + 1]
    pd_salt, direct_salt, context_salt = _salts(request)
    body = {k: v for k, v in request.items() if k not in ("prompt", "cache_salt", "logprobs")}
    body.update(model=cluster.model, temperature=0, logprobs=top_k, return_token_ids=True,
                return_tokens_as_token_ids=True)  # fmt: skip
    body.setdefault("max_tokens", 16)

    def leg(target: ServerHandle | httpx.Client, prompt: list[int], salt: str, **extra: Any) -> Completion:
        return complete(target, {**body, "prompt": prompt, "cache_salt": salt, **extra})

    def on(server: ServerHandle, prompt: list[int], salt: str, **extra: Any) -> tuple[Completion, Deltas]:
        # Measured (its metrics settled) so that no later measurement counts this request's late counters.
        return measured([server], lambda: leg(server, prompt, salt, **extra), requests=1)

    if route is None:
        pd, pd_deltas = measured(servers, lambda: leg(cluster.client, ids, pd_salt), requests=2)
    else:
        sent = {**body, "prompt": ids, "cache_salt": pd_salt}
        pd, pd_deltas = measured(servers, lambda: from_json(route(sent), "P/D (route)"), requests=2)
    decode = _server_that_answered(cluster, pd_deltas)
    expected = _tokens(pd_deltas, cluster.prefill, "local_compute") + _tokens(
        pd_deltas, cluster.prefill, "local_cache_hit"
    )
    split_text = "cold: the direct serve computed the whole prompt at once"
    warmed = 0
    if cached:
        # The cached blocks are computed in a batch as long as prefill's (the whole prompt; a hybrid's prefill stops
        # at the last full block): in bfloat16 a batch one token shorter may round differently.
        _, warm_deltas = on(decode, ids[: max(cached, min(expected, len(ids)))], direct_salt, max_tokens=1)
        warmed = _tokens(warm_deltas, [decode], "local_compute")
    direct, direct_deltas = on(decode, ids, direct_salt)
    if cached:
        hit = _tokens(direct_deltas, [decode], "local_cache_hit")
        split_text = (
            f"matched: the direct serve computed {warmed} tokens at once as P/D's prefill did, then took {hit} from "
            f"its own cache and computed {len(ids) - hit}, as P/D's decode"
            if hit == cached and warmed == expected
            else f"not matched: the direct serve first computed {warmed} tokens (P/D's prefill {expected}), then "
            f"took {hit} from its own cache (P/D's decode {cached})"
        )
    loaded = _tokens(pd_deltas, cluster.decode, "external_kv_transfer")
    computed = _tokens(pd_deltas, cluster.decode, "local_compute")
    ref_top, pd_top = _first_top(direct, f"the direct serve on {decode.name}"), _first_top(pd, "P/D")
    distance = logprob_distance(ref_top, pd_top)
    if loaded != expected or expected == 0:
        raise failure(
            NOT_TRANSFERRED_MESSAGE.format(
                loaded=loaded, expected=expected, computed=computed, why=_why(loaded, expected, computed, distance, tol)
            ),
            _transfer_checks(cluster, pd_deltas, expected, loaded),
        )
    effect: float | None = None
    if min_context_effect:
        changed = _changed_beginning(ids)
        if changed is None:
            raise precondition_error(
                "assert_kv_faithful: the prompt's first half is one token repeated, so no change of it can show "
                "whether the KV was right"
            )
        moved, _ = on(decode, changed, context_salt)
        effect = logprob_distance(ref_top, _first_top(moved, "the changed prompt"))
        if not effect >= min_context_effect:
            raise precondition_error(
                CONTEXT_EFFECT_MESSAGE.format(effect=f"{effect:.3g}", server=decode.name, minimum=min_context_effect)
            )
    if not distance <= tol:
        shared = len(ref_top.keys() & pd_top.keys())
        shown = f"{distance:.4g} nats" if math.isfinite(distance) else f"everything (the lists share {shared} tokens)"
        message = KV_MISMATCH_MESSAGE.format(
            server=decode.name, distance=shown, top_k=len(ref_top), tolerance=tol, split=split_text
        )
        raise AssertionError(message + "\n" + _comparison(cluster, pd, direct, decode.name))
    return FaithfulResult(len(ids), split_text, distance, tol, effect, loaded, expected, decode.name, pd, direct)


def _why(loaded: int, expected: int, computed: int, distance: float, tol: float) -> str:
    answer = (
        "its answer matches the direct serve's, from KV it computed itself"
        if distance <= tol
        else f"its answer differs from the direct serve's by {distance:.4g} nats"
    )
    if expected == 0:
        return "prefill computed no prompt token for this request (did it go through P/D?)"
    if loaded == 0:
        return f"decode recomputed the prompt (a failed KV load under kv_load_failure_policy='recompute'?); {answer}"
    if loaded < expected:
        return f"decode recomputed {expected - loaded} of them; {answer}"
    return f"decode loaded more than prefill computed; {answer}"


def _transfer_checks(cluster: PDCluster, deltas: Mapping[str, MetricsDelta], expected: int, loaded: int) -> list[Check]:
    """The prompt-token counters of the P/D request, per server: what prefill computed, where decode's came from."""
    checks = []
    for server in (*cluster.prefill, *cluster.decode):
        delta = deltas.get(server.name)
        if delta is None:
            continue
        for source in SOURCES:
            if server in cluster.prefill and source == "external_kv_transfer":
                continue
            row = metric_check(server.name, delta, PROMPT_TOKENS_BY_SOURCE, ">=", 0, source=source)
            if server in cluster.decode and source == "external_kv_transfer":
                want, ok = f"{fmt_num(expected)} in all", loaded == expected
            else:
                want, ok = "", True
            checks.append(Check(row.server, row.metric, row.before, row.after, want, ok))
    return checks


def _comparison(cluster: PDCluster, pd: Completion, direct: Completion, decode: str) -> str:
    """Both outputs side by side from their first differing token (or their first token when they agree)."""
    div = first_divergence(pd, direct)
    if div is None:
        top_pd = pd.top_logprobs[0] if pd.top_logprobs else {}
        top_direct = direct.top_logprobs[0] if direct.top_logprobs else {}
        return (
            "  the generated tokens agree; first-token top logprobs:\n"
            f"    P/D: {_ranked(top_pd)}\n    direct on {decode}: {_ranked(top_direct)}"
        )
    verdict = classify_flip(pd, direct, div)
    text = format_divergence(
        "P/D against the direct serve",
        pd,
        direct,
        div,
        labels=("P/D", f"direct on {decode}"),
        engine=cluster.engine,
        backend=cluster.attention_backend,
        verdict=verdict,
    )
    return "\n".join(line for line in text.split("\n")[1:] if "hint:" not in line)


def _ranked(top: Mapping[str, float], limit: int = 5) -> str:
    ranked = sorted(top.items(), key=lambda kv: -kv[1])[:limit]
    return "{" + ", ".join(f"{k!r}: {v:.4f}" for k, v in ranked) + "}"
