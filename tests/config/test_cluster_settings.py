"""One settings object (config/cluster_settings.py) and one merge per spec (``ClusterManager.asked``).

The manager, the launcher and the GPU planner read the same `ClusterSettings`; a spec is merged with the session
(``effective.effective``) once, however often it is checked or started.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_pdserve.config import effective as effective_module
from pytest_pdserve.config.cluster_settings import ClusterSettings
from pytest_pdserve.config.effective import AskedConfig, SessionDefaults
from pytest_pdserve.engines.engine import SIM_ARGV, SIM_VERSION, EngineInfo, EngineSetup
from pytest_pdserve.errors import OwnedFlagError
from pytest_pdserve.machine.inventory import simulated_inventory
from pytest_pdserve.running import manager as manager_module
from pytest_pdserve.running.manager import ClusterManager
from pytest_pdserve.spec import ClusterSpec


def _manager(tmp_path: Path, **settings: object) -> ClusterManager:
    inventory = simulated_inventory("cpu", 0)
    defaults = SessionDefaults(max_model_len=2048, platform=inventory.platform)
    cluster_settings = ClusterSettings(
        defaults,
        inventory,
        log_dir=tmp_path / "logs",
        lease_dir=tmp_path / "leases",
        **settings,  # type: ignore[arg-type]
    )
    return ClusterManager(
        cluster_settings, engine_setup=lambda name: EngineSetup(EngineInfo("sim", SIM_ARGV, SIM_VERSION))
    )


def test_the_manager_launcher_and_planner_share_one_settings_object(tmp_path: Path) -> None:
    manager = _manager(tmp_path, share_gpus=True, startup_timeout=7.0)
    assert manager.launcher.settings is manager.settings
    assert manager.launcher.gpus.settings is manager.settings
    assert manager.inventory is manager.settings.inventory


def test_a_spec_is_merged_with_the_session_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    merged: list[ClusterSpec] = []

    def counted(spec: ClusterSpec, session: SessionDefaults) -> AskedConfig:
        merged.append(spec)
        return effective_module.effective(spec, session)

    monkeypatch.setattr(manager_module, "effective", counted)
    manager = _manager(tmp_path)
    spec, other = ClusterSpec(name="a"), ClusterSpec(name="b", max_model_len=1024)
    for _ in range(3):  # the fixtures' check, the manager's own before a start, the start: one merge
        manager.check_accepted(spec)
    assert manager.asked(spec).max_model_len == 2048
    assert manager.asked(other).max_model_len == 1024
    assert merged == [spec, other]


def test_a_merge_that_fails_is_raised_at_every_ask(tmp_path: Path) -> None:
    """A refused spec is not remembered as merged: each ask raises the same error."""
    manager = _manager(tmp_path)
    bad = ClusterSpec(max_model_len=1024, extra_args=("--max-model-len", "9"))
    for _ in range(2):
        with pytest.raises(OwnedFlagError):
            manager.asked(bad)
