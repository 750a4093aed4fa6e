"""``--pd-kv-connector-config JSON``: a session-wide connector, validated, as `ClusterSpec` fields.

The JSON is the part of vLLM's ``--kv-transfer-config`` that is the same on both servers; pdserve adds the outer
``kv_role`` per server (producer / consumer). A MultiConnector's children sit in
``kv_connector_extra_config.connectors`` as in vLLM's scripts, each a connector config of its own (nesting
allowed) with its own ``kv_role``, which vLLM requires of every child (``kv_both`` in its scripts); one of the
connectors must be a NixlConnector, since that is what moves KV from P to D. What else vLLM refuses of them (per
version and platform) is `pytest_pdserve.rules.connectors`, checked before a start.

pytest-free and light (stdlib + spec), since settings.py calls it while pytest configures.
"""

from __future__ import annotations

import json
from typing import Any

from pytest_pdserve.errors import ClusterSpecError
from pytest_pdserve.spec import KV_CONNECTORS, ClusterSpec, json_object, refuse_children

__all__ = ["parse_kv_connector_config"]

#: Top-level keys pdserve passes on; everything else of KVTransferConfig pdserve sets itself or does not support.
TOP_LEVEL_KEYS = ("kv_connector", "kv_buffer_device", "kv_connector_extra_config", "kv_load_failure_policy")
#: Keys a MultiConnector child may carry (its own role included: vLLM's scripts give children ``kv_both``).
CHILD_KEYS = ("kv_connector", "kv_role", "kv_buffer_device", "kv_connector_extra_config", "kv_connector_module_path")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def _check_child(child: Any, where: str) -> bool:
    """Validate one MultiConnector child; True when it (or a nested child) is a NixlConnector."""
    if not isinstance(child, dict):
        raise ClusterSpecError(f"{where} must be a JSON object, got {json.dumps(child)}")
    unknown = sorted(set(child) - set(CHILD_KEYS))
    if unknown:
        raise ClusterSpecError(f"{where} has unknown key(s) {unknown}; accepted: {', '.join(CHILD_KEYS)}")
    name = child.get("kv_connector")
    if not isinstance(name, str) or not name:
        raise ClusterSpecError(f"{where}.kv_connector must be a connector name such as NixlConnector")
    role = child.get("kv_role")
    if role is not None and role not in KV_ROLES:
        raise ClusterSpecError(f"{where}.kv_role {role!r} is not one of {KV_ROLES}")
    extra = child.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        raise ClusterSpecError(f"{where}.kv_connector_extra_config must be a JSON object")
    if name == "MultiConnector":
        return _check_children(extra, where)
    return name == "NixlConnector"


def _check_children(extra: Any, where: str) -> bool:
    children = (extra or {}).get("connectors")
    if not isinstance(children, list) or not children:
        raise ClusterSpecError(
            f"{where} is a MultiConnector: kv_connector_extra_config.connectors must be a non-empty list of "
            'connector configs, e.g. [{"kv_connector":"NixlConnector","kv_role":"kv_both"}, ...]'
        )
    found = False
    for i, child in enumerate(children):
        found = _check_child(child, f"{where}.kv_connector_extra_config.connectors[{i}]") or found
    return found


def parse_kv_connector_config(text: str) -> dict[str, Any]:
    """``ClusterSpec`` fields (``kv_connector``, ``kv_connector_extra_config``, ...) from the JSON text.

    :raises ClusterSpecError: not JSON, not an object, an unknown key, ``kv_role`` at the top (pdserve sets it),
        an unsupported connector, or a MultiConnector without a NixlConnector child.
    """
    config = json_object(text, "the value", example='{"kv_connector":"NixlConnector"}')
    if "kv_role" in config:
        raise ClusterSpecError("kv_role: pdserve sets it per server (kv_producer on prefill, kv_consumer on decode)")
    unknown = sorted(set(config) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ClusterSpecError(f"unknown key(s) {unknown}; accepted: {', '.join(TOP_LEVEL_KEYS)}")
    name = config.get("kv_connector", "NixlConnector")
    if name not in KV_CONNECTORS:
        raise ClusterSpecError(f"kv_connector {name!r} is not supported; use one of {KV_CONNECTORS}")
    extra = config.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        raise ClusterSpecError("kv_connector_extra_config must be a JSON object")
    if name == "MultiConnector" and not _check_children(extra, "the MultiConnector"):
        raise ClusterSpecError("a MultiConnector for P/D needs a NixlConnector among its connectors")
    if name == "MultiConnector":
        refuse_children(extra or {}, "kv_connector_extra_config")
    fields: dict[str, Any] = {"kv_connector": name}
    for key in ("kv_buffer_device", "kv_load_failure_policy", "kv_connector_extra_config"):
        if key in config:
            fields[key] = config[key]
    ClusterSpec(**fields)  # the spec's own checks (policy names, JSON object) in one place
    return fields
