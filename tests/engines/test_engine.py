"""Engine discovery (engine.py): one shebang reader, and no silent "newest vLLM" when the version is unknown."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pytest_pdserve.cluster import EngineSetup
from pytest_pdserve.engines import vllm_compat
from pytest_pdserve.engines.engine import SIM_ARGV, engine_setup, vllm_python
from pytest_pdserve.errors import EngineVersionUnknown


def _venv(tmp_path: Path, dists: dict[str, str], shebang: str | None = None) -> Path:
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /nowhere\n")
    (venv / "bin").mkdir()
    for name, version in dists.items():
        d = site / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    exe = venv / "bin" / "vllm"
    exe.write_text(f"{shebang or '#!' + str(venv / 'bin' / 'python')}\nimport sys\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def _setup(tmp_path: Path, argv: tuple[str, ...]) -> EngineSetup:
    return engine_setup("vllm", vllm_argv=argv, vllm_executable=argv[0], platform="cpu")


def test_sim_engine_runs_this_interpreter(tmp_path: Path) -> None:
    setup = engine_setup("sim", vllm_argv=(), vllm_executable="vllm", platform="cpu")
    assert setup.info.argv_prefix == SIM_ARGV
    assert setup.platform_args == ()


def test_vllm_on_cpu_gets_the_version_the_cpu_env_and_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "pdserve-cache"))
    exe = _venv(tmp_path, {"vllm": "0.32.0+cpu"})
    setup = _setup(tmp_path, (str(exe),))
    assert setup.info.version == vllm_compat.Version("0.32.0+cpu")
    assert setup.platform_args == ("--dtype", "float32")
    assert setup.platform_env["OMP_NUM_THREADS"] == "1"
    # vLLM's cache root is the plugin's, kept across runs (not under pytest's basetemp, which each run replaces).
    assert setup.platform_env["VLLM_CACHE_ROOT"] == str(tmp_path / "pdserve-cache" / "vllm-cache")


def test_unknown_version_is_an_error_not_the_newest(tmp_path: Path) -> None:
    exe = _venv(tmp_path, {"vllm-nixl-cpu-tweaks": "0.1.0"})  # vLLM without metadata (no shim)
    with pytest.raises(EngineVersionUnknown, match=r"cannot tell which vLLM .* will not guess"):
        _setup(tmp_path, (str(exe),))


def test_env_shebang_names_the_interpreter_not_env(tmp_path: Path) -> None:
    """``#!/usr/bin/env python3`` means python3 on PATH (the old fixtures.py reader returned /usr/bin/env)."""
    exe = tmp_path / "bin" / "vllm"
    exe.parent.mkdir()
    exe.write_text("#!/usr/bin/env python3\n")
    exe.chmod(0o755)
    found = vllm_python((str(exe),))
    assert Path(found).name.startswith("python3"), found
    assert "env" not in Path(found).name


def test_module_form_reads_the_interpreters_version(tmp_path: Path) -> None:
    exe = _venv(tmp_path, {"vllm": "0.30.1"})
    python = exe.parent / "python"  # not runnable: the version must come from its site-packages
    python.write_text("")
    setup = _setup(tmp_path, (str(python), "-m", "vllm.entrypoints.cli.main"))
    assert setup.info.version == vllm_compat.Version("0.30.1")
    assert setup.info.python == str(python)


def test_a_session_refuses_a_vllm_cache_others_can_write(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The door users meet: PDSERVE_CACHE_DIR set to a directory others may write, a real-vLLM session on CPU.
    The cluster's test errors, naming the directory and the remedy, before any server starts."""
    shared = tmp_path / "team-cache"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(shared))
    exe = _venv(tmp_path, {"vllm": "0.32.0+cpu"})
    pytester.makepyfile("def test_one(pd_cluster):\n    pass\n")
    result = pytester.runpytest_subprocess(f"--pd-vllm-executable={exe}", "--pd-engine=vllm", "-p", "no:randomly")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [f"*vLLM's cache directory {shared}/vllm-cache is in {shared}, which is writable by others (mode 0777)*"]
    )
    assert "raise PathError" not in result.stdout.str()  # the message alone, no plugin source (issue 28)
    assert not (shared / "vllm-cache").exists() or not any((shared / "vllm-cache").iterdir())
