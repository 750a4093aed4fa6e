"""What changed from vLLM 0.33 to 0.34 in what the simulator models, each checked at both versions.

The simulator reports 0.34.0 unless ``PDSERVE_SIM_VLLM_VERSION`` says otherwise and follows the reported version's
rules (``pytest_pdserve/rules/``, which names the 0.34.0 source of each). Each process test runs the rule at 0.34 and,
as its control, at 0.33, where vLLM behaved the old way.
"""

from __future__ import annotations

import httpx
import pytest

from pytest_pdserve.engines import engine, vllm_compat
from pytest_pdserve.rules import connectors, mamba
from pytest_pdserve.rules.block_size import default_block_size
from pytest_pdserve.rules.versions import DEFAULT_VLLM_VERSION, parse_version
from pytest_pdserve.sim.cli import parse_kv_transfer_config, resolve_attention_backend

from ._simproc import NIXL_KVC, Factory, SimServer, words

V033, V034 = parse_version("0.33.0"), parse_version("0.34.0")


def test_the_simulator_and_the_plugin_speak_the_same_newest_vllm() -> None:
    """The version the sim reports is the one the plugin builds its commands for (verify.py compares them)."""
    assert DEFAULT_VLLM_VERSION == "0.34.0"
    assert str(engine.SIM_VERSION) == str(vllm_compat.LATEST_KNOWN) == DEFAULT_VLLM_VERSION


def test_default_block_size_by_version_and_backend() -> None:
    assert default_block_size(V034, "FLASH_ATTN") == 64  # CacheConfig.DEFAULT_BLOCK_SIZE
    assert default_block_size(V034, "CPU_ATTN") == 64
    assert default_block_size(V034, "ROCM_ATTN") == 16  # its get_preferred_block_size
    assert default_block_size(V033, "FLASH_ATTN") == 16
    assert default_block_size(V033, "ROCM_ATTN") == 16


@pytest.mark.parametrize(("version", "block"), [(None, "64"), ("0.33.0", "16")])
def test_a_server_without_block_size_serves_its_versions_default(
    sim_factory: Factory, version: str | None, block: str
) -> None:
    env = {"PDSERVE_SIM_VLLM_VERSION": version} if version else {}
    server: SimServer = sim_factory(env=env, block_size=False).wait_ready()
    text = httpx.get(server.url + "/metrics", timeout=60).text
    [info] = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert f'block_size="{block}"' in info


def _conf(extra: dict[str, object], connector: str = "NixlConnector") -> dict[str, object]:
    return {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _config_refusals(config: dict[str, object], version: tuple[int, int, int]) -> list[str]:
    return [r.message for r in connectors.check(config, version=version, platform="cuda") if r.stage == "config"]


def test_nixl_transfer_mode_is_checked_from_034() -> None:
    assert _config_refusals(_conf({"transfer_mode": "push"}), V034) == []
    assert _config_refusals(_conf({}), V034) == []
    assert _config_refusals(_conf({"transfer_mode": "read"}), V034) == ["Invalid NixlConnector transfer_mode: 'read'"]
    assert _config_refusals(_conf({"transfer_mode": "read"}), V033) == []  # 0.33 never read it
    child = _conf({"transfer_mode": 1})
    multi = _conf({"connectors": [child]}, "MultiConnector")
    assert _config_refusals(multi, V034) == ["Invalid NixlConnector transfer_mode: 1"]


def test_umbp_store_connector_is_registered_from_034() -> None:
    assert _config_refusals(_conf({}, "UMBPStoreConnector"), V034) == []
    assert _config_refusals(_conf({}, "UMBPStoreConnector"), V033) == ["Unsupported connector type: UMBPStoreConnector"]
    umbp = parse_kv_transfer_config('{"kv_connector": "UMBPStoreConnector"}')
    assert umbp.unsimulated() == ["UMBPStoreConnector"]  # registered in vLLM, refused as not simulated
    assert _config_refusals(_conf({}, "BogusConnector"), V034) == ["Unsupported connector type: BogusConnector"]


def test_034_backends_are_known() -> None:
    assert resolve_attention_backend("flashinfer_ts") == "FLASHINFER_TS"
    assert resolve_attention_backend("KIMI_K3_KV_BALANCED_MLA") == "KIMI_K3_KV_BALANCED_MLA"


@pytest.mark.parametrize(("version", "refused"), [(None, True), ("0.33.0", False)])
def test_an_unknown_transfer_mode_fails_the_start_from_034(
    sim_factory: Factory, version: str | None, refused: bool
) -> None:
    kvc = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"transfer_mode":"x"}}'
    env = {"PDSERVE_SIM_VLLM_VERSION": version} if version else {}
    server: SimServer = sim_factory("--kv-transfer-config", kvc, env=env)
    if refused:
        assert server.wait_exit() == 1
        assert "1 validation error for VllmConfig\n  Value error, Invalid NixlConnector transfer_mode: 'x'" in (
            server.log()
        )
    else:
        server.wait_ready()


@pytest.mark.parametrize(("version", "generation"), [(None, True), ("0.33.0", True), ("0.32.0", False)])
def test_remote_registration_generation_from_033(sim_factory: Factory, version: str | None, generation: bool) -> None:
    env = {"PDSERVE_SIM_VLLM_VERSION": version} if version else {}
    prefill: SimServer = sim_factory("--kv-transfer-config", NIXL_KVC, env=env).wait_ready()
    body = prefill.complete(words(40), max_tokens=1, kv_transfer_params={"do_remote_decode": True}).json()
    params = body["kv_transfer_params"]
    assert ("remote_registration_generation" in params) is generation
    if generation:
        assert params["remote_registration_generation"] == 0


def test_mamba_cache_mode_warning_names_its_own_release() -> None:
    assert "will be removed in v0.34.0." in mamba.deprecation_warning(V034)
    assert "will be removed in v0.33.0." in mamba.deprecation_warning(V033)
