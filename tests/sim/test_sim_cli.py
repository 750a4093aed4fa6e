"""The ``vllm serve``-compatible command line: errors as vLLM prints them, and parsed values."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_pdserve.config.bounds import ATTENTION_BACKENDS
from pytest_pdserve.sim.__main__ import main
from pytest_pdserve.sim.cli import (
    human_readable_int,
    parse_kv_transfer_config,
    parse_serve_args,
    resolve_attention_backend,
)
from pytest_pdserve.sim.faults import SimEnv, SimEnvError

from ._simproc import child_env, sim_argv


def _run(*args: str, console_script: bool = False) -> subprocess.CompletedProcess[str]:
    argv = (
        [str(Path(sys.executable).parent / "pdserve-sim"), "serve", "m", *args]
        if console_script
        else sim_argv("m", *args)
    )
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=child_env())


def test_unknown_flag_exits_2_like_vllm() -> None:
    r = _run("--port", "0", "--bogus-flag", "1")
    assert r.returncode == 2
    assert "usage: vllm serve" in r.stderr
    assert "vllm serve: error: unrecognized arguments: --bogus-flag 1" in r.stderr


def test_unknown_attention_backend_wording() -> None:
    r = _run("--port", "0", "--attention-backend", "FLASH_ATTENTION")
    assert r.returncode == 1
    assert "ValueError: Unknown attention backend: 'FLASH_ATTENTION'. Valid options are: FLASH_ATTN, " in r.stderr


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("{not json", "argument --kv-transfer-config: invalid JSON '{not json'"),
        ('["NixlConnector"]', "must be a JSON object"),
        ('{"kv_role":"kv_producer"}', "kv_connector=None"),
        ('{"kv_connector":"NixlConnector","kv_role":"prefill"}', "kv_role='prefill'"),
        ('{"kv_connector":"NixlConnector","kv_load_failure_policy":"retry"}', "fail | recompute"),
        ('{"kv_connector":"NixlConnector","kv_connector_extra_config":[]}', "kv_connector_extra_config=[]"),
    ],
)
def test_bad_kv_transfer_config_exits_2(config: str, needle: str) -> None:
    r = _run("--kv-transfer-config", config, console_script=True)
    assert r.returncode == 2
    assert needle in r.stderr
    assert r.stderr.rstrip().splitlines()[-1].startswith("vllm serve: error: argument --kv-transfer-config:")


def test_mamba_cache_mode_all_is_rejected() -> None:
    r = _run("--mamba-cache-mode", "all")
    assert r.returncode == 2
    assert "argument --mamba-cache-mode: invalid choice: 'all' (choose from 'align', 'none')" in r.stderr


def test_unknown_connector_fails_at_startup() -> None:
    r = _run("--port", "0", "--kv-transfer-config", '{"kv_connector":"NoSuchConnector"}')
    assert r.returncode == 1
    assert "ValueError: Unsupported connector type: NoSuchConnector" in r.stderr


def test_main_rejects_other_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 2
    assert "invalid choice: 'bench' (choose from 'serve')" in capsys.readouterr().err


def test_defaults_and_flags() -> None:
    args = parse_serve_args(["org/m"])
    assert (args.model, args.port, args.block_size, args.enable_prefix_caching, args.seed) == (
        "org/m",
        8000,
        16,
        True,
        0,
    )
    assert args.served_name == "org/m"
    assert args.effective_max_model_len == 2048
    args = parse_serve_args(
        [
            "m",
            "--no-enable-prefix-caching",
            "--served-model-name",
            "a",
            "b",
            "--max-model-len",
            "1k",
            "--kv-cache-memory-bytes",
            "8GiB",
            "--gpu-memory-utilization",
            "0.4",
            "--enforce-eager",
            "--tensor-parallel-size",
            "2",
            "--dtype",
            "float32",
            "--mamba-cache-mode",
            "align",
            "--distributed-executor-backend",
            "mp",
            "--disable-log-requests",
            "--revision",
            "abc",
        ]
    )
    assert args.enable_prefix_caching is False
    assert args.served_name == "a"
    assert (args.max_model_len, args.kv_cache_memory_bytes) == (1000, 8 * 2**30)
    assert args.non_default["tensor_parallel_size"] == 2


def test_attention_backend_resolution() -> None:
    assert resolve_attention_backend("flashinfer") == "FLASHINFER"
    assert resolve_attention_backend("AUTO") is None
    assert resolve_attention_backend(None) is None
    assert {"FLASH_ATTN", "TRITON_ATTN", "ROCM_AITER_UNIFIED_ATTN", "CPU_ATTN"} <= set(ATTENTION_BACKENDS)
    with pytest.raises(ValueError, match=r"^Unknown attention backend: 'x'\. Valid options are: FLASH_ATTN, "):
        resolve_attention_backend("x")


def test_kv_transfer_config_fields() -> None:
    kv = parse_kv_transfer_config(
        '{"kv_connector":"MultiConnector","kv_connector_extra_config":{"connectors":'
        '[{"kv_connector":"NixlConnector","kv_role":"kv_both"}],"kv_lease_duration":7}}'
    )
    assert kv.is_nixl
    assert kv.kv_lease_duration == 7.0
    assert kv.kv_load_failure_policy == "fail"
    assert not parse_kv_transfer_config('{"kv_connector":"OffloadingConnector"}').is_nixl


@pytest.mark.parametrize(("text", "value"), [("100", 100), ("25.6k", 25600), ("1K", 1024), ("2MiB", 2 * 2**20)])
def test_human_readable_int(text: str, value: int) -> None:
    assert human_readable_int(text) == value


def test_human_readable_int_rejects() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="'12x'"):
        human_readable_int("12x")


def test_sim_env_defaults_and_errors() -> None:
    env = SimEnv.from_environ({})
    assert (env.side_channel_host, env.side_channel_port, env.nondeterministic_backends) == (
        "localhost",
        5600,
        frozenset(),  # none by default: vLLM 0.26 FLASH_ATTN was batch-invariant on an H200 (sim/faults.py)
    )
    env = SimEnv.from_environ(
        {"PDSERVE_SIM_NONDETERMINISTIC_BACKENDS": "flashinfer, triton_attn", "VLLM_SERVER_DEV_MODE": "1"}
    )
    assert env.nondeterministic_backends == frozenset({"FLASHINFER", "TRITON_ATTN"})
    assert env.dev_mode
    with pytest.raises(SimEnvError, match=r"PDSERVE_SIM_SPAWN_WORKERS='-1' is not accepted"):
        SimEnv.from_environ({"PDSERVE_SIM_SPAWN_WORKERS": "-1"})
    with pytest.raises(SimEnvError, match=r"PDSERVE_SIM_HANG='maybe' is not a boolean"):
        SimEnv.from_environ({"PDSERVE_SIM_HANG": "maybe"})
