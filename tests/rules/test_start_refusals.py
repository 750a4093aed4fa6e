"""What vLLM refuses at start, the simulator refuses at start, in vLLM's words (issue 26), on both engines; and a
fixed sample of the flag-set differential (tests/_flags.py, scripts/differential-flags.py).

Each case starts one server of the tiny Llama (2048 positions) directly and expects exit status 1 with vLLM's
message; the `vllm` half needs real vLLM for CPU ($PDSERVE_VLLM_EXECUTABLE) and skips without it. vLLM for CPU
refuses in 51 s on a loaded 2-core machine (measured), before it loads the model. The KV-cache-too-small refusal
is tested on the simulator only (tests/sim/test_sim_start_rules.py): vLLM for CPU sizes its cache from
VLLM_CPU_KVCACHE_SPACE (whole GiB) and ignores --kv-cache-memory-bytes (measured: 1M with --max-model-len 2048
started, "CPU KV cache size: 1,048,576 tokens").
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import _flags
import pytest
from _ports import free_port

from pytest_pdserve.engines.cpu import cpu_server_env
from pytest_pdserve.engines.engine import resolve_engine, vllm_python
from pytest_pdserve.engines.tiny_model import cache_base, ensure_tiny_model

LONG_LEN = (
    "User-specified max_model_len (4096) is greater than the derived max_model_len "
    "(max_position_embeddings=2048.0 or model_max_length=None in model's config.json). To allow overriding this "
    "maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
)

NIXL_PRODUCER = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}'


def _server(engine: str, kind: str = "llama") -> tuple[list[str], str, dict[str, str]]:
    """argv prefix, model and environment of one engine's server of the tiny ``kind`` (skips the vllm half without
    real vLLM)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_LONG_MAX_MODEL_LEN"}
    if engine == "sim":
        return [sys.executable, "-m", "pytest_pdserve.sim"], f"pdserve-sim/tiny-{kind}", env
    argv = resolve_engine("vllm", os.environ.get("PDSERVE_VLLM_EXECUTABLE", "vllm"))[2]
    if not argv:
        pytest.skip("real vLLM is not installed (set PDSERVE_VLLM_EXECUTABLE)")
    model = str(ensure_tiny_model(kind, vllm_python(argv)))
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", OMP_NUM_THREADS="1")
    # The plugin's cache root, as its servers get it: vLLM reads the model's class info there instead of
    # inspecting the model in a subprocess (about 9 s of each refusal's CPU).
    env["VLLM_CACHE_ROOT"] = cpu_server_env(cache_base())["VLLM_CACHE_ROOT"]
    return list(argv), model, env


def _start(engine: str, *flags: str, kind: str = "llama", env: Mapping[str, str] | None = None) -> tuple[int, str]:
    argv, model, base = _server(engine, kind)
    done = subprocess.run(
        [*argv, "serve", model, "--host", "127.0.0.1", "--port", "0", *flags],
        env={**base, **(env or {})}, capture_output=True, text=True, timeout=60 if engine == "sim" else 400,
        check=False,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


@pytest.mark.timeout(420)
@pytest.mark.parametrize("engine", ["sim", "vllm"])
def test_max_model_len_above_the_models_is_refused_at_start(engine: str) -> None:
    code, out = _start(engine, "--max-model-len", "4096")
    assert code == 1, out[-2000:]
    assert LONG_LEN in out


@pytest.mark.timeout(420)
@pytest.mark.parametrize("engine", ["sim", "vllm"])
def test_a_hybrid_nixl_server_without_the_ds_conv_state_dies_at_start(engine: str) -> None:
    """The negative control of rules/conv_state.py against the real thing: the plugin refuses such a server before a
    start (tests/assertions/test_kv_faithful.py), so only here does vLLM itself meet it. NixlConnector's worker asserts
    the dim-first conv state once the model is loaded; the engine dies and the server exits 1."""
    # The environment the plugin gives a server on the CPU platform (fork, not spawn, for the engine's worker).
    env = {**cpu_server_env(cache_base()), "VLLM_SSM_CONV_STATE_LAYOUT": "SD"}
    env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
    # The flags of the plugin's hybrid prefill (ClusterSpec.hybrid_ssm on vLLM for CPU): eager, so no compile.
    code, out = _start(
        engine, "--kv-transfer-config", NIXL_PRODUCER,
        "--block-size", "128", "--enforce-eager", "--seed", "0", "--trust-remote-code", "--enable-prefix-caching",
        "--dtype", "float32", kind="nemotronh", env=env,
    )  # fmt: skip
    assert code == 1, out[-2000:]
    assert "3-read Mamba conv transfer requires DS conv state layout. Set VLLM_SSM_CONV_STATE_LAYOUT=DS" in out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("flags", _flags.FIXED_SAMPLE, ids=lambda flags: " ".join(flags))
def test_flag_sets_start_or_refuse_alike(flags: tuple[str, ...], real_vllm: str, tmp_path: Path) -> None:
    """The fixed sample of scripts/differential-flags.py (tests/_flags.py): each flag set starts on both engines or
    is refused by both with the same exit status and class of refusal (docs/differential.md)."""
    got = {}
    for engine in ("sim", "vllm"):
        argv, model, env = _server(engine)
        port = free_port()
        argv = [*argv, "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags]
        got[engine] = _flags.outcome(argv, env, port, 400, tmp_path / f"{engine}.log")
    assert got["sim"] == got["vllm"], got
    assert not got["sim"]["starts"]  # the sample is of refusals (a start costs 50-250 s of real vLLM)


def test_a_refusal_is_classed_by_argument_config_or_exception() -> None:
    """tests/_flags.py's classes, on the outputs vLLM for CPU 0.32 printed (scripts/differential-flags.py logs)."""
    argparse_out = "usage: vllm serve ...\nvllm serve: error: argument --tensor-parallel-size/-tp: invalid int"
    pydantic_out = (
        "Traceback (most recent call last):\npydantic_core._pydantic_core.ValidationError: 1 validation error for "
        "VllmConfig\n  Value error, Unsupported connector type: BogusConnector [type=value_error]"
    )
    assert _flags.refusal_class(argparse_out) == "argparse: argument --tensor-parallel-size/-tp"
    assert _flags.refusal_class(pydantic_out) == "validation: VllmConfig"
    assert _flags.refusal_class("(APIServer pid=7) ValueError: Unknown attention backend: 'X'.") == "ValueError"
    assert _flags.refusal_class("Killed") == "unknown"
