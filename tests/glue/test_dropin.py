"""The drop-in for vLLM's own P/D suite: presets, --pd-export-env, the session connector, --pd-proxy-port and
the --confcutdir rule inside a vLLM checkout (the modules themselves run in tests/glue/test_vllm_modules.py)."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest
from _ports import free_port

from pytest_pdserve.config import presets
from pytest_pdserve.config.connector import parse_kv_connector_config
from pytest_pdserve.engines.cpu import fit_cpu_block_size
from pytest_pdserve.errors import ClusterSpecError
from pytest_pdserve.spec import ClusterSpec

# ------------------------------------------------------------------------------------------ presets


def test_every_preset_resolves_on_every_engine() -> None:
    for name in presets.PRESETS:
        for engine, platform in (("sim", "cpu"), ("vllm", "cpu"), ("vllm", "cuda")):
            if "multi-connector" in name and platform == "cpu":  # on both engines (rules/connectors.py)
                with pytest.raises(ClusterSpecError, match="no OffloadingConnector CPU tier"):
                    presets.resolve(name, spec_type=ClusterSpec, environ={}, engine=engine, platform=platform)
                continue
            spec = presets.resolve(name, spec_type=ClusterSpec, environ={}, engine=engine, platform=platform).spec
            assert spec.name == name
            if engine == "vllm" and platform == "cpu":
                assert spec.block_size is not None
                assert spec.block_size % 32 == 0, (name, spec.block_size)


def test_edge_case_preset_runs_at_vllms_default_block_size_and_says_what_cpu_changes() -> None:
    sim = presets.resolve("vllm-edge-case", spec_type=ClusterSpec, environ={}, engine="sim")
    # The simulator refuses a --max-model-len above the model's as vLLM does (issue 26): the same override.
    assert (sim.spec.block_size, sim.spec.max_model_len) == (16, 8192)
    assert sim.notes == ("max model len 8192 on the tiny model (declares 2048): VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",)
    cpu = presets.resolve("vllm-edge-case", spec_type=ClusterSpec, environ={}, engine="vllm", platform="cpu")
    assert cpu.spec.block_size == 32
    assert cpu.notes == (
        "block size 32 instead of vLLM's default 16: vLLM's CPU backend takes only multiples of 32",
        "max model len 8192 on the tiny model (declares 2048): VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
    )
    assert dict(cpu.spec.env) == {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    named = presets.resolve(
        "vllm-edge-case", spec_type=ClusterSpec, environ={}, engine="vllm", platform="cpu", model="some/model"
    )
    assert named.spec.model == "some/model"
    assert dict(named.spec.env) == {}  # a real model's own length limit applies
    cuda = presets.resolve("vllm-edge-case", spec_type=ClusterSpec, environ={}, engine="vllm", platform="cuda")
    assert cuda.spec.gpu_memory_utilization == 0.2


def test_xpu_disagg_preset_spawns_as_its_script_does_except_on_cpu_where_it_says_it_forks() -> None:
    """The script's VLLM_WORKER_MULTIPROC_METHOD=spawn is XPU's need; on CPU the preset leaves it to pdserve's CPU
    env (fork: docs/vllm-cpu.md, "The start method") and names the change."""
    for engine, platform in (("vllm", "cuda"), ("vllm", "xpu"), ("sim", "cpu")):
        result = presets.resolve("vllm-xpu-disagg", spec_type=ClusterSpec, environ={}, engine=engine, platform=platform)
        assert dict(result.spec.env)["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn", (engine, platform)
        assert not any("start method" in note for note in result.notes)
    cpu = presets.resolve("vllm-xpu-disagg", spec_type=ClusterSpec, environ={}, engine="vllm", platform="cpu")
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in dict(cpu.spec.env)
    assert dict(cpu.spec.env)["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "200"  # the rest of the script's env stays
    assert "start method fork (pdserve's CPU start) instead of the script's spawn, which XPU needs" in cpu.notes


def test_fit_cpu_block_size_rounds_up_to_a_multiple_of_32() -> None:
    assert [fit_cpu_block_size(n) for n in (1, 16, 32, 33, 64, 100, 128)] == [32, 32, 32, 64, 64, 128, 128]


def test_multi_connector_edge_case_preset_is_the_scripts_configuration() -> None:
    spec = presets.resolve(
        "vllm-multi-connector-edge-case", spec_type=ClusterSpec, environ={}, engine="sim", platform="cuda"
    ).spec
    assert (spec.kv_connector, spec.block_size, spec.max_model_len) == ("MultiConnector", 128, 2048)
    assert spec.extra_args == ("--kv-cache-memory-bytes", "268435456")
    assert dict(spec.env)["VLLM_KV_CACHE_LAYOUT"] == "LBHNC"
    children = spec.extra_config()["connectors"]  # type: ignore[index]
    assert [c["kv_connector"] for c in children] == ["NixlConnector", "OffloadingConnector"]
    assert children[1]["kv_connector_extra_config"] == {"cpu_bytes_to_use": 2147483648}


def test_presets_honour_their_scripts_env_vars() -> None:
    env = {"BLOCK_SIZE": "64", "MAX_MODEL_LEN": "4096", "KV_CACHE_MEMORY_BYTES": "1000", "MODEL_NAMES": "m/x"}
    spec = presets.resolve("vllm-multi-connector-edge-case", spec_type=ClusterSpec, environ=env, platform="cuda").spec
    assert (spec.block_size, spec.max_model_len, spec.model) == (64, 4096, "m/x")
    assert spec.extra_args == ("--kv-cache-memory-bytes", "1000")
    accuracy = presets.resolve(
        "vllm-accuracy",
        spec_type=ClusterSpec,
        environ={"NUM_DECODE_INSTANCES": "2", "DECODER_TP_SIZE": "2", "DECODER_KV_LAYOUT": ""},
    )
    assert (accuracy.spec.num_decode, accuracy.spec.decode_tp, accuracy.proxy_port) == (2, 2, 8192)
    assert "VLLM_KV_CACHE_LAYOUT" not in dict(accuracy.spec.decode_env)  # ${VAR-HND}: set-but-empty = no layout
    assert dict(accuracy.spec.prefill_env)["VLLM_KV_CACHE_LAYOUT"] == "HND"


@pytest.mark.parametrize(
    ("name", "env", "match"),
    [
        ("vllm-multi-connector-edge-case", {"BLOCK_SIZE": "big"}, r"\$BLOCK_SIZE='big' is not a whole number"),
        ("vllm-accuracy", {"PREFILL_BLOCK_SIZE": "64"}, "differ: pdserve runs one block size"),
        ("vllm-accuracy", {"DP_EP": "1"}, r"\$DP_EP='1'"),
        ("nope", {}, "unknown preset 'nope'; known: vllm-edge-case"),
    ],
)
def test_bad_preset_input_is_named(name: str, env: dict[str, str], match: str) -> None:
    with pytest.raises(ClusterSpecError, match=match):
        presets.resolve(name, spec_type=ClusterSpec, environ=env)


def test_cluster_spec_preset_takes_overrides() -> None:
    spec = ClusterSpec.preset("vllm-mamba-prefix-cache", engine="vllm", platform="cpu", max_model_len=2048)
    assert (spec.model_kind, spec.max_model_len, spec.enable_prefix_caching) == ("nemotronh", 2048, True)
    # 2048 fits the tiny model: no VLLM_ALLOW_LONG_MAX_MODEL_LEN
    assert dict(spec.env) == {"VLLM_KV_CACHE_LAYOUT": "HND", "VLLM_SSM_CONV_STATE_LAYOUT": "DS"}


# ------------------------------------------------------------------------------------------ connector


MULTI = {
    "kv_connector": "MultiConnector",
    "kv_connector_extra_config": {
        "connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 1},
            },
        ]
    },
}


def test_connector_config_becomes_spec_fields() -> None:
    fields = parse_kv_connector_config(json.dumps(MULTI))
    spec = ClusterSpec(**fields)
    assert spec.kv_connector == "MultiConnector"
    assert spec.extra_config() == MULTI["kv_connector_extra_config"]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("{", "not JSON"),
        ("[]", "must be a JSON object"),
        ('{"kv_role": "kv_both"}', "kv_role: pdserve sets it per server"),
        ('{"kv_port": 1}', r"unknown key\(s\) \['kv_port'\]"),
        ('{"kv_connector": "LMCacheConnectorV1"}', "is not supported"),
        ('{"kv_connector": "MultiConnector"}', "connectors must be a non-empty list"),
        ('{"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": '
         '[{"kv_connector": "OffloadingConnector"}]}}', "needs a NixlConnector"),
        ('{"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": '
         '[{"kv_connector": "NixlConnector", "kv_role": "both"}]}}', r"connectors\[0\].kv_role 'both'"),
    ],
)  # fmt: skip
def test_bad_connector_config_is_named(config: str, match: str) -> None:
    with pytest.raises(ClusterSpecError, match=match):
        parse_kv_connector_config(config)


def test_bad_connector_config_is_a_usage_error_naming_the_flag(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(): pass")
    result = pytester.runpytest_subprocess("--pd-kv-connector-config", '{"kv_role":"kv_both"}')
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*from --pd-kv-connector-config is not a valid kv_connector_config: kv_role*"])


# ------------------------------------------------------------------------------------------ export-env

MODULE = """
import os
PORTS = {k: os.environ[k] for k in ("PREFILL_PORT", "DECODE_PORT", "PROXY_PORT")}  # read at import, as vLLM's

def test_reads_at_import(pd_cluster):
    assert PORTS == {"PREFILL_PORT": str(pd_cluster.prefill[0].port), "DECODE_PORT": str(pd_cluster.decode[0].port),
                     "PROXY_PORT": str(pd_cluster.proxy.port)}
    assert os.environ["BLOCK_SIZE"] == str(pd_cluster.block_size) == "16"
    assert os.environ["TEST_MODEL"] == pd_cluster.model
    assert pd_cluster.spec.name == "vllm-edge-case"
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}", "-p", "no:cacheprovider", *args,
        timeout=600,
    )  # fmt: skip


def test_export_env_starts_the_session_cluster_before_collection(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mod=MODULE)
    result = _run(pytester, "--pd-export-env-file=out/env.sh", "--pd-preset=vllm-edge-case")
    result.assert_outcomes(passed=1)  # pd_cluster is the exported cluster (same ports)
    result.stdout.fnmatch_lines([
        "*pdserve: cluster vllm-edge-case (sim, 1P x 1D) ready in*",
        "*pdserve: exported (also written to *env.sh): PREFILL_HOST=127.0.0.1 PREFILL_PORT=*",
    ])  # fmt: skip
    lines = (pytester.path / "out" / "env.sh").read_text().splitlines()
    assert "export PREFILL_HOST=127.0.0.1" in lines
    assert "export BLOCK_SIZE=16" in lines
    assert any(line.startswith("export PROXY_PORT=") for line in lines)


def test_export_env_from_the_environment(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_EXPORT_ENV", "1")
    monkeypatch.setenv("PDSERVE_PRESET", "vllm-edge-case")
    pytester.makepyfile(test_mod=MODULE)
    _run(pytester).assert_outcomes(passed=1)


def test_explicit_settings_beat_the_preset(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mod="import os\ndef test_b(): assert os.environ['BLOCK_SIZE'] == '32'")
    _run(pytester, "--pd-export-env", "--pd-preset=vllm-edge-case", "--pd-block-size=32").assert_outcomes(passed=1)


def test_ci_extra_args_override_the_presets_values_as_the_scripts_do(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26: the scripts append "${EXTRA_ARGS[@]}" last, so CI's VLLM_SERVE_EXTRA_ARGS beats their fixed flags;
    the header names the override. Two of the user's own sources that disagree stay an error."""
    pytester.makepyfile(test_mod="def test_len(pd_cluster):\n    assert pd_cluster.spec.name == 'vllm-edge-case'\n"
                        "    assert pd_cluster.prefill[0].client.get('/v1/models').json()['data'][0]"
                        "['max_model_len'] == 1024\n")  # fmt: skip
    monkeypatch.setenv("VLLM_SERVE_EXTRA_ARGS", "--max-model-len,1024")
    result = _run(pytester, "--pd-export-env", "--pd-preset=vllm-edge-case")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*pdserve: preset vllm-edge-case: '--max-model-len 1024' from VLLM_SERVE_EXTRA_ARGS"
                                 " (env) overrides the preset's max_model_len=8192*"])  # fmt: skip
    both = _run(pytester, "--pd-export-env", "--pd-preset=vllm-edge-case", "--pd-max-model-len=512")
    assert both.ret != 0
    both.stderr.fnmatch_lines(["*--max-model-len is given twice for one server: 512 from *--pd-max-model-len*"
                               "'--max-model-len 1024' from VLLM_SERVE_EXTRA_ARGS (env)*"])  # fmt: skip


def test_a_cluster_that_cannot_start_is_one_error_not_one_per_module(pytester: pytest.Pytester) -> None:
    for i in range(3):
        pytester.makepyfile(**{f"test_m{i}": "import os\nPORT = os.environ['PREFILL_PORT']\ndef test_x(): pass"})
    result = _run(pytester, "--pd-export-env", "--vllm-serve-extra-args=--no-such-flag")
    assert result.ret == 1
    out = result.stdout.str()
    assert out.count("the session cluster for --pd-export-env did not start") == 1, out
    assert "ERROR collecting" not in out
    assert "KeyError" not in out
    assert "--no-such-flag" in out  # the server's own complaint, from its log tail


def test_proxy_port_is_leased_and_taken_is_a_clear_error(pytester: pytest.Pytester) -> None:
    free = free_port()
    pytester.makepyfile(test_mod=f"import os\ndef test_p(): assert os.environ['PROXY_PORT'] == '{free}'")
    _run(pytester, "--pd-export-env", f"--pd-proxy-port={free}").assert_outcomes(passed=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", free))
        s.listen()
        result = _run(pytester, "--pd-export-env", f"--pd-proxy-port={free}")
    assert result.ret == 1
    result.stdout.fnmatch_lines([f"*--pd-proxy-port {free}: port {free} is taken: another process (not pdserve) "
                                 "is bound to it; free it or choose another port*"])  # fmt: skip


def test_session_connector_applies_to_the_exported_cluster(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_mod="def test_c(pd_cluster):\n    assert pd_cluster.spec.kv_connector == 'MultiConnector'\n"
        "    assert '\"OffloadingConnector\"' in ' '.join(pd_cluster.prefill[0].command.argv)"
    )
    # A simulated GPU: the OffloadingConnector's CPU tier does not run on the CPU platform (rules/connectors.py).
    result = _run(
        pytester, "--pd-export-env", "--pd-simulate-gpus=cuda:2", f"--pd-kv-connector-config={json.dumps(MULTI)}"
    )
    result.assert_outcomes(passed=1)


def test_under_xdist_each_worker_exports_its_own_cluster(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    for i in range(2):
        pytester.makepyfile(**{f"test_w{i}": "import os\nPORT = os.environ['PROXY_PORT']\ndef test_x(): assert PORT"})
    result = _run(pytester, "--pd-export-env", "-n", "2")
    result.assert_outcomes(passed=2)


#: A conftest that makes the named modules absent, as on a machine without them: importing one fails as usual.
ABSENT = """
import sys

class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Absent())
"""


@pytest.mark.parametrize(
    ("module", "remedy"),
    [
        ("openai", "pip install 'pytest-pdserve[vllm-tests]' (installs openai, regex, requests)"),
        ("regex", "pip install 'pytest-pdserve[vllm-tests]' (installs openai, regex, requests)"),
        ("lm_eval", "pip install 'lm_eval[api]' (it also downloads the gsm8k dataset: network access)"),
    ],
)
def test_a_vllm_module_missing_what_it_imports_names_the_install(
    pytester: pytest.Pytester, module: str, remedy: str
) -> None:
    """Issue 29: vLLM's modules import openai & co.; without them the collection error says what to install."""
    pytester.makeconftest(ABSENT.format(names=("openai", "regex", "requests", "lm_eval")))
    pytester.makepyfile(test_mod=f"import os\nimport {module}\nPORT = os.environ['PREFILL_PORT']\ndef test_x(): pass")
    result = _run(pytester, "--pd-export-env")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            f"*ModuleNotFoundError: No module named '{module}'",
            f"pdserve: test_mod.py needs '{module}', which vLLM's nixl_integration modules import and this "
            f"environment lacks: {remedy}",
        ]
    )


def test_a_missing_module_outside_export_env_or_the_extra_is_left_as_pytest_says_it(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(ABSENT.format(names=("openai",)))
    pytester.makepyfile(test_a="import openai\ndef test_x(): pass", test_b="import no_such_module_29\n")
    without = _run(pytester)  # no --pd-export-env: not a vLLM module session
    without.assert_outcomes(errors=2)
    assert "pdserve: test_a.py needs" not in without.stdout.str()
    with_env = _run(pytester, "--pd-export-env")
    with_env.assert_outcomes(errors=2)
    assert "pdserve: test_a.py needs 'openai'" in with_env.stdout.str()
    assert "pdserve: test_b.py needs" not in with_env.stdout.str()  # not one of what vLLM's modules import


# ------------------------------------------------------------------------------------------ vLLM checkout


def _fake_checkout(root: Path) -> Path:
    (root / "vllm").mkdir()
    (root / "tests").mkdir()
    (root / "tests" / "conftest.py").write_text("import torch  # noqa\nimport vllm  # noqa\n")
    nixl = root / "tests" / "v1" / "kv_connector" / "nixl_integration"
    nixl.mkdir(parents=True)
    (nixl / "test_x.py").write_text("def test_x():\n    pass\n")
    (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    return nixl


def test_inside_a_vllm_checkout_without_torch_confcutdir_is_set(pytester: pytest.Pytester) -> None:
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is importable here: the rule applies only without it")
    nixl = _fake_checkout(pytester.path)
    result = _run(pytester, str(nixl / "test_x.py"))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*tests/conftest.py imports torch and vllm, and torch* is not importable "
                                 f"here: --confcutdir set to {nixl} *"])  # fmt: skip


def test_an_explicit_confcutdir_is_left_alone_with_a_hint(pytester: pytest.Pytester) -> None:
    nixl = _fake_checkout(pytester.path)
    result = _run(pytester, str(nixl / "test_x.py"), f"--confcutdir={pytester.path}")
    assert result.ret != 0  # the user's choice loads vLLM's conftest, which needs torch
    out = result.stdout.str() + result.stderr.str()
    assert "No module named 'torch'" in out
    assert f"if collection fails there, pass --confcutdir={nixl}" in out


def test_auto_preset_is_picked_from_the_module_names() -> None:
    assert presets.auto_preset(["x/test_edge_cases.py::test_edge_cases", "-q"]) == "vllm-edge-case"
    assert presets.auto_preset(["tests/test_other.py"]) is None
    with pytest.raises(ClusterSpecError, match="need different presets"):
        presets.auto_preset(["test_edge_cases.py", "test_mamba_prefix_cache.py"])


def test_multi_connector_edge_case_preset_keeps_the_scripts_token_capacity_on_the_tiny_model() -> None:
    """The script's 256 MiB are ~2,340 tokens of Qwen3-0.6B but ~500,000 of the tiny model: on real vLLM with the
    tiny model the preset sizes the KV cache in tokens, so the module's eviction test can evict (issue 24)."""
    tiny = presets.resolve(
        "vllm-multi-connector-edge-case", spec_type=ClusterSpec, environ={}, engine="vllm", platform="cuda"
    )
    memory = int(tiny.spec.extra_args[1])
    assert memory == 19 * 128 * presets.TINY_MODEL_KV_BYTES_PER_TOKEN  # 2,340 tokens in whole 128-token blocks
    assert memory // presets.TINY_MODEL_KV_BYTES_PER_TOKEN >= (tiny.spec.max_model_len or 0) > 0  # start check
    assert any("KV cache 2490368 bytes instead of the script's 268435456" in n for n in tiny.notes)
    for env in ({"KV_CACHE_MEMORY_BYTES": "268435456"}, {"MODEL_NAMES": "Qwen/Qwen3-0.6B"}):
        kept = presets.resolve(
            "vllm-multi-connector-edge-case", spec_type=ClusterSpec, environ=env, engine="vllm", platform="cuda"
        )
        assert kept.spec.extra_args == ("--kv-cache-memory-bytes", "268435456"), env
        assert not kept.notes


def test_multi_connector_edge_case_preset_takes_the_callers_kv_cache_layout() -> None:
    """vLLM 0.26 refuses the 0.32+ scripts' LBHNC at engine start (measured on an H200); its CI sets HND."""
    assert dict(
        presets.resolve("vllm-multi-connector-edge-case", spec_type=ClusterSpec, environ={}, platform="cuda").spec.env
    )["VLLM_KV_CACHE_LAYOUT"] == ("LBHNC")
    older = presets.resolve(
        "vllm-multi-connector-edge-case",
        spec_type=ClusterSpec,
        environ={"VLLM_KV_CACHE_LAYOUT": "HND"},
        platform="cuda",
    )
    assert dict(older.spec.env)["VLLM_KV_CACHE_LAYOUT"] == "HND"
    assert "KV cache layout HND from $VLLM_KV_CACHE_LAYOUT instead of the script's LBHNC" in older.notes
