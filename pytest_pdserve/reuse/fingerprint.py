"""A cluster's fingerprint: one digest per component of its effective configuration. [pytest-free]

Every `ClusterSpec` field, every session setting, the engine's command and version (and, for the simulator, its
source files), the model (a local checkpoint's files), the GPU placement settings, the proxy command, this
plugin's version, and the environment variables the servers read. Only digests are written, so no secret reaches
the state file; differing *names* (:func:`differences`) say why a kept cluster was not reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest_pdserve
from pytest_pdserve.cluster import EngineSetup
from pytest_pdserve.config.commands import SessionDefaults
from pytest_pdserve.spec import ClusterSpec

__all__ = ["SERVER_ENV_NAMES", "SERVER_ENV_PREFIXES", "differences", "fingerprint"]

#: Environment variables a server reads, besides its own env delta: a change in any of them starts fresh servers.
SERVER_ENV_PREFIXES = (
    "VLLM_", "CUDA_", "HIP_", "ROCR_", "HSA_", "UCX_", "NIXL_", "NCCL_", "OMP_", "MKL_", "KMP_", "HF_",
    "TRANSFORMERS_", "TORCH", "PYTORCH_", "TRITON_", "LD_", "PYTHON", "PDSERVE_SIM_",
)  # fmt: skip
SERVER_ENV_NAMES = ("PATH",)


def _canon(value: Any) -> str:
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_identity(model: str) -> str:
    """The model name, plus size and mtime of a local checkpoint's files (a rebuilt model starts fresh servers)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return model
    parts = [model]
    with contextlib.suppress(OSError):
        for entry in sorted(path.iterdir())[:64]:
            with contextlib.suppress(OSError):
                st = entry.stat()
                parts.append(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def _sim_identity() -> str:
    """The simulator's source files (size, mtime): editing the simulator starts fresh simulated servers."""
    sim = Path(pytest_pdserve.__file__).parent / "sim"
    parts = []
    for entry in sorted(sim.glob("*.py")):
        with contextlib.suppress(OSError):
            st = entry.stat()
            parts.append(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def fingerprint(
    *,
    spec: ClusterSpec,
    defaults: SessionDefaults,
    setup: EngineSetup,
    model: str,
    placement: Mapping[str, object],
    proxy_command: Sequence[str] | None,
    environ: Mapping[str, str],
) -> dict[str, str]:
    """``{component: digest}`` of everything that shapes a cluster's servers (see the module docstring)."""
    parts: dict[str, str] = {}
    for f in dataclasses.fields(spec):
        parts[f"spec.{f.name}"] = _canon(getattr(spec, f.name))
    for f in dataclasses.fields(defaults):
        if f.name != "extra_args_source":  # where the args came from does not change the servers
            parts[f"setting.{f.name}"] = _canon(getattr(defaults, f.name))
    info = setup.info
    parts["engine"] = _canon([info.name, list(info.argv_prefix), str(info.version), info.python])
    if info.name == "sim":
        parts["engine.simulator"] = _sim_identity()
    parts["engine.platform_env"] = _canon(setup.platform_env)
    parts["engine.platform_args"] = _canon(setup.platform_args)
    parts["model"] = _model_identity(model)
    for key, value in placement.items():
        parts[f"placement.{key}"] = _canon(value)
    parts["proxy_command"] = _canon(proxy_command)
    parts["pytest-pdserve"] = pytest_pdserve.__version__
    for name, value in environ.items():
        if name.startswith(SERVER_ENV_PREFIXES) or name in SERVER_ENV_NAMES:
            parts[f"env.{name}"] = value
    return {k: _digest(v) for k, v in sorted(parts.items())}


def differences(kept: Mapping[str, str], wanted: Mapping[str, str]) -> list[str]:
    """Component names whose digests differ (or that only one side has): why a kept cluster does not fit."""
    return sorted(k for k in {*kept, *wanted} if kept.get(k) != wanted.get(k))
