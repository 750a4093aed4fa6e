"""The command builder: exact argv and env per server, checked against vLLM 0.33 / 0.32 flags.

Facts from /work/shared/reference/vllm.md: NixlConnector roles are kv_producer / kv_consumer (section 4.2),
``--mamba-cache-mode`` is a deprecated no-op in 0.33 and only ``align``/``none`` exist in 0.32 (4.6),
the mamba script's env is ``VLLM_SSM_CONV_STATE_LAYOUT=DS VLLM_KV_CACHE_LAYOUT=HND`` (1.2), and each server
gets its own side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``) and ``VLLM_PORT`` window (4.1).
"""

from __future__ import annotations

import pytest

from pytest_pdserve.cluster import served_model_name
from pytest_pdserve.config import commands
from pytest_pdserve.config.commands import EngineInfo, ServerPorts, SessionDefaults, build_server_command
from pytest_pdserve.config.effective import effective
from pytest_pdserve.config.extra_args import parse_extra_args
from pytest_pdserve.engines.vllm_compat import Version
from pytest_pdserve.errors import ClusterSpecError
from pytest_pdserve.spec import ClusterSpec

VLLM_033 = EngineInfo("vllm", ("vllm",), Version("0.33.0"))
VLLM_032 = EngineInfo("vllm", ("vllm",), Version("0.32.1"))
MODEL = "/models/tiny-nemotronh"
EXTRA = "--max-model-len,8192,--gpu-memory-utilization,0.8"
P_PORTS = ServerPorts(http=20100, side_channel=20200, vllm_port=20300)
D_PORTS = ServerPorts(http=21100, side_channel=21200, vllm_port=21300)


def defaults(**changes: object) -> SessionDefaults:
    base: dict[str, object] = {
        "attention_backend": "TRITON_ATTN",
        "vllm_serve_extra_args": parse_extra_args(EXTRA),
        "platform": "cuda",
    }
    base.update(changes)
    return SessionDefaults(**base)  # type: ignore[arg-type]


def build(spec: ClusterSpec, role: str, engine: EngineInfo = VLLM_033, **kw: object) -> commands.ServerCommand:
    ports = P_PORTS if role == "prefill" else D_PORTS
    gpu = "0" if role == "prefill" else "1"
    return build_server_command(
        spec=spec, role=role, index=0, model=MODEL, ports=ports, engine=engine,  # type: ignore[arg-type]
        asked=effective(spec, kw.pop("session", defaults())), gpu_env={"CUDA_VISIBLE_DEVICES": gpu},  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def hybrid_argv(role: str, port: int, kv_role: str, mamba: list[str]) -> list[str]:
    return [
        "vllm", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--kv-transfer-config", f'{{"kv_connector":"NixlConnector","kv_role":"{kv_role}"}}',
        "--attention-backend", "TRITON_ATTN", "--block-size", "128", "--enforce-eager", "--seed", "0",
        "--trust-remote-code", "--enable-prefix-caching", *mamba,
        "--max-model-len", "8192", "--gpu-memory-utilization", "0.8",
    ]  # fmt: skip


def hybrid_env(gpu: str, ports: ServerPorts) -> dict[str, str | None]:
    return {
        "CUDA_VISIBLE_DEVICES": gpu,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.side_channel),
        "VLLM_PORT": str(ports.vllm_port),
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache, for the cold-vs-warm determinism check
        "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
        "VLLM_KV_CACHE_LAYOUT": "HND",
        "VLLM_API_KEY": None,  # removed from the inherited env: servers need a key only when pdserve knows it
    }


def test_hybrid_ssm_on_vllm_033_exact_argv_and_env() -> None:
    spec = ClusterSpec.hybrid_ssm()
    p, d = build(spec, "prefill"), build(spec, "decode")
    # No --mamba-cache-mode: every vLLM version's default with prefix caching is the mode its script asks for
    # (rules/mamba.py: 0.26's all on NemotronH, align from 0.32).
    assert list(p.argv) == hybrid_argv("prefill", 20100, "kv_producer", [])
    assert list(d.argv) == hybrid_argv("decode", 21100, "kv_consumer", [])
    assert dict(p.env) == hybrid_env("0", P_PORTS)
    assert dict(d.env) == hybrid_env("1", D_PORTS)


def test_hybrid_ssm_passes_an_asked_mamba_mode_as_asked() -> None:
    spec = ClusterSpec.hybrid_ssm()
    assert list(build(spec, "prefill", VLLM_032).argv) == hybrid_argv("prefill", 20100, "kv_producer", [])
    # "all" is passed as asked: the plugin's pre-start check (rules/mamba.py) refuses it on 0.32 in vLLM's words.
    p_all = build(spec.with_(mamba_cache_mode="all"), "prefill", VLLM_032)
    assert p_all.argv[p_all.argv.index("--mamba-cache-mode") + 1] == "all"


def test_old_vllm_without_the_backend_flag_gets_the_env_var_and_kv_both() -> None:
    # vLLM 0.12 has no --attention-backend (argparse would reject it) and reads VLLM_ATTENTION_BACKEND;
    # its NixlConnector ran with kv_both.
    old = EngineInfo("vllm", ("vllm",), Version("0.12.0"))
    p = build(ClusterSpec(), "prefill", old)
    assert "--attention-backend" not in p.argv
    assert p.env["VLLM_ATTENTION_BACKEND"] == "TRITON_ATTN"
    assert '"kv_role":"kv_both"' in p.argv[p.argv.index("--kv-transfer-config") + 1]
    assert "VLLM_ATTENTION_BACKEND" not in build(ClusterSpec(), "prefill").env


def test_extra_args_order_session_then_spec_then_role_and_stay_one_element() -> None:
    spec = ClusterSpec(extra_args=("--max-num-seqs", "4"), decode_extra_args=("--max-model-len", "4096"))
    session = defaults(vllm_serve_extra_args=parse_extra_args("--served-model-name,x; rm -rf /"), api_key="k")
    d = build(spec, "decode", session=session)
    tail = list(d.argv[d.argv.index("--served-model-name") :])
    assert tail == ["--served-model-name", "x; rm -rf /", "--max-num-seqs", "4", "--max-model-len", "4096"]
    # The key never goes on argv (ps shows argv to every local user): vLLM reads VLLM_API_KEY.
    assert "k" not in d.argv
    assert "--api-key" not in d.argv
    assert d.env["VLLM_API_KEY"] == "k"
    assert served_model_name(d.argv, MODEL) == "x; rm -rf /"
    assert served_model_name(("serve", MODEL), MODEL) == MODEL


def test_tensor_parallel_flag_only_on_the_role_that_has_it() -> None:
    spec = ClusterSpec(num_prefill=2, num_decode=1, prefill_tp=1, decode_tp=2)
    p, d = build(spec, "prefill"), build(spec, "decode")
    assert "--tensor-parallel-size" not in p.argv
    assert d.argv[d.argv.index("--tensor-parallel-size") + 1] == "2"


def test_cpu_vllm_uses_a_cpu_kv_buffer_and_the_simulator_gets_vllm_argv() -> None:
    d = build(ClusterSpec(), "decode", session=defaults(platform="cpu", attention_backend=None))
    assert '"kv_buffer_device":"cpu"' in d.argv[d.argv.index("--kv-transfer-config") + 1]
    sim = EngineInfo("sim", ("python", "-m", "pytest_pdserve.sim"), Version("0.33.0"))
    s = build(ClusterSpec(), "decode", sim, session=defaults(platform="cpu", attention_backend=None))
    assert list(s.argv[:5]) == ["python", "-m", "pytest_pdserve.sim", "serve", MODEL]
    assert "kv_buffer_device" not in s.argv[s.argv.index("--kv-transfer-config") + 1]


@pytest.mark.parametrize(
    "engine", [VLLM_033, EngineInfo("sim", ("python", "-m", "pytest_pdserve.sim"), Version("0.33.0"))]
)
def test_a_backend_the_cpu_platform_replaces_is_refused_before_the_start(engine: EngineInfo) -> None:
    """Issue 26: vLLM for CPU runs CPU_ATTN whatever it is asked; one rule (cpu.running_attention_backend) for both
    engines, applied when the command is built, so nothing starts."""
    with pytest.raises(ClusterSpecError, match=r"TRITON_ATTN \(from ATTENTION_BACKEND .*runs CPU_ATTN"):
        build(ClusterSpec(), "decode", engine, session=defaults(platform="cpu"))
    with pytest.raises(ClusterSpecError, match=r"FLASH_ATTN \(from ClusterSpec.attention_backend\)"):
        build(ClusterSpec(attention_backend="FLASH_ATTN"), "decode", engine, session=defaults(platform="cpu"))
    for fine in ("auto", "cpu_attn", None):
        build(ClusterSpec(), "decode", engine, session=defaults(platform="cpu", attention_backend=fine))
    assert "--attention-backend" in build(ClusterSpec(), "decode", engine, session=defaults()).argv  # cuda: as asked
