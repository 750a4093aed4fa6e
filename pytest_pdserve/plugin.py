"""pytest11 entry point for pytest-pdserve: hooks only.

Imports stay light (stdlib + pytest + our pytest-free modules) so that loading the plugin costs
nothing measurable during collection; vllm and torch are never imported here.
"""

from __future__ import annotations

import shlex
from collections.abc import Generator

import pytest

from pytest_pdserve import logs
from pytest_pdserve.fixtures import CURRENT_ITEM, pd_cache_salt, pd_cluster, pd_cluster_factory, stop_manager
from pytest_pdserve.markers import apply_skips, register_markers
from pytest_pdserve.settings import (
    PDSERVE_CONFIG,
    add_options,
    get_inventory,
    resolve,
    start_inventory_detection,
)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``pdserve`` option group and ini keys."""
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Register markers, resolve the settings (usage error on bad input), start GPU detection."""
    register_markers(config)
    if config.getoption("help", False):
        return  # `pytest --help` must work even when a setting is bad
    config.stash[PDSERVE_CONFIG] = resolve(config)
    start_inventory_detection(config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Engine / model / backend / extra args, then platform, inventory and log dir; attach mode adds the URLs first."""
    cfg = config.stash[PDSERVE_CONFIG]
    extra = shlex.join(cfg.vllm_serve_extra_args) if cfg.vllm_serve_extra_args else "none"
    lines = [
        f"pdserve: engine {cfg.resolved_engine} ({cfg.engine_reason}), "
        f"model {cfg.model or 'engine default'}, attention backend {cfg.attention_backend or 'auto'}, "
        f"extra args {extra}"
    ]
    log_dir = str(cfg.log_dir) if cfg.log_dir is not None else "under basetemp"
    second = f"pdserve: inventory {get_inventory(config).describe()}; log dir {log_dir}"
    lines.append(second)
    if cfg.attach_mode:
        # Attach mode: say so first, since engine/GPU settings above do not apply to servers we did not start.
        proxy = cfg.proxy_url or "built-in (started here)"
        lines.insert(
            0,
            f"pdserve: attached (no servers started, no GPUs leased): prefill {' '.join(cfg.prefill_urls) or 'none'}; "
            f"decode {' '.join(cfg.decode_urls) or 'none'}; proxy {proxy}",
        )
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip items whose ``cuda``/``rocm``/``gpus``/``distributed`` markers cannot be met."""
    apply_skips(config, items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Remember the running test (to pause pytest-timeout while a cluster starts) and where logs end."""
    item.config.stash[CURRENT_ITEM] = item
    logs.record_offsets(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Attach what each server and the proxy logged during a failed test as report sections."""
    report = yield
    logs.attach_sections(item, report)
    return report


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop every cluster this process started, even if the session fixture never finalised."""
    stop_manager(config)


__all__ = ["pd_cache_salt", "pd_cluster", "pd_cluster_factory"]
