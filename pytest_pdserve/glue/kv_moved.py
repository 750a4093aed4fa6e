"""``--pd-export-env``'s per-module proof that P/D happened: the KV each of vLLM's modules moved from prefill to
decode (decode's ``external_kv_transfer`` tokens and NIXL bytes), the summary's lines, and
``--pd-require-kv-transfer``'s verdict on a module that moved none (a proxy that never calls prefill). Called by
export_env.py's plugin, which holds the record (`Exported`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import pytest

from pytest_pdserve.config.settings import PDServeConfig

if TYPE_CHECKING:  # export_env.py imports this module
    from pytest_pdserve.cluster import PDCluster
    from pytest_pdserve.glue.export_env import Exported
    from pytest_pdserve.metrics import MetricsDelta, MetricsSnapshot

__all__ = ["delta_or_zero", "module_boundary", "module_lines", "require_kv_transfer", "test_passed", "vacuous_modules"]


def delta_or_zero(delta: MetricsDelta, name: str, **labels: str) -> float:
    """A counter's delta, 0 when the server does not export it (yet)."""
    value = delta.get(name, **labels)
    return 0.0 if value is None else value


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _decode_moved(cluster: PDCluster, start: Mapping[str, MetricsSnapshot]) -> tuple[float, float] | None:
    """Decode's external_kv_transfer tokens and NIXL bytes since ``start`` (None: metrics unreadable)."""
    # Lazy: metrics.py imports httpx and prometheus_client, which loading the plugin must not pay
    # (tests/project/test_imports.py); a running cluster has imported it already.
    from pytest_pdserve.metrics import NIXL_BYTES_SUM

    tokens = nixl = 0.0
    try:
        for server in cluster.decode:
            delta = server.metrics() - start[server.name]
            tokens += delta_or_zero(delta, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
            nixl += delta_or_zero(delta, NIXL_BYTES_SUM)
    except Exception:  # a report, never a failure of its own (a dead server is reported elsewhere)
        return None
    return tokens, nixl


def module_boundary(exported: Exported | None, item: pytest.Item, nextitem: pytest.Item | None, starting: bool) -> None:
    """Around each test (``pytest_runtest_protocol``, and before its teardown: the session's last one stops the
    clusters): snapshot decode's metrics when a module starts, and when it ends record the KV it moved from prefill
    to decode (issue 26: vLLM's test_edge_cases primes decode directly, so its prefix-cache hits stay the same
    through a proxy that never calls prefill; only these drop to 0)."""
    if exported is None or exported.cluster is None:
        return
    module = _module_of(item.nodeid)
    if starting:
        if exported.module_start is None or exported.module_start[0] != module:
            try:
                exported.module_start = (module, {s.name: s.metrics() for s in exported.cluster.decode})
            except Exception:  # a report, never a failure of its own
                exported.module_start = None
        return
    if nextitem is not None and _module_of(nextitem.nodeid) == module:
        return
    if exported.module_start is not None and exported.module_start[0] == module:
        moved = _decode_moved(exported.cluster, exported.module_start[1])
        if moved is not None:
            exported.moved[module] = moved
    exported.module_start = None
    if nextitem is None:  # the session's last test, before its teardown stops the cluster: the summary's numbers
        with contextlib.suppress(Exception):
            exported.final = {s.name: s.metrics() for s in (*exported.cluster.prefill, *exported.cluster.decode)}


def test_passed(exported: Exported | None, report: pytest.TestReport) -> None:
    """After each test's report is made (``pytest_runtest_makereport``): remember the modules with a passed test."""
    if exported is not None and report.when == "call" and report.passed:
        exported.passed.add(_module_of(report.nodeid))


def require_kv_transfer(cfg: PDServeConfig, exported: Exported | None) -> bool:
    """``--pd-require-kv-transfer``, else on exactly when a preset is in use (the presets stand for P/D scripts)."""
    if cfg.sources.get("require_kv_transfer", "default") != "default":
        return cfg.require_kv_transfer
    return exported is not None and exported.preset is not None


def vacuous_modules(exported: Exported | None) -> list[str]:
    """Modules that passed a test and moved no KV from prefill to decode."""
    if exported is None:
        return []
    return sorted(m for m, (tokens, nixl) in exported.moved.items() if m in exported.passed and not tokens and
                  not nixl)  # fmt: skip


def module_lines(exported: Exported, required: bool) -> list[str]:
    """Terminal-summary lines: the KV each module moved from prefill to decode, and what requiring it did."""
    if not exported.moved:
        return []
    lines = [f"pdserve: KV moved prefill -> decode in {m}: external_kv_transfer {t:.0f} tokens, NIXL {b:.0f} bytes"
             for m, (t, b) in sorted(exported.moved.items())]  # fmt: skip
    vacuous = vacuous_modules(exported)
    if vacuous:
        why = ("failing the session (--pd-require-kv-transfer"
               + (", on under --pd-preset)" if exported.preset else ")"))  # fmt: skip
        tail = why if required else "(--pd-require-kv-transfer fails the session for this)"
        lines.append(f"pdserve: no KV moved from prefill to decode in {', '.join(vacuous)}: the P/D path was not "
                     f"exercised (a proxy that never calls prefill passes this way); {tail}")  # fmt: skip
    return lines
