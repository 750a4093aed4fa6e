"""The break matrix of docs/faithful-kv.md: every way P/D can hand decode the wrong KV fails `assert_kv_faithful`
(or never starts: vLLM refuses it), on the simulator and on vLLM for CPU; a correct cluster passes it.

Each cell is one test per engine; the `[vllm]` ones form the real-vLLM tier's part of the matrix (tests/gpu/vllm has
the GPU column). To keep real starts few, one cluster carries several cells: `bad-llama` (prefill serving other
weights, decode under kv_load_failure_policy=recompute) holds the wrong-weights cell and the failed-pull cell (a
pull from a prefill that is gone, recomputed by decode with its own right weights); `bad-hybrid` the same for the
hybrid model (simulator only in CI: :data:`HYBRID_ENGINES`); the healthy cells run on the shared real cluster
(conftest's `real_pd_cluster`). The cells that
drive prefill and decode themselves (`route=`) send what the toy proxy sends, with `kv_transfer_params` edited.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from _ports import free_port

from pytest_pdserve.assertions import (
    CONFIDENT_FLIP,
    MIN_CONTEXT_EFFECT,
    PRECONDITION_MESSAGE,
    TOLERANCES,
    FaithfulResult,
    assert_kv_faithful,
    assert_pd_matches_single,
)
from pytest_pdserve.assertions._faithful import default_min_context_effect
from pytest_pdserve.errors import ClusterSpecError, ServerStartupError, VllmRefuses
from pytest_pdserve.glue.fixtures import log_dir
from pytest_pdserve.prompts import prompt_with_tokens
from pytest_pdserve.proxy import prefill_body
from pytest_pdserve.spec import ClusterSpec

ENGINES = ["sim", "vllm"]
#: The hybrid's wrong-KV cells on the simulator only in CI: on vLLM for CPU they need a second real cluster (about
#: 60 s of starts, over the tier's budget) and were measured once (docs/faithful-kv.md); vLLM's hybrid positive
#: control runs in examples/test_mamba_prefix_cache.py and the GPU column runs them all. Add "vllm" to run them here.
HYBRID_ENGINES = ["sim"]
#: A norm epsilon far from the tiny models' (1e-6 for the Llama, 1e-5 for NemotronH): the KV prefill computes has
#: the right shapes and the wrong values (the issue's control; MoRIIO's uses 1.0).
BAD_LLAMA = ("--hf-overrides", json.dumps({"rms_norm_eps": 0.01}))
BAD_HYBRID = ("--hf-overrides", json.dumps({"layer_norm_epsilon": 0.01}))
#: vLLM for CPU's Mamba kernel kills the engine on a prefix-cached hybrid prompt longer than one block.
HYBRID_TOKENS = 40
Route = Callable[[dict[str, Any]], Mapping[str, Any]]
#: A cluster vLLM would not start: a server refused, or no request moved KV (ServerStartupError), or the plugin
#: refused it before starting anything, in vLLM's words (a ClusterSpecError).
NOT_STARTED = (ServerStartupError, ClusterSpecError)


def _spec(engine: str, **fields: Any) -> ClusterSpec:
    return ClusterSpec(engine=engine, **fields)


def _cluster(request: pytest.FixtureRequest, spec: ClusterSpec) -> Any:
    if spec.engine == "vllm":
        request.getfixturevalue("real_vllm")  # skips without real vLLM
    return request.getfixturevalue("pd_cluster_factory")(spec)


def _bad_llama(engine: str) -> ClusterSpec:
    return _spec(engine, prefill_extra_args=BAD_LLAMA, kv_load_failure_policy="recompute", name="bad-llama")


def _bad_hybrid(engine: str) -> ClusterSpec:
    return ClusterSpec.hybrid_ssm(
        engine=engine, prefill_extra_args=BAD_HYBRID, kv_load_failure_policy="recompute", name="bad-hybrid"
    )


def _request(cluster: Any, tokens: int, seed: int) -> dict[str, Any]:
    return {"prompt": prompt_with_tokens(cluster, tokens, seed=seed), "max_tokens": 8}


def _by_hand(cluster: Any, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> Route:
    """P/D as the toy proxy does it (prefill, then decode with prefill's kv_transfer_params), the params edited."""

    def route(body: dict[str, Any]) -> Mapping[str, Any]:
        first = cluster.prefill[0].client.post("/v1/completions", json=prefill_body(body))
        assert first.status_code == 200, first.text
        answer = cluster.decode[0].client.post(
            "/v1/completions", json={**body, "kv_transfer_params": edit(first.json()["kv_transfer_params"])}
        )
        assert answer.status_code == 200, answer.text
        result: Mapping[str, Any] = answer.json()
        return result

    return route


def _gone(params: dict[str, Any]) -> dict[str, Any]:
    """A prefill that is gone: nothing listens at its side channel (and no handshake with it is cached)."""
    return {**params, "remote_port": free_port(), "remote_engine_id": str(uuid.uuid4())}


# --------------------------------------------------------------------------------------------- the healthy cluster


def _healthy_sim(request: pytest.FixtureRequest) -> Any:
    return _cluster(request, _spec("sim", name="faithful"))


def _assert_right(cluster: Any, body: dict[str, Any]) -> None:
    result = assert_kv_faithful(cluster, body)
    assert result.distance <= result.tolerance
    assert result.context_effect is not None
    assert result.context_effect >= 0.05
    assert result.transferred_tokens == result.prefill_tokens > 0
    assert result.split.startswith("matched")  # a prompt of several blocks: the direct serve split as P/D's decode
    _assert_warmed_as_prefill(result)


def _assert_warmed_as_prefill(result: FaithfulResult) -> None:
    """The direct serve first computed what P/D's prefill computed, in one request (the whole prompt for a Llama):
    its cached blocks then hold what a batch of prefill's length gives, which on a GPU may differ from a batch one
    token shorter (docs/faithful-kv.md)."""
    warmed = re.match(r"matched: the direct serve computed (\d+) tokens at once", result.split)
    assert warmed is not None, result.split
    assert int(warmed.group(1)) == result.prefill_tokens


def test_a_correct_cluster_passes_sim(request: pytest.FixtureRequest) -> None:
    cluster = _healthy_sim(request)
    _assert_right(cluster, _request(cluster, 300, 1))


def test_a_correct_cluster_passes_vllm(real_pd_cluster: Any) -> None:
    _assert_right(real_pd_cluster, _request(real_pd_cluster, 300, 1))


def _swap_first_block(cluster: Any) -> tuple[Route, Callable[[], None]]:
    """Decode is given prefill's blocks for the prompt, but the first one is another prompt's (leased on prefill by
    a request of its own): NIXL reads whatever the named block holds, with no error anywhere."""
    other = {"prompt": prompt_with_tokens(cluster, 300, seed=99), "max_tokens": 1, "temperature": 0}
    other["cache_salt"] = f"swap-{uuid.uuid4().hex}"
    leased = cluster.prefill[0].client.post("/v1/completions", json=prefill_body(other)).json()["kv_transfer_params"]

    def edit(params: dict[str, Any]) -> dict[str, Any]:
        ids = list(params["remote_block_ids"][0])
        ids[0] = leased["remote_block_ids"][0][0]
        return {**params, "remote_block_ids": [ids, *params["remote_block_ids"][1:]]}

    def release() -> None:  # decode reads the other prompt's blocks, so prefill frees them
        cluster.decode[0].client.post("/v1/completions", json={**other, "kv_transfer_params": leased})

    return _by_hand(cluster, edit), release


def _assert_partial_delivery_fails(cluster: Any) -> None:
    route, release = _swap_first_block(cluster)
    try:
        with pytest.raises(AssertionError, match="decode did not compute with the right KV") as info:
            assert_kv_faithful(cluster, _request(cluster, 300, 2), route=route)
    finally:
        release()
    assert CONFIDENT_FLIP in str(info.value) or "the generated tokens agree" in str(info.value)


def test_blocks_of_another_prompt_fail_sim(request: pytest.FixtureRequest) -> None:
    _assert_partial_delivery_fails(_healthy_sim(request))


def test_blocks_of_another_prompt_fail_vllm(real_pd_cluster: Any) -> None:
    _assert_partial_delivery_fails(real_pd_cluster)


def test_a_pull_that_loses_blocks_fails_sim(request: pytest.FixtureRequest) -> None:
    """The simulator's fault for a connector that reports a whole transfer and delivered part of it (vLLM's cell is
    the one above: the blocks decode reads are not the prompt's)."""
    cluster = _cluster(request, _spec("sim", decode_env={"PDSERVE_SIM_KV_DROP_BLOCKS": "2"}, name="drop"))
    with pytest.raises(AssertionError, match="decode did not compute with the right KV"):
        assert_kv_faithful(cluster, _request(cluster, 300, 3))


def test_the_context_guard_is_a_precondition_sim(request: pytest.FixtureRequest) -> None:
    """A model or prompt that could not show a wrong KV is named, not passed: a first half of one repeated token, and
    a model that does not read its context (the simulator's stand-in for a tiny model at Hugging Face's default init,
    whose outputs a changed beginning barely moved: issue 44)."""
    cluster = _healthy_sim(request)
    ids = [7] * 300
    with pytest.raises(AssertionError, match=PRECONDITION_MESSAGE.format(what="assert_kv_faithful: the prompt's")):
        assert_kv_faithful(cluster, {"prompt": ids, "max_tokens": 4})
    blind = _cluster(request, _spec("sim", env={"PDSERVE_SIM_CONTEXT_BLIND": "1"}, name="blind"))
    with pytest.raises(AssertionError, match="precondition not met: .*moved the first token's logprobs by only 0 "):
        assert_kv_faithful(blind, _request(blind, 300, 4))


# --------------------------------------------------------------------------------- prefill serving other weights


@pytest.mark.parametrize("engine", ENGINES)
def test_prefill_serving_other_weights_fails(request: pytest.FixtureRequest, engine: str) -> None:
    cluster = _cluster(request, _bad_llama(engine))
    with pytest.raises(AssertionError, match="decode did not compute with the right KV") as info:
        assert_kv_faithful(cluster, _request(cluster, 300, 5))
    assert CONFIDENT_FLIP in str(info.value) or "the generated tokens agree" in str(info.value)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_older_check_calls_it_a_confident_flip(request: pytest.FixtureRequest, engine: str) -> None:
    """assert_pd_matches_single against the decode server sees the same wrong KV as a confident flip (on the old
    tiny models every divergence was a tie flip, which sends the user looking for kernel noise)."""
    cluster = _cluster(request, _bad_llama(engine))
    with pytest.raises(AssertionError) as info:
        assert_pd_matches_single(cluster, _request(cluster, 300, 6), single=cluster.decode[0])
    assert f"verdict: {CONFIDENT_FLIP}" in str(info.value)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failed_pull_recomputed_fails_as_not_transferred(request: pytest.FixtureRequest, engine: str) -> None:
    """kv_load_failure_policy=recompute: decode computes the prompt itself, with its own right weights, so the answer
    is right; the check must still say the KV did not come from prefill."""
    cluster = _cluster(request, _bad_llama(engine))
    with pytest.raises(AssertionError, match="KV not transferred: decode loaded 0 of the 257") as info:
        assert_kv_faithful(cluster, _request(cluster, 300, 7), route=_by_hand(cluster, _gone))
    assert "its answer matches the direct serve's" in str(info.value)


@pytest.mark.parametrize("engine", HYBRID_ENGINES)
def test_hybrid_prefill_serving_other_weights_fails(request: pytest.FixtureRequest, engine: str) -> None:
    """The hybrid's prefill stops one token short and sends the Mamba state: wrong weights change both."""
    cluster = _cluster(request, _bad_hybrid(engine))
    with pytest.raises(AssertionError, match="decode did not compute with the right KV"):
        assert_kv_faithful(cluster, _request(cluster, HYBRID_TOKENS, 8))


@pytest.mark.parametrize("engine", HYBRID_ENGINES)
def test_hybrid_failed_pull_recomputed_fails_as_not_transferred(request: pytest.FixtureRequest, engine: str) -> None:
    cluster = _cluster(request, _bad_hybrid(engine))
    body = _request(cluster, HYBRID_TOKENS, 9)
    with pytest.raises(AssertionError, match=r"KV not transferred: decode loaded 0 of the \d+ prompt tokens"):
        assert_kv_faithful(cluster, body, route=_by_hand(cluster, _gone))


def test_a_correct_hybrid_cluster_passes_sim(request: pytest.FixtureRequest) -> None:
    """(vLLM's hybrid positive control is in examples/test_mamba_prefix_cache.py, on the cluster the examples start.)"""
    cluster = _cluster(request, ClusterSpec.hybrid_ssm(engine="sim", name="faithful-hybrid"))
    result = assert_kv_faithful(cluster, _request(cluster, HYBRID_TOKENS, 10))
    assert result.transferred_tokens == result.prefill_tokens == result.prompt_tokens - 1  # the state's split


# ------------------------------------------------------------------------------- what vLLM refuses before a request


def test_the_default_context_guard_exceeds_every_default_tolerance() -> None:
    """A guard at or below the tolerance is refused (a wrong context that small could not fail the check), so the
    default guard grows with the tolerance: 0.05 nats where the tolerance is small, a fifth over it on a GPU."""
    for engine, tolerance in TOLERANCES.items():
        guard = default_min_context_effect(tolerance)
        assert guard > tolerance, engine
        assert guard == max(MIN_CONTEXT_EFFECT, 1.2 * tolerance), engine
    assert default_min_context_effect(TOLERANCES["vllm-cpu"]) == MIN_CONTEXT_EFFECT


def test_a_block_size_per_side_is_refused_before_a_start() -> None:
    """The cluster's block size is one setting, read back from every server at start (a server that runs another
    fails the start: tests/running/test_start_checks.py); per-side sizes are refused before anything starts, on either
    engine. What vLLM itself does with them is in docs/faithful-kv.md (tests/sim/test_sim_kvcontent.py models it)."""
    for engine in ENGINES:
        with pytest.raises(ClusterSpecError, match="--block-size"):
            ClusterSpec(engine=engine, prefill_extra_args=("--block-size", "64"))
        with pytest.raises(ClusterSpecError, match="--block-size"):
            ClusterSpec(engine=engine, decode_extra_args=("--block-size", "64"))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_kv_cache_layout_set_on_one_side_does_not_start(request: pytest.FixtureRequest, engine: str) -> None:
    """VLLM_KV_CACHE_LAYOUT=NHD on prefill only: vLLM for CPU refuses NHD at start (its CPU backend takes LBHNC, which
    HND names); where both layouts start (a GPU), the NIXL handshake refuses the pair and no P/D request moves KV."""
    spec = _spec(engine, prefill_env={"VLLM_KV_CACHE_LAYOUT": "NHD"}, name="layout-mismatch")
    with pytest.raises(NOT_STARTED) as info:
        _cluster(request, spec)
    assert "kv_cache_layout" in _start_failure(request, info.value, "layout-mismatch").lower(), str(info.value)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_conv_state_layout_set_on_one_side_is_refused_before_a_start(
    request: pytest.FixtureRequest, engine: str
) -> None:
    """VLLM_SSM_CONV_STATE_LAYOUT=SD on the hybrid's prefill only (the seed script sets DS on both): NixlConnector's
    worker refuses a hybrid model without the dim-first conv state at start (pytest_pdserve/rules/conv_state.py), so
    the plugin refuses the cluster before starting anything, in vLLM's words. That vLLM itself dies on it is the
    rule's negative control, one real server in tests/rules/test_start_refusals.py."""
    spec = ClusterSpec.hybrid_ssm(engine=engine, prefill_env={"VLLM_SSM_CONV_STATE_LAYOUT": "SD"}, name="conv-mismatch")
    with pytest.raises(VllmRefuses) as info:
        _cluster(request, spec)
    message = str(info.value)
    assert "prefill-0 would not run" in message
    assert (
        "AssertionError: 3-read Mamba conv transfer requires DS conv state layout. Set VLLM_SSM_CONV_STATE_LAYOUT=DS"
        in message
    )
    assert "Nothing was started" in message
    assert "nixl/base_worker.py" in message  # the vLLM source it follows


def _start_failure(request: pytest.FixtureRequest, exc: BaseException, name: str) -> str:
    """What a failed start says: its message and the logs of the cluster's servers (a refusal at the NIXL handshake
    is in decode's log, while the start error is the proxy's failed round trip)."""
    logs = log_dir(request.config, request.getfixturevalue("tmp_path_factory"))
    text = exc.describe() if isinstance(exc, ServerStartupError) else str(exc)
    return text + "".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"{name}-*.log")))
