"""`ClusterSettings`: every setting the session's clusters are started with, in one frozen object. [pytest-free]

Built once per pytest process from the resolved `PDServeConfig` (:meth:`ClusterSettings.for_config`, as pytest's
``Cache.for_config``) and handed whole to the manager, the launcher and the GPU planner: none of them takes a
setting one by one, so a new setting is one field here and one line in :meth:`for_config`. What the servers of
one cluster are asked to run is its `SessionDefaults` merged with the spec (``effective.effective``), once per
cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_pdserve.config.effective import SessionDefaults
from pytest_pdserve.machine.inventory import Inventory
from pytest_pdserve.machine.port_leases import DEFAULT_PORT_RANGE

if TYPE_CHECKING:  # annotations only: settings.py imports pytest, which this module does not
    from pytest_pdserve.config.settings import PDServeConfig

__all__ = ["ClusterSettings"]


@dataclass(frozen=True)
class ClusterSettings:
    """What the session's clusters are started with (the manager's, the launcher's and the planner's settings)."""

    #: The servers' settings, which a spec's own values override (``effective.effective``).
    defaults: SessionDefaults
    #: The platform and the GPUs this process sees.
    inventory: Inventory
    #: This run's log directory (each server's log, ``pdserve.log``).
    log_dir: Path
    #: The machine-wide lease directory (GPU and port leases).
    lease_dir: Path
    #: ``vllm`` or ``sim``: the engine of a spec that names none.
    default_engine: str = "sim"
    #: ``--pd-model``: the model of a spec that names none (None: the engine's default).
    model: str | None = None
    startup_timeout: float = 1200.0
    shutdown_timeout: float = 30.0
    gpu_wait: str = "wait"
    gpu_wait_timeout: float = 1800.0
    prefill_gpu_ids: tuple[int, ...] | None = None
    decode_gpu_ids: tuple[int, ...] | None = None
    share_gpus: bool = False
    #: ``--pd-proxy-command`` (None: the built-in proxy).
    proxy_command: tuple[str, ...] | None = None
    port_range: tuple[int, int | None] = DEFAULT_PORT_RANGE
    #: ``--pd-ready-check``: prove each new cluster moves KV before handing it out.
    ready_check: bool = True
    #: Whether the reports reach a terminal (a person watching) or a log (CI): how often progress is shown.
    terminal: bool = True
    #: Attach mode (``--pd-prefill-url``, ``--pd-decode-url``, ``--pd-proxy-url``): the servers someone else
    #: started; empty when the session starts its own.
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    #: None: the built-in proxy is started in front of the attached servers.
    proxy_url: str | None = None
    #: Where each attach role's URLs came from (``("decode", "--pd-decode-url")``), for the error that names them.
    attach_origin: tuple[tuple[str, str], ...] = ()

    @classmethod
    def for_config(cls, cfg: PDServeConfig, inventory: Inventory, *, log_dir: Path, terminal: bool) -> ClusterSettings:
        """The session's settings from the resolved configuration, on ``inventory`` (whose platform the servers
        follow), logging to ``log_dir``; ``terminal``: whether progress goes to a person watching."""
        # Lazy: short_source is settings.py's, which imports pytest; this module is loaded where pytest is.
        from pytest_pdserve.config.settings import short_source

        defaults = SessionDefaults(
            attention_backend=cfg.attention_backend,
            vllm_serve_extra_args=cfg.vllm_serve_extra_args,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            api_key=cfg.api_key,
            platform=inventory.platform,
            extra_args_source=short_source(cfg.sources["vllm_serve_extra_args"]),
            attention_backend_source=short_source(cfg.sources["attention_backend"]),
        )
        return cls(
            defaults=defaults, inventory=inventory, log_dir=log_dir, lease_dir=cfg.lease_dir,
            default_engine=cfg.resolved_engine, model=cfg.model, startup_timeout=cfg.startup_timeout,
            shutdown_timeout=cfg.shutdown_timeout, gpu_wait=cfg.gpu_wait, gpu_wait_timeout=cfg.gpu_wait_timeout,
            prefill_gpu_ids=cfg.prefill_gpu_ids, decode_gpu_ids=cfg.decode_gpu_ids, share_gpus=cfg.share_gpus,
            proxy_command=cfg.proxy_command, port_range=cfg.port_range or DEFAULT_PORT_RANGE,
            ready_check=cfg.ready_check, terminal=terminal, prefill_urls=cfg.prefill_urls,
            decode_urls=cfg.decode_urls, proxy_url=cfg.proxy_url,
            attach_origin=tuple((role, cfg.source_of(f"{role}_url{'' if role == 'proxy' else 's'}"))
                                for role in ("prefill", "decode", "proxy")),
        )  # fmt: skip
