"""The simulator's start refusals (sim/start_rules.py) beyond what tests/rules/test_start_refusals.py runs on both
engines: the VLLM_ALLOW_LONG_MAX_MODEL_LEN override, the KV cache that cannot hold one request, the CPU rule for
attention backends and the simulated GPUs' rules (sim/attention.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from ._simproc import Factory, SimServer, free_port


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
    assert (
        httpx.get(cpu.wait_ready().url + "/version", timeout=60).json()["pdserve_sim"]["attention_backend"]
        == "CPU_ATTN"
    )
    assert "Cannot use AttentionBackendEnum.TRITON_ATTN backend on CPU." in cpu.log()
    assert (
        httpx.get(gpu.wait_ready().url + "/version", timeout=60).json()["pdserve_sim"]["attention_backend"]
        == "TRITON_ATTN"
    )


def _backend(server: SimServer) -> str:
    return str(httpx.get(server.wait_ready().url + "/version", timeout=60).json()["pdserve_sim"]["attention_backend"])


CUDA = {"PDSERVE_SIM_PLATFORM": "cuda"}
ROCM = {"PDSERVE_SIM_PLATFORM": "rocm"}
NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


def _rocm_nixl() -> dict[str, str]:
    return {**ROCM, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}


def test_a_backend_that_is_not_valid_on_the_simulated_gpu_is_refused_at_start(
    sim_factory: Factory, tmp_path: Path
) -> None:
    """sim/attention.py: vLLM's validate_configuration per backend (CUDA H200), for a checkpoint with heads of 32
    (the tiny models have heads of 64, which every backend takes)."""
    heads32 = tmp_path / "heads32"
    heads32.mkdir()
    (heads32 / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "torch_dtype": "float32", "max_position_embeddings": 2048, "vocab_size": 2048,
    }))  # fmt: skip
    refusals = {
        # FLASH_ATTN and FLASHINFER take float16 / bfloat16 only; FLASHINFER's heads are 64, 128, 256 or 512.
        ("FLASH_ATTN", "float32"): "['dtype not supported']",
        ("FLASHINFER", "bfloat16"): "['head_size not supported']",
        ("FLASHINFER", "float32"): "['head_size not supported', 'dtype not supported']",
    }
    for (backend, dtype), reasons in refusals.items():
        refused: SimServer = sim_factory("--attention-backend", backend, "--dtype", dtype, env=CUDA, model=str(heads32))
        assert refused.wait_exit() == 1, (backend, dtype)
        assert (
            f"ValueError: Selected backend AttentionBackendEnum.{backend} is not valid for this configuration. "
            f"Reason: {reasons}"
        ) in refused.log()
    # TRITON_ATTN takes float32; FLASH_ATTN bfloat16 (the float32 checkpoint under --dtype auto); FLASHINFER the
    # tiny models' heads of 64.
    assert _backend(sim_factory("--attention-backend", "TRITON_ATTN", "--dtype", "float32", env=CUDA)) == "TRITON_ATTN"
    assert _backend(sim_factory("--attention-backend", "FLASH_ATTN", env=CUDA)) == "FLASH_ATTN"
    assert _backend(sim_factory("--attention-backend", "FLASHINFER", "--dtype", "bfloat16", env=CUDA)) == "FLASHINFER"


def test_the_gpu_default_backend_is_the_first_valid_one(sim_factory: Factory) -> None:
    """vLLM's priorities: CUDA FLASH_ATTN, FLASHINFER, TRITON_ATTN; ROCm ROCM_ATTN, ROCM_AITER_UNIFIED_ATTN,
    TRITON_ATTN, with ROCM_ATTN left out under a KV connector (it supports none)."""
    assert _backend(sim_factory(env=CUDA)) == "FLASH_ATTN"
    assert _backend(sim_factory("--dtype", "float32", env=CUDA)) == "TRITON_ATTN"
    assert _backend(sim_factory(env=ROCM)) == "ROCM_ATTN"
    assert _backend(sim_factory("--kv-transfer-config", NIXL, env=_rocm_nixl())) == "ROCM_AITER_UNIFIED_ATTN"
    assert _backend(sim_factory("--kv-transfer-config", NIXL, "--dtype", "float32", env=_rocm_nixl())) == "TRITON_ATTN"


def test_rocm_attn_is_refused_with_a_kv_connector(sim_factory: Factory) -> None:
    refused: SimServer = sim_factory("--attention-backend", "ROCM_ATTN", "--kv-transfer-config", NIXL, env=_rocm_nixl())
    assert refused.wait_exit() == 1
    assert "Selected backend AttentionBackendEnum.ROCM_ATTN is not valid for this configuration. Reason: " \
        "['KV connector not supported']" in refused.log()  # fmt: skip
    assert _backend(sim_factory("--attention-backend", "ROCM_ATTN", env=ROCM)) == "ROCM_ATTN"


def test_config_field_limits_are_refused_by_the_engine_not_argparse(sim_factory: Factory) -> None:
    """vLLM's argparse takes any number for these flags; its config classes refuse them at start, exit 1, in
    pydantic's words (measured on vLLM for CPU 0.32: `--gpu-memory-utilization 1.5` exits 1 after 110 s)."""
    cases = {
        ("--gpu-memory-utilization", "1.5"): ("CacheConfig", "Input should be less than or equal to 1"),
        ("--block-size", "0"): ("CacheConfig", "Input should be greater than 0"),
        ("--tensor-parallel-size", "0"): ("ParallelConfig", "Input should be greater than or equal to 1"),
        ("--max-num-seqs", "0"): ("SchedulerConfig", "Input should be greater than or equal to 1"),
    }
    for flags, (config, words) in cases.items():
        refused: SimServer = sim_factory(*flags)
        assert refused.wait_exit() == 1, flags
        log = refused.log()
        assert f"ValidationError: 1 validation error for {config}" in log, (flags, log[-1500:])
        assert words in log


def test_an_unknown_connector_is_vllm_configs_validation_error(sim_factory: Factory) -> None:
    """Measured on vLLM for CPU 0.32: exit 1, `1 validation error for VllmConfig ... Unsupported connector type`."""
    refused: SimServer = sim_factory("--kv-transfer-config", '{"kv_connector":"BogusConnector","kv_role":"kv_both"}')
    assert refused.wait_exit() == 1
    assert "ValidationError: 1 validation error for VllmConfig\n  Value error, Unsupported connector type: " \
        "BogusConnector" in refused.log()  # fmt: skip
