"""The simulator's start refusals (sim/start_rules.py) beyond what tests/test_start_refusals.py runs on both
engines: the VLLM_ALLOW_LONG_MAX_MODEL_LEN override, the KV cache that cannot hold one request, the CPU rule for
attention backends."""

from __future__ import annotations

import httpx

from ._simproc import Factory, SimServer


def test_a_long_max_model_len_starts_when_told(sim_factory: Factory) -> None:
    server: SimServer = sim_factory("--max-model-len", "4096", env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "true"})
    server.wait_ready()
    assert server.post("/tokenize", {"prompt": "a"}).json()["max_model_len"] == 4096
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution" in server.log()


def test_a_kv_cache_that_cannot_hold_one_request_is_refused_at_start(sim_factory: Factory) -> None:
    # tiny Llama in bfloat16 (the float32 checkpoint under --dtype auto): 512 B per token, 8 KiB per
    # block of 16 (the default); 2048 tokens need 128 blocks = 1 MiB, 1 MiB - 1 byte holds 127 = 2032 tokens.
    budget = str((1 << 20) - 1)
    refused: SimServer = sim_factory("--max-model-len", "2048", "--kv-cache-memory-bytes", budget)
    assert refused.wait_exit() == 1
    assert (
        "To serve at least one request with the model's max seq len (2048), (0.0 GiB KV cache is needed, which is "
        "larger than the available KV cache memory (0.0 GiB). Based on the available memory, the estimated maximum "
        "model length is 2032."
    ) in refused.log()
    fits: SimServer = sim_factory("--max-model-len", "2032", "--kv-cache-memory-bytes", budget)
    fits.wait_ready()
    long = fits.complete(list(range(4, 2020)), max_tokens=16)
    assert long.status_code == 200, long.text  # one request of max_model_len tokens is served, not "KV cache is full"


def test_any_backend_runs_cpu_attn_on_the_simulated_cpu_platform(sim_factory: Factory) -> None:
    cpu: SimServer = sim_factory("--attention-backend", "TRITON_ATTN")
    gpu: SimServer = sim_factory("--attention-backend", "TRITON_ATTN", env={"PDSERVE_SIM_PLATFORM": "cuda"})
    assert httpx.get(cpu.wait_ready().url + "/version").json()["pdserve_sim"]["attention_backend"] == "CPU_ATTN"
    assert "Cannot use AttentionBackendEnum.TRITON_ATTN backend on CPU." in cpu.log()
    assert httpx.get(gpu.wait_ready().url + "/version").json()["pdserve_sim"]["attention_backend"] == "TRITON_ATTN"
