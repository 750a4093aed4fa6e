"""The plugin's door to vLLM's start rules (`pytest_pdserve.rules`): each server's command, judged before anything
starts. [pytest-free]

What vLLM would refuse at start or die on there (a MultiConnector child without ``kv_role``, an OffloadingConnector
on the CPU platform, ``VLLM_KV_CACHE_LAYOUT=NHD`` on vLLM for CPU, ``--mamba-cache-mode all`` on 0.32) is refused
here with vLLM's reason, for both engines (the simulator follows the same rules at its start); what vLLM silently
runs instead of what was asked (``HND`` as ``LBHNC``, a ``--mamba-cache-mode`` that prefix caching overrides) comes
back as lines for the ready line. The facts are read from the very argv and environment the server gets, so what is
judged is what would run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pytest_pdserve.config import owned_flags
from pytest_pdserve.engines.cpu import CPU_ATTENTION_BACKEND
from pytest_pdserve.errors import VllmRefuses
from pytest_pdserve.rules.start import ServerFacts, Verdict, check_server
from pytest_pdserve.rules.versions import DEFAULT_VLLM_VERSION, shown

if TYPE_CHECKING:  # commands.py imports this module's caller chain; types only
    from pytest_pdserve.config.commands import EngineInfo, ServerCommand
    from pytest_pdserve.spec import ClusterSpec

__all__ = ["check_command", "server_facts"]

#: The simulator reads these (sim/faults.py): a cluster's env may set them, and its rules follow them.
SIM_VERSION_VAR = "PDSERVE_SIM_VLLM_VERSION"
SIM_PLATFORM_VAR = "PDSERVE_SIM_PLATFORM"


def _environ(delta: Mapping[str, str | None], base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    for key, value in delta.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _flags(argv: tuple[str, ...]) -> dict[str, Any]:
    """The owned flags the rules read, last one winning (vLLM's argparse)."""
    found: dict[str, Any] = {}
    for hit in owned_flags.match(argv):
        flag = hit.owned.flag
        if flag == "--enable-prefix-caching":
            found[flag] = not hit.token.split("=", 1)[0].replace("_", "-").startswith("--no-")
        elif hit.value is not None:
            found[flag] = hit.value
    return found


def _hybrid(spec: ClusterSpec, model: str) -> bool | None:
    """Whether the model is hybrid (Mamba): the tiny models' kinds are known, another model is not."""
    if spec.model is None:
        return spec.model_kind == "nemotronh"
    return "nemotronh" in model.lower() or None


def server_facts(cmd: ServerCommand, spec: ClusterSpec, engine: EngineInfo, platform: str,
                 environ: Mapping[str, str] | None = None) -> ServerFacts:  # fmt: skip
    """What the rules need of one server's command (its argv and the environment it will get)."""
    env = _environ(cmd.env, os.environ if environ is None else environ)
    flags = _flags(cmd.argv)
    version: object = engine.version
    if engine.name == "sim":  # the version the simulator reports and follows (sim/faults.py)
        version = env.get(SIM_VERSION_VAR) or DEFAULT_VLLM_VERSION
        platform = (env.get(SIM_PLATFORM_VAR) or platform).lower()
    try:
        kv = json.loads(flags["--kv-transfer-config"]) if "--kv-transfer-config" in flags else None
    except ValueError:
        kv = None  # pdserve writes it; a user cannot
    backend = flags.get("--attention-backend")
    if platform == "cpu":
        backend = CPU_ATTENTION_BACKEND
    elif backend is not None and backend.lower() == "auto":
        backend = None
    model = cmd.argv[cmd.argv.index("serve") + 1] if "serve" in cmd.argv else ""
    return ServerFacts(
        version=version, platform=platform, kv_transfer_config=kv if isinstance(kv, dict) else None, environ=env,
        attention_backend=backend.upper() if backend else None, hybrid=_hybrid(spec, model),
        mamba_cache_mode=flags.get("--mamba-cache-mode"), prefix_caching=flags.get("--enable-prefix-caching"),
        block_size=int(flags["--block-size"]) if "--block-size" in flags else None,
    )  # fmt: skip


def check_command(cmd: ServerCommand, spec: ClusterSpec, engine: EngineInfo, platform: str,
                  environ: Mapping[str, str] | None = None) -> Verdict:  # fmt: skip
    """vLLM's verdict on one server of ``spec``.

    :raises VllmRefuses: vLLM would refuse the server or die at its start, with vLLM's reason and where it came from.
    """
    facts = server_facts(cmd, spec, engine, platform, environ)
    verdict = check_server(facts)
    first = verdict.first
    if first is not None:
        where = f" (in {first.where})" if first.where else ""
        engine_name = "the simulator, which follows" if engine.name == "sim" else "real"
        raise VllmRefuses(
            f"cluster {spec.name!r}: {cmd.name} would not run on {engine_name} vLLM {shown(facts.version)} "
            f"({facts.platform} platform): vLLM {first.stage_words} {first.describe().rstrip('.')}{where}. "
            "Nothing was started. "
            f"vLLM's rule: {first.source} (pytest_pdserve/rules/)"
        )
    return verdict
