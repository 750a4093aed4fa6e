"""The session cluster's description: ``--pd-preset`` (``auto`` from the run's paths), the user's settings over it,
``--pd-kv-connector-config`` and ``--pd-proxy-port``. ``pd_cluster`` and ``--pd-export-env`` (export_env.py) start
the same cluster from it; ``pytest_configure`` checks ``--pd-preset auto`` through it before any test.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from pytest_pdserve.config.settings import PDSERVE_CONFIG, PDServeConfig, short_source
from pytest_pdserve.errors import ClusterSpecError
from pytest_pdserve.glue.session_inventory import get_inventory

# The cluster-description modules (spec.py, presets.py, owned_flags.py, connector.py: costly at import) are
# imported by the functions that describe the session cluster: the plugin loads this module for every run, and a
# run without --pd-preset / --pd-export-env / pd_cluster never describes one.
if TYPE_CHECKING:
    from pytest_pdserve.config.presets import PresetResult
    from pytest_pdserve.spec import ClusterSpec

__all__ = ["is_xdist_controller", "session_preset_name", "session_proxy_port", "session_spec"]

#: Session settings that, when given explicitly, beat the preset's value (the spec field is cleared, so the
#: command builder falls back to the session setting).
_SESSION_WINS = ("model", "attention_backend", "block_size", "max_model_len", "gpu_memory_utilization")


def _user_over_preset(preset: ClusterSpec, cfg: PDServeConfig) -> tuple[ClusterSpec, list[str]]:
    """The preset's values as defaults the user's own settings override, as the scripts do: they append
    ``"${EXTRA_ARGS[@]}"`` last, so CI's ``VLLM_SERVE_EXTRA_ARGS`` (and ``ATTENTION_BACKEND``) beat their fixed
    flags. A session setting given explicitly, or a ``once`` flag (``--max-model-len``, ...) in the session's extra
    args, clears the preset's field; each override is returned as a report-header note. Two of the user's own
    sources that disagree are still refused, by `effective.effective` (``--max-model-len is given twice``).
    """
    # Lazy: costly at import (see the top); a preset is in use, so spec.py has loaded it already.
    from pytest_pdserve.config import owned_flags
    from pytest_pdserve.spec import ClusterSpec

    cleared: dict[str, None] = {}
    notes = []
    for name in _SESSION_WINS:
        if cfg.sources.get(name, "default") != "default" and getattr(preset, name) is not None:
            cleared[name] = None
            notes.append(f"{name} {getattr(cfg, name)!r} from {short_source(cfg.sources[name])} overrides the "
                         f"preset's {getattr(preset, name)!r}")  # fmt: skip
    source = short_source(cfg.sources.get("vllm_serve_extra_args", "VLLM_SERVE_EXTRA_ARGS"))
    for hit in owned_flags.match(cfg.vllm_serve_extra_args):
        field_name = hit.owned.spec_field
        if hit.owned.policy != "once" or field_name is None or field_name in cleared:
            continue
        if getattr(preset, field_name) != getattr(ClusterSpec(), field_name):
            cleared[field_name] = None
            notes.append(f"{hit.shown!r} from {source} overrides the preset's {field_name}="
                         f"{getattr(preset, field_name)!r}")  # fmt: skip
    return preset.with_(**cleared), notes


def session_spec(config: pytest.Config) -> tuple[ClusterSpec, PresetResult | None]:
    """The session cluster's spec: ``--pd-preset`` (if any), explicit session settings over it, then the
    session connector (``--pd-kv-connector-config``). ``pd_cluster`` and ``--pd-export-env`` both use it."""
    # Lazy: the cluster-description modules, costly at import (see the top), loaded when a session
    # cluster is first described.
    from pytest_pdserve.config.connector import parse_kv_connector_config
    from pytest_pdserve.config.presets import resolve as resolve_preset
    from pytest_pdserve.spec import ClusterSpec

    cfg: PDServeConfig = config.stash[PDSERVE_CONFIG]
    result = None
    spec = ClusterSpec()
    name = session_preset_name(config)
    if name is not None:
        result = resolve_preset(
            name, spec_type=ClusterSpec, engine=cfg.resolved_engine, platform=get_inventory(config).platform
        )
        spec, overridden = _user_over_preset(result.spec, cfg)
        result = replace(result, notes=(*result.notes, *overridden))
    if cfg.kv_connector_config is not None:
        spec = spec.with_(**parse_kv_connector_config(cfg.kv_connector_config))
    return spec, result


def session_preset_name(config: pytest.Config) -> str | None:
    """``--pd-preset``'s name; for ``auto``, the preset of the vLLM modules this run collects, from its paths
    (``config.args``: the command line's, else ``testpaths``, else the current directory).

    Checked at configure time (``pytest_configure`` calls it), so a bad ``auto`` stops the run before any test.

    :raises pytest.UsageError: ``auto`` finds no vLLM module (it would silently run the defaults: block size 128
        where the module's script runs 16), or modules that need different presets.
    """
    cfg: PDServeConfig = config.stash[PDSERVE_CONFIG]
    if cfg.preset != "auto":
        return cfg.preset
    # Lazy: presets.py, costly at import (see the top), only for --pd-preset auto.
    from pytest_pdserve.config.presets import AUTO, PRESETS, auto_preset

    base = config.invocation_params.dir if config.args_source != pytest.Config.ArgsSource.TESTPATHS else config.rootpath
    where = f"--pd-preset auto (from {cfg.source_of('preset')})"
    try:
        name = auto_preset(config.args, base)
    except ClusterSpecError as exc:
        raise pytest.UsageError(f"pdserve: {where}: {exc}") from None
    if name is None:
        paths = " ".join(config.args) if len(config.args) <= 5 else " ".join(config.args[:5]) + " ..."
        raise pytest.UsageError(
            f"pdserve: {where} found none of vLLM's P/D modules ({', '.join(AUTO)}) in {paths}; name the preset "
            f"(--pd-preset=NAME, one of {', '.join(PRESETS)}) or the module to run"
        )
    return name


def session_proxy_port(cfg: PDServeConfig, result: PresetResult | None) -> int | None:
    """``--pd-proxy-port``, else the port the preset's module hard-codes (8192), else None (leased)."""
    if cfg.proxy_port is not None:
        return cfg.proxy_port
    return result.proxy_port if result is not None else None


def is_xdist_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("dsession") and not hasattr(config, "workerinput")
