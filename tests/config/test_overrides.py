"""A cluster overrides any session setting it gives, ``VLLM_SERVE_EXTRA_ARGS`` included, and says which won
(config/effective.py; the ready line shows ``AskedConfig.overrides`` as ``PDCluster.notes``)."""

from __future__ import annotations

import pytest

from pytest_pdserve.config.commands import EngineInfo, ServerPorts, SessionDefaults, build_server_command
from pytest_pdserve.config.effective import effective
from pytest_pdserve.engines.vllm_compat import Version
from pytest_pdserve.errors import ClusterSpecError, OwnedFlagError
from pytest_pdserve.spec import ClusterSpec

SIM = EngineInfo("sim", ("sim",), Version("0.33.0"))
PORTS = ServerPorts(http=20100, side_channel=20200, vllm_port=20300)
#: The README's CI recipe for vLLM for CPU, plus a session dtype.
SESSION = SessionDefaults(vllm_serve_extra_args=("--max-model-len", "2048", "--dtype", "bfloat16"),
                          extra_args_source="VLLM_SERVE_EXTRA_ARGS (env)")  # fmt: skip


def argv(spec: ClusterSpec, role: str = "prefill", session: SessionDefaults = SESSION) -> tuple[str, ...]:
    return build_server_command(spec=spec, role=role, index=0, model="m", ports=PORTS, engine=SIM,  # type: ignore[arg-type]
                                asked=effective(spec, session), gpu_env={}).argv  # fmt: skip


def value(args: tuple[str, ...], flag: str) -> str | None:
    found = [args[i + 1] for i, a in enumerate(args) if a == flag]
    assert len(found) <= 1, args
    return found[0] if found else None


def test_a_spec_field_overrides_the_session_extra_args_and_says_so() -> None:
    spec = ClusterSpec(num_prefill=2, max_model_len=1024)
    for role in ("prefill", "decode"):
        assert value(argv(spec, role), "--max-model-len") == "1024"
        assert value(argv(spec, role), "--dtype") == "bfloat16"  # the rest of the session's args stays
    assert effective(spec, SESSION).overrides == (
        "--max-model-len: 1024 from ClusterSpec.max_model_len overrides '--max-model-len 2048' from "
        "VLLM_SERVE_EXTRA_ARGS (env)",
    )


def test_vllm_serve_extra_args_replaces_the_sessions_for_one_cluster() -> None:
    for given in (("--dtype", "float32"), "--dtype,float32", "--dtype float32"):
        spec = ClusterSpec(vllm_serve_extra_args=given)  # type: ignore[arg-type]  # a string: the variable's forms
        args = argv(spec)
        assert value(args, "--dtype") == "float32"
        assert value(args, "--max-model-len") is None
        [note] = effective(spec, SESSION).overrides
        assert note == (
            "extra args --dtype float32 from ClusterSpec.vllm_serve_extra_args instead of the session's "
            "--max-model-len 2048 --dtype bfloat16 (VLLM_SERVE_EXTRA_ARGS (env))"
        )
    assert value(argv(ClusterSpec(vllm_serve_extra_args=())), "--dtype") is None  # none at all for this cluster
    with pytest.raises(OwnedFlagError, match="in ClusterSpec.vllm_serve_extra_args"):
        ClusterSpec(vllm_serve_extra_args=("--port", "1"))
    with pytest.raises(ClusterSpecError, match="cannot split"):
        ClusterSpec(vllm_serve_extra_args="--dtype 'float32")  # type: ignore[arg-type]


def test_a_settings_value_overridden_by_one_roles_extra_args_stays_for_the_other_role() -> None:
    session = SessionDefaults(max_model_len=2048)
    spec = ClusterSpec(decode_extra_args=("--max-model-len", "1024"))
    assert value(argv(spec, "prefill", session), "--max-model-len") == "2048"
    assert value(argv(spec, "decode", session), "--max-model-len") == "1024"
    eff = effective(spec, session)
    assert eff.max_model_len is None  # not read back: two values
    assert eff.overrides == (
        "--max-model-len: '--max-model-len 1024' from ClusterSpec.decode_extra_args overrides the session setting "
        "max_model_len 2048",
    )


def test_enforce_eager_seed_and_the_fields_that_name_a_setting_override_it() -> None:
    session = SessionDefaults(block_size=64, attention_backend="CPU_ATTN", seed=3)
    spec = ClusterSpec(enforce_eager=False, seed=7, block_size=32)
    args = argv(spec, session=session)
    assert "--enforce-eager" not in args
    assert value(args, "--seed") == "7"
    assert value(args, "--block-size") == "32"
    notes = effective(spec, session).overrides
    assert "block size 32 from ClusterSpec.block_size overrides the session's 64" in notes
    assert "seed 7 from ClusterSpec.seed overrides the session's 3" in notes
    assert "enforce eager False from ClusterSpec.enforce_eager overrides the session's True" in notes
    assert effective(ClusterSpec(), session).overrides == ()  # nothing given: nothing said
    for bad in ({"seed": -1}, {"seed": 2**32}, {"seed": True}, {"enforce_eager": "yes"}):
        with pytest.raises(ClusterSpecError):
            ClusterSpec(**bad)


def test_two_sources_of_one_level_stay_an_error() -> None:
    with pytest.raises(OwnedFlagError, match="given twice"):
        effective(ClusterSpec(max_model_len=1024, decode_extra_args=("--max-model-len", "9")), SESSION)
    with pytest.raises(OwnedFlagError, match="given twice"):
        effective(ClusterSpec(), SessionDefaults(max_model_len=1, vllm_serve_extra_args=("--max-model-len", "2")))
