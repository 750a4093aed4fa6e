"""The simulator computes with the KV decode received (sim/kvcontent.py, issue 44): every way a transfer can deliver
the wrong KV changes decode's answer, as on vLLM, and every way vLLM refuses is refused alike.

Each test drives prefill and decode processes directly, as the toy proxy does, and compares the first token's top
logprobs of the P/D answer with a direct serve of the same prompt on the decode server (``_distance``: the measure
of pytest_pdserve.assertions.logprob_distance).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from pytest_pdserve.assertions import logprob_distance

from ._simproc import NIXL_KVC, Factory, SimServer, free_port, metric, sim_processes, words

BLOCK = 128
PROMPT = words(300, tag="kvc")  # 301 tokens: 2 full blocks and 45 tokens
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def _kvc(**extra: Any) -> str:
    return json.dumps({**json.loads(NIXL_KVC), **extra})


def _side(**env: str) -> dict[str, str]:
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), **env}


def _start(start: Factory, *args: str, block: int = BLOCK, **env: str) -> SimServer:
    return start("--block-size", str(block), "--dtype", "float32", "--kv-transfer-config", _kvc(), *args,
                 env=_side(**env))  # fmt: skip


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimServer]]:
    """p: a prefill; bad: a prefill serving other weights (--hf-overrides); d: a decode; d_recompute: a decode with
    kv_load_failure_policy=recompute; d_drop: a decode whose pulls lose their last 2 blocks."""
    with sim_processes(tmp_path_factory.mktemp("kvc")) as start:
        s = {
            "p": _start(start),
            "bad": _start(start, "--hf-overrides", '{"rms_norm_eps": 0.01}'),
            "d": _start(start),
            "d_recompute": start(
                "--block-size",
                str(BLOCK),
                "--dtype",
                "float32",
                "--kv-transfer-config",
                _kvc(kv_load_failure_policy="recompute"),
                env=_side(),
            ),  # fmt: skip
            "d_drop": _start(start, PDSERVE_SIM_KV_DROP_BLOCKS="2"),
        }
        for server in s.values():
            server.wait_ready()
        yield s


def _prefill(p: SimServer, prompt: str | list[int], salt: str) -> dict[str, Any]:
    r = p.complete(prompt, max_tokens=1, cache_salt=salt, kv_transfer_params=PREFILL_PARAMS)
    assert r.status_code == 200, r.text
    params: dict[str, Any] = r.json()["kv_transfer_params"]
    return params


def _first(r: httpx.Response) -> Mapping[str, float]:
    assert r.status_code == 200, r.text
    top: Mapping[str, float] = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    return top


def _serve(d: SimServer, prompt: str | list[int], salt: str, params: Mapping[str, Any] | None = None) -> httpx.Response:
    body: dict[str, Any] = {"max_tokens": 4, "logprobs": 20, "return_tokens_as_token_ids": True, "cache_salt": salt}
    if params is not None:
        body["kv_transfer_params"] = dict(params)
    return d.complete(prompt, **body)


def _pd_distance(
    p: SimServer, d: SimServer, prompt: str | list[int] = PROMPT, edit: Any = None
) -> tuple[float, httpx.Response]:
    """P/D (prefill on p, decode on d, params edited by ``edit``) against a direct serve on d."""
    salt = uuid.uuid4().hex
    params = _prefill(p, prompt, salt)
    if edit is not None:
        params = edit(params)
    pd = _serve(d, prompt, salt, params)
    direct = _serve(d, prompt, salt + "-direct")
    return (logprob_distance(_first(direct), _first(pd)) if pd.status_code == 200 else float("nan")), pd


def _delta(before: Any, after: Any, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def test_a_correct_transfer_reproduces_the_direct_serve_exactly(servers: dict[str, SimServer]) -> None:
    distance, pd = _pd_distance(servers["p"], servers["d"])
    assert distance == 0.0
    assert pd.json()["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")  # return_tokens_as_token_ids


def test_prefill_serving_other_weights_changes_the_answer(servers: dict[str, SimServer]) -> None:
    before = servers["d"].metrics()
    distance, _ = _pd_distance(servers["bad"], servers["d"])
    assert distance > 0.05
    # and it moved, as far as every counter can tell: the transfer itself looks healthy
    assert _delta(before, servers["d"].metrics(), "vllm:prompt_tokens_by_source_total",
                  source="external_kv_transfer") == 301  # fmt: skip


def test_an_override_equal_to_the_checkpoints_value_changes_nothing(sim_factory: Factory, tmp_path: Path) -> None:
    """vLLM applies --hf-overrides to the checkpoint's config: its own value changes no weight."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "torch_dtype": "float32", "max_position_embeddings": 2048, "vocab_size": 2048, "rms_norm_eps": 1e-6,
    }))  # fmt: skip
    model = str(checkpoint)
    same = {"--hf-overrides": '{"rms_norm_eps": 1e-06}'}
    other = {"--hf-overrides": '{"rms_norm_eps": 0.01}'}
    outputs = {}
    for name, flags in (("plain", {}), ("same", same), ("other", other)):
        server = sim_factory(*[x for kv in flags.items() for x in kv], model=model).wait_ready()
        outputs[name] = _first(_serve(server, PROMPT, "s"))
    assert logprob_distance(outputs["plain"], outputs["same"]) == 0.0
    assert logprob_distance(outputs["plain"], outputs["other"]) > 0.05


def test_blocks_of_another_prompt_change_the_answer(servers: dict[str, SimServer]) -> None:
    """A NIXL read takes whatever the named blocks hold: decode given another request's first block computes with
    its KV (vLLM: no error, another answer)."""
    p = servers["p"]
    other = _prefill(p, words(300, tag="other"), uuid.uuid4().hex)

    def swap_first(params: dict[str, Any]) -> dict[str, Any]:
        ids = list(params["remote_block_ids"][0])
        ids[0] = other["remote_block_ids"][0][0]
        return {**params, "remote_block_ids": [ids]}

    distance, _ = _pd_distance(p, servers["d"], edit=swap_first)
    assert distance > 0.05
    servers["d"].complete(words(300, tag="other"), max_tokens=1, kv_transfer_params=other)  # frees the lease


def test_a_remote_block_list_too_short_kills_decodes_engine(sim_factory: Factory) -> None:
    """vLLM's worker asserts ``num_decode_blocks <= len(prefill_group)``: the request gets HTTP 500 and the decode
    engine dies (measured on vLLM for CPU with one block cut from a 300-token prompt's list)."""
    p = _start(sim_factory).wait_ready()
    d = _start(sim_factory).wait_ready()
    salt = uuid.uuid4().hex
    params = _prefill(p, PROMPT, salt)
    params["remote_block_ids"] = [params["remote_block_ids"][0][:-1]]
    assert _serve(d, PROMPT, salt, params).status_code == 500
    assert d.wait_exit() != 0
    assert "AssertionError in _apply_prefix_caching" in d.log()


def test_a_pull_that_loses_blocks_changes_the_answer_and_reports_success(servers: dict[str, SimServer]) -> None:
    """PDSERVE_SIM_KV_DROP_BLOCKS: the last 2 blocks never arrive; the counters still say they did."""
    before = servers["d_drop"].metrics()
    distance, _ = _pd_distance(servers["p"], servers["d_drop"])
    assert distance > 0.05
    after = servers["d_drop"].metrics()
    assert _delta(before, after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 301
    assert _delta(before, after, "vllm:nixl_num_failed_transfers_total") == 0


def test_a_failed_pull_recomputed_gives_the_right_answer_from_local_kv(servers: dict[str, SimServer]) -> None:
    """kv_load_failure_policy=recompute: the answer is right and ``prompt_tokens_by_source`` says local_compute,
    while the connector's counters still count the promised tokens as hits and the prompt as queried twice (measured
    on vLLM for CPU: +600 queries, +300 hits for one 300-token request)."""
    d = servers["d_recompute"]
    before = d.metrics()
    distance, pd = _pd_distance(servers["p"], d, edit=lambda params: {**params, "remote_port": free_port()})
    assert pd.status_code == 200
    assert distance == 0.0
    after = d.metrics()
    assert _delta(before, after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    # the P/D request and the direct serve each computed the 301 tokens locally
    assert _delta(before, after, "vllm:prompt_tokens_by_source_total", source="local_compute") == 2 * 301
    assert _delta(before, after, "vllm:external_prefix_cache_hits_total") == 301
    assert _delta(before, after, "vllm:external_prefix_cache_queries_total") == 2 * 301 + 301


def test_a_wrong_transfer_stays_in_decodes_prefix_cache(servers: dict[str, SimServer]) -> None:
    """Decode caches the blocks it received: the same prompt under the same salt hits them and is still wrong (its
    full blocks hold prefill's KV); under another salt decode computes the right answer, and a right transfer gives
    it too."""
    p, bad, d = servers["p"], servers["bad"], servers["d"]
    salt = uuid.uuid4().hex
    _serve(d, PROMPT, salt, _prefill(bad, PROMPT, salt))
    before = d.metrics()
    again = _first(_serve(d, PROMPT, salt))
    assert _delta(before, d.metrics(), "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 256
    right = _first(_serve(d, PROMPT, salt + "-fresh"))
    assert logprob_distance(right, again) > 0.05
    assert logprob_distance(right, _first(_serve(d, PROMPT, salt + "-p", _prefill(p, PROMPT, salt + "-p")))) == 0.0


@pytest.mark.parametrize(
    ("prefill_block", "decode_block", "platform", "outcome"),
    [(64, 128, "cuda", "right"), (64, 128, "cpu", "wrong"), (128, 64, "cpu", "refused")],
    ids=["decode-a-multiple-on-a-gpu", "decode-a-multiple-on-cpu", "decode-smaller"],
)
def test_block_sizes_across_the_transfer(
    sim_factory: Factory, prefill_block: int, decode_block: int, platform: str, outcome: str
) -> None:
    """vLLM's TransferTopology.block_size_ratio: decode's block size must be a multiple of prefill's, or the
    handshake fails ("Local block size 64 is not divisible by remote block size 128 or vice versa."); when it is,
    vLLM for CPU reports the transfer whole and computes with misplaced KV (both measured on vLLM for CPU 0.32),
    while a GPU post-processes the sub-blocks into place."""
    p = _start(sim_factory, block=prefill_block, PDSERVE_SIM_PLATFORM=platform).wait_ready()
    d = _start(sim_factory, block=decode_block, PDSERVE_SIM_PLATFORM=platform).wait_ready()
    before = d.metrics()
    distance, pd = _pd_distance(p, d)
    if outcome == "refused":
        assert pd.status_code == 500
        assert "Local block size 64 is not divisible by remote block size 128 or vice versa." in d.log()
        return
    assert _delta(before, d.metrics(), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 301
    assert (distance == 0.0) is (outcome == "right"), distance


def test_a_kv_cache_layout_mismatch_fails_the_handshake(sim_factory: Factory) -> None:
    """vLLM's _validate_remote_agent_handshake: a decode whose KV cache layout differs from prefill's refuses the
    transfer (on a GPU, where both layouts start; vLLM for CPU refuses NHD at start)."""
    p = _start(sim_factory, PDSERVE_SIM_PLATFORM="cuda").wait_ready()
    d = _start(sim_factory, VLLM_KV_CACHE_LAYOUT="NHD", PDSERVE_SIM_PLATFORM="cuda").wait_ready()
    _, pd = _pd_distance(p, d)
    assert pd.status_code == 500
    assert "Heterogeneous TP expects same kv_cache_layout (local LBNHC, remote LBHNC)" in d.log()
    same = _start(sim_factory, VLLM_KV_CACHE_LAYOUT="HND", PDSERVE_SIM_PLATFORM="cuda").wait_ready()  # HND: LBHNC
    assert _pd_distance(p, same)[0] == 0.0


def test_the_hybrid_state_that_arrived_is_the_one_decode_computes_from(sim_factory: Factory) -> None:
    """A hybrid model's prefill stops one token short and sends the Mamba state with the KV: right weights give the
    direct serve's answer, other weights another one; decode loads prompt - 1 tokens."""
    hybrid = ("--trust-remote-code",)
    model = "pdserve-sim/tiny-nemotronh"
    common = ("--block-size", str(BLOCK), "--dtype", "float32", "--kv-transfer-config", _kvc(), *hybrid)
    ds = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
    p = sim_factory(*common, env=_side(**ds), model=model).wait_ready()
    bad = sim_factory(*common, "--hf-overrides", '{"layer_norm_epsilon": 0.01}', env=_side(**ds), model=model)
    d = sim_factory(*common, env=_side(**ds), model=model).wait_ready()
    bad.wait_ready()
    before = d.metrics()
    assert _pd_distance(p, d, prompt=words(40, tag="h"))[0] == 0.0
    assert _delta(before, d.metrics(), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 40
    assert _pd_distance(bad, d, prompt=words(40, tag="h2"))[0] > 0.05


@pytest.mark.parametrize("layout", [None, "SD"])
def test_a_hybrid_model_without_the_ds_conv_state_layout_is_refused_under_nixl(
    sim_factory: Factory, layout: str | None
) -> None:
    """NixlConnector's worker asserts the dim-first conv state: a hybrid server without VLLM_SSM_CONV_STATE_LAYOUT=DS
    (its default is SD) dies at start (measured on vLLM for CPU: exit 1, this message), so a P/D pair whose two sides
    set it differently never starts; without a connector, or with DS, it starts."""
    env = {} if layout is None else {"VLLM_SSM_CONV_STATE_LAYOUT": layout}
    common = ("--block-size", str(BLOCK), "--trust-remote-code")
    model = "pdserve-sim/tiny-nemotronh"
    refused = sim_factory(*common, "--kv-transfer-config", _kvc(), env=_side(**env), model=model)
    assert refused.wait_exit() == 1
    assert "conv transfer requires DS conv state layout. Set VLLM_SSM_CONV_STATE_LAYOUT=DS" in refused.log()
    sim_factory(*common, env=env, model=model).wait_ready()
    ds = _side(VLLM_SSM_CONV_STATE_LAYOUT="DS")
    sim_factory(*common, "--kv-transfer-config", _kvc(), env=ds, model=model).wait_ready()
