"""Settings as users meet them: flags, environment, ini, defaults, and usage errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pytest_pdserve.config.settings import PDSERVE_CONFIG, SETTINGS, PDServeConfig
from pytest_pdserve.engines.engine import resolve_engine

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")


def configure(pytester: pytest.Pytester, *args: str) -> PDServeConfig:
    config = pytester.parseconfigure(*args)
    return config.stash[PDSERVE_CONFIG]


# --------------------------------------------------------------------------- precedence, one test per layer


def test_default_layer(pytester: pytest.Pytester) -> None:
    cfg = configure(pytester)
    assert (cfg.engine, cfg.startup_timeout, cfg.enforce_eager, cfg.seed) == ("auto", 1200.0, True, 0)
    assert (cfg.model, cfg.attention_backend, cfg.vllm_serve_extra_args, cfg.prefill_gpu_ids) == (
        None,
        None,
        (),
        None,
    )
    assert cfg.lease_dir == Path("/tmp/pytest-pdserve/leases")
    assert (cfg.gpu_wait, cfg.gpu_wait_timeout, cfg.platform, cfg.vllm_executable) == (
        "wait",
        1800.0,
        "auto",
        "vllm",
    )
    assert set(cfg.sources.values()) == {"default"}
    assert set(cfg.sources) == {s.name for s in SETTINGS}


def test_cli_layer(pytester: pytest.Pytester) -> None:
    cfg = configure(
        pytester,
        "--pd-model=m1",
        "--pd-startup-timeout=60",
        "--vllm-serve-extra-args=--max-model-len,8192",
        "--pd-prefill-gpu-ids=0,1",
        "--no-pd-enforce-eager",
        "--pd-prefill-url=http://127.0.0.1:8100/",
        "--pd-prefill-url=http://127.0.0.1:8101",
        "--attention-backend=TRITON_ATTN",
    )
    assert (cfg.model, cfg.startup_timeout, cfg.enforce_eager) == ("m1", 60.0, False)
    assert cfg.vllm_serve_extra_args == ("--max-model-len", "8192")
    assert cfg.prefill_gpu_ids == (0, 1)
    assert cfg.prefill_urls == ("http://127.0.0.1:8100", "http://127.0.0.1:8101")
    assert cfg.attention_backend == "TRITON_ATTN"
    assert cfg.attach_mode
    assert cfg.sources["model"] == "--pd-model"
    assert cfg.source_of("model") == "--pd-model"


def test_env_layer(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_MODEL", "m-env")
    monkeypatch.setenv("PREFILL_GPU_ID", "3")
    monkeypatch.setenv("GPU_MEMORY_UTILIZATION", "0.2")
    monkeypatch.setenv("PDSERVE_ENFORCE_EAGER", "0")
    monkeypatch.setenv("PDSERVE_DECODE_URLS", "http://127.0.0.1:8200, http://127.0.0.1:8201")
    monkeypatch.setenv("ATTENTION_BACKEND", "")  # empty counts as unset, as in vLLM's scripts
    cfg = configure(pytester)
    assert (cfg.model, cfg.prefill_gpu_ids, cfg.gpu_memory_utilization) == ("m-env", (3,), 0.2)
    assert cfg.enforce_eager is False
    assert cfg.decode_urls == ("http://127.0.0.1:8200", "http://127.0.0.1:8201")
    assert cfg.attention_backend is None
    assert cfg.sources["model"] == "$PDSERVE_MODEL"
    assert cfg.source_of("prefill_gpu_ids") == "environment variable PREFILL_GPU_ID"


def test_ini_layer(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        "[pytest]\npdserve_model = m-ini\npdserve_shutdown_timeout = 5\npdserve_log_dir = logs\n"
        "pdserve_vllm_serve_extra_args = --trust-remote-code --foo 'a b'\n"
    )
    cfg = configure(pytester)
    assert (cfg.model, cfg.shutdown_timeout) == ("m-ini", 5.0)
    assert cfg.vllm_serve_extra_args == ("--trust-remote-code", "--foo", "a b")
    assert cfg.log_dir == pytester.path / "logs"  # relative to the ini file
    assert cfg.sources["model"] == "ini pdserve_model"


def test_toml_ini_values_of_any_type(pytester: pytest.Pytester) -> None:
    pytester.makepyprojecttoml(
        "[tool.pytest.ini_options]\npdserve_seed = 7\npdserve_enforce_eager = false\n"
        'pdserve_prefill_urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]\n'
    )
    cfg = configure(pytester)
    assert (cfg.seed, cfg.enforce_eager) == (7, False)
    assert cfg.prefill_urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")


def test_cli_beats_env(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_MODEL", "m-env")
    cfg = configure(pytester, "--pd-model", "m-cli")
    assert (cfg.model, cfg.sources["model"]) == ("m-cli", "--pd-model")


def test_env_beats_ini(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\npdserve_model = m-ini\npdserve_seed = 3\n")
    monkeypatch.setenv("PDSERVE_MODEL", "m-env")
    cfg = configure(pytester)
    assert (cfg.model, cfg.sources["model"]) == ("m-env", "$PDSERVE_MODEL")
    assert (cfg.seed, cfg.sources["seed"]) == (3, "ini pdserve_seed")  # other keys still from ini


def test_falsy_values_are_not_skipped(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # seed 0 and gpu id 0 from the CLI must win over env values (no `or` layering)
    monkeypatch.setenv("PDSERVE_SEED", "9")
    monkeypatch.setenv("DECODE_GPU_ID", "1")
    cfg = configure(pytester, "--pd-seed=0", "--pd-decode-gpu-ids=0")
    assert (cfg.seed, cfg.decode_gpu_ids) == (0, (0,))


def test_inner_test_sees_the_config(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from pytest_pdserve.config.settings import PDSERVE_CONFIG

        def test_cfg(request):
            cfg = request.config.stash[PDSERVE_CONFIG]
            assert cfg.model == "tiny" and cfg.resolved_engine == "sim"
        """
    )
    result = pytester.runpytest("--pd-model=tiny", "--pd-engine=sim")
    result.assert_outcomes(passed=1)


# --------------------------------------------------------------------------- engine


def _exe(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_engine_auto_finds_vllm_next_to_python(tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    vllm = _exe(tmp_path / "bin" / "vllm")
    engine, reason, argv = resolve_engine("auto", "vllm", which=lambda _: None, python=str(python))
    assert (engine, argv) == ("vllm", (str(vllm),))
    assert reason == f"auto: vllm executable found at {vllm}"


def test_engine_auto_on_path_module_or_simulator(tmp_path: Path) -> None:
    python = str(tmp_path / "python")
    found = resolve_engine("auto", "vllm", which=lambda n: f"/x/bin/{n}", has_module=lambda _: False, python=python)
    assert found == ("vllm", "auto: vllm executable found at /x/bin/vllm", ("/x/bin/vllm",))
    module = resolve_engine("auto", "vllm", which=lambda _: None, has_module=lambda _: True, python=python)
    assert module[0] == "vllm"
    assert module[2] == (python, "-m", "vllm.entrypoints.cli.main")
    sim = resolve_engine("auto", "vllm", which=lambda _: None, has_module=lambda _: False, python=python)
    assert sim == ("sim", "auto: no vllm executable on PATH or next to python; using the simulator", ())
    assert resolve_engine("sim", "vllm")[:2] == ("sim", "sim: requested")


def test_explicit_vllm_executable_path(pytester: pytest.Pytester) -> None:
    exe = _exe(pytester.path / "my-vllm")
    cfg = configure(pytester, f"--pd-vllm-executable={exe}")
    assert (cfg.resolved_engine, cfg.vllm_argv) == ("vllm", (str(exe),))
    assert cfg.engine_reason == f"auto: vllm executable {exe}"


# --------------------------------------------------------------------------- usage errors

BAD_INPUTS = [
    # (id, args, env, ini, fragments expected on stderr)
    (
        "extra-args-quotes",
        [],
        {"VLLM_SERVE_EXTRA_ARGS": "--foo 'bar"},
        "",
        [
            '"--foo \'bar" from environment variable VLLM_SERVE_EXTRA_ARGS',
            "No closing quotation",
            "comma form",
        ],
    ),
    (
        "extra-args-quotes-ini",
        [],
        {},
        'pdserve_vllm_serve_extra_args = --foo "x\n',
        ["from ini key pdserve_vllm_serve_extra_args", "balanced shell quoting"],
    ),
    (
        "gpu-id-word",
        ["--pd-prefill-gpu-ids=a"],
        {},
        "",
        ["'a' from --pd-prefill-gpu-ids is not a valid prefill_gpu_ids", "GPU indices >= 0"],
    ),
    (
        "gpu-id-negative",
        [],
        {"DECODE_GPU_ID": "-1"},
        "",
        ["'-1' from environment variable DECODE_GPU_ID", "GPU indices >= 0 (at most 1023) separated by commas"],
    ),
    ("gpu-id-repeated", ["--pd-decode-gpu-ids=1,1"], {}, "", ["an index is repeated"]),
    (
        "util-zero",
        ["--pd-gpu-memory-utilization=0"],
        {},
        "",
        ["'0' from --pd-gpu-memory-utilization", "(0, 1]"],
    ),
    (
        "util-big",
        [],
        {"GPU_MEMORY_UTILIZATION": "1.5"},
        "",
        ["environment variable GPU_MEMORY_UTILIZATION", "(0, 1]"],
    ),
    (
        "util-word",
        [],
        {},
        "pdserve_gpu_memory_utilization = most\n",
        ["ini key pdserve_gpu_memory_utilization"],
    ),
    (
        "backend-in-extra-args-env",
        [],
        {"ATTENTION_BACKEND": "FLASHINFER", "VLLM_SERVE_EXTRA_ARGS": "--attention-backend,TRITON_ATTN"},
        "",
        [
            "--attention-backend in VLLM_SERVE_EXTRA_ARGS (env) ('--attention-backend TRITON_ATTN') is a flag "
            "pdserve owns",
            "use ClusterSpec.attention_backend or --attention-backend / ATTENTION_BACKEND / pdserve_attention_backend",
        ],
    ),
    (
        "backend-in-extra-args-equals",
        ["--vllm-serve-extra-args=--attention-backend=X"],
        {},
        "",
        ["--attention-backend in --vllm-serve-extra-args (command line) ('--attention-backend=X')"],
    ),
    ("backend-bad-name", ["--attention-backend=flash attn"], {}, "", ["such as FLASH_ATTN"]),
    ("timeout-zero", ["--pd-startup-timeout=0"], {}, "", ["'0' from --pd-startup-timeout", "seconds > 0"]),
    (
        "timeout-negative",
        [],
        {"PDSERVE_SHUTDOWN_TIMEOUT": "-5"},
        "",
        ["environment variable PDSERVE_SHUTDOWN_TIMEOUT"],
    ),
    (
        "timeout-ini",
        [],
        {},
        "pdserve_gpu_wait_timeout = 0\n",
        ["ini key pdserve_gpu_wait_timeout", "seconds > 0"],
    ),
    (
        "engine",
        [],
        {"PDSERVE_ENGINE": "tgi"},
        "",
        ["'tgi' from environment variable PDSERVE_ENGINE", "vllm, sim, auto"],
    ),
    ("platform", ["--pd-platform=tpu"], {}, "", ["'tpu' from --pd-platform", "auto, cuda, rocm, cpu"]),
    (
        "simulate-word",
        ["--pd-simulate-gpus=two"],
        {},
        "",
        ["'two' from --pd-simulate-gpus", "N, cuda:N or rocm:N"],
    ),
    (
        "simulate-platform",
        ["--pd-simulate-gpus=rocm:2", "--pd-platform=cuda"],
        {},
        "",
        ["simulates rocm GPUs but the platform is set to cuda", "platform from --pd-platform"],
    ),
    (
        "gpu-wait",
        [],
        {"PDSERVE_GPU_WAIT": "forever"},
        "",
        ["'forever' from environment variable PDSERVE_GPU_WAIT", "wait, skip"],
    ),
    (
        "url-scheme",
        ["--pd-prefill-url=ftp://127.0.0.1:1"],
        {},
        "",
        ["'ftp://127.0.0.1:1' from --pd-prefill-url", "http://"],
    ),
    (
        "url-no-scheme",
        [],
        {"PDSERVE_DECODE_URLS": "http://127.0.0.1:1,localhost:8200"},
        "",
        ["environment variable PDSERVE_DECODE_URLS", "http:// or https:// URL"],
    ),
    (
        "url-proxy-port",
        [],
        {},
        "pdserve_proxy_url = http://127.0.0.1:99999\n",
        ["ini key pdserve_proxy_url", "port"],
    ),
    (
        "block-size",
        ["--pd-block-size=-16"],
        {},
        "",
        ["whole number from 1 to 8192", "(set --pd-block-size / PDSERVE_BLOCK_SIZE / pdserve_block_size)"],
    ),
    ("bool", [], {"PDSERVE_ENFORCE_EAGER": "maybe"}, "", ["1/0, true/false"]),
    ("proxy-command", ["--pd-proxy-command=python 'x"], {}, "", ["balance the quotes"]),
    (
        "vllm-missing",
        ["--pd-engine=vllm", "--pd-vllm-executable=/nonexistent/vllm"],
        {},
        "",
        ["'/nonexistent/vllm' from --pd-vllm-executable", "--pd-engine sim"],
    ),
]


@pytest.mark.parametrize(
    ("args", "env", "ini", "fragments"), [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_is_a_usage_error(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: dict[str, str],
    ini: str,
    fragments: list[str],
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if ini:
        pytester.makeini("[pytest]\n" + ini)
    pytester.makepyfile("def test_never(): raise AssertionError('must not run')")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert err.startswith("ERROR: pdserve: ")
    for fragment in fragments:
        assert fragment in err
    combined = err + result.stdout.str()
    assert "INTERNALERROR" not in combined
    assert "Traceback" not in combined


# --------------------------------------------------------------------------- help and header


def test_help_lists_the_group_even_with_a_bad_setting(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_ENGINE", "bogus")
    result = pytester.runpytest("--help")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["vLLM prefill/decode (P/D) servers (pytest-pdserve):", "*--pd-engine=ENGINE*"])
    out = result.stdout.str()
    for s in SETTINGS:
        assert s.flag in out
        assert s.ini_key in out


def test_report_header(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_ok(): pass")
    result = pytester.runpytest(
        "--pd-engine=sim",
        "--pd-model=tiny-llama",
        "--attention-backend=TRITON_ATTN",
        "--vllm-serve-extra-args=--max-model-len,8192,--served-model-name,a b",
        "--pd-simulate-gpus=cuda:2",
        "--pd-api-key=s3cret",
        f"--pd-log-dir={pytester.path / 'logs'}",
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "pdserve: engine sim (sim: requested), model tiny-llama, attention backend TRITON_ATTN, "
            "extra args --max-model-len 8192 --served-model-name 'a b'",
            f"pdserve: inventory cuda: 2 simulated GPUs [[]simulated via --pd-simulate-gpus=cuda:2[]]; "
            f"log dir {pytester.path / 'logs'}",
        ]
    )
    assert "s3cret" not in result.stdout.str()


def test_collect_only_imports_neither_torch_nor_vllm(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Importable stand-ins: if the plugin imported torch or vllm, they would show up in sys.modules.
    for name in ("torch", "vllm"):
        pkg = pytester.mkpydir(name)
        (pkg / "__init__.py").write_text("")
    pytester.makeconftest(
        """
        import json, sys
        def pytest_collection_finish(session):
            from pytest_pdserve.config.settings import PDSERVE_CONFIG
            cfg = session.config.stash[PDSERVE_CONFIG]
            with open("modules.json", "w") as f:
                json.dump({"torch": "torch" in sys.modules, "vllm": "vllm" in sys.modules,
                           "plugin": "pytest_pdserve.plugin" in sys.modules,
                           "engine": cfg.resolved_engine, "argv": list(cfg.vllm_argv)}, f)
        """
    )
    pytester.makepyfile("def test_a(): pass")
    monkeypatch.setenv("PATH", os.defpath)  # no real vllm script on PATH
    result = pytester.runpytest_subprocess("--collect-only", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    seen = json.loads((pytester.path / "modules.json").read_text())
    assert seen["plugin"] is True
    assert (seen["torch"], seen["vllm"]) == (False, False)
    if not (Path(sys.executable).parent / "vllm").exists():
        # found through find_spec("vllm") on the stand-in, without importing it
        assert seen["engine"] == "vllm"
        assert seen["argv"][1:] == ["-m", "vllm.entrypoints.cli.main"]


def test_report_header_names_each_given_setting_its_source_and_who_lost(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CI variable shadowed by a flag is visible in the header, not silently ignored; secrets stay hidden."""
    pytester.makeini("[pytest]\npdserve_seed = 5\npdserve_block_size = 64\n")
    pytester.makepyfile("def test_x():\n    pass\n")
    monkeypatch.setenv("PDSERVE_SEED", "7")
    monkeypatch.setenv("PDSERVE_API_KEY", "hidden-key-123")
    result = pytester.runpytest_subprocess("--pd-seed=9", "--pd-engine=sim", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines([
        "pdserve: settings given: engine=sim (--pd-engine), block_size=64 (ini pdserve_block_size), "
        "seed=9 (--pd-seed; lost: $PDSERVE_SEED, ini pdserve_seed), api_key=*** ($PDSERVE_API_KEY)",
    ])  # fmt: skip
    assert "hidden-key-123" not in result.stdout.str()
