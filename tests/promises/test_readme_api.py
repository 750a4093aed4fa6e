"""The API the README documents for a test author is the API there is, and behaves as documented (issue 45): the
``ClusterSpec`` field table (names, types' presence, defaults), the metrics accessors and ``MetricsDelta``, and the
session engine."""

from __future__ import annotations

import ast
import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

import pytest_pdserve
from pytest_pdserve.cluster import PDCluster
from pytest_pdserve.errors import MetricNotFoundError
from pytest_pdserve.glue.session_engine import SessionEngine
from pytest_pdserve.metrics import MetricsDelta, MetricsSnapshot, parse_metrics
from pytest_pdserve.spec import ClusterSpec

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _table(after: str) -> list[list[str]]:
    """The data rows of the first markdown table whose header line starts with ``after``."""
    start = README.index(after)
    rows = []
    for line in README[start:].splitlines()[1:]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]
            if not set(cells[0]) <= {"-"}:
                rows.append(cells)
        elif rows:
            break
    return rows


def _names(cell: str) -> list[str]:
    return re.findall(r"`([a-z_]+)(?:\([^`]*\))?`", cell)


def test_the_cluster_spec_table_is_every_field_with_its_default() -> None:
    rows = _table("| field | type | default | what |")
    documented: dict[str, str] = {}
    for cells in rows:
        defaults = [d.strip().strip("`") for d in cells[2].split(",")]
        names = _names(cells[0])
        for name, default in zip(names, defaults * len(names) if len(defaults) == 1 else defaults, strict=True):
            documented[name] = default
    spec_fields = {f.name: f for f in fields(ClusterSpec)}
    assert set(documented) == set(spec_fields)
    spec = ClusterSpec()
    for name, text in documented.items():
        value = ast.literal_eval(text)
        actual = getattr(spec, name)
        if isinstance(value, dict):  # env fields are stored frozen, as sorted pairs
            value = tuple(sorted(value.items()))
        assert actual == value, (name, text, actual)
        assert spec_fields[name].default is not MISSING or spec_fields[name].default_factory is not MISSING


METRICS = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 299.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1.0
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 65536.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 1.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0"} 1.0
"""


def test_every_documented_metrics_accessor_exists_on_snapshots_and_deltas() -> None:
    rows = _table("| accessor | vLLM sample |")
    accessors = [name for cells in rows for name in _names(cells[0])]
    assert len(accessors) == 13
    for name in [*accessors, "value", "get", "has"]:
        assert callable(getattr(MetricsSnapshot, name)), name
        assert callable(getattr(MetricsDelta, name)), name
    for name in ("series", "info", "block_size", "names", "samples", "source", "taken_at"):
        assert hasattr(MetricsSnapshot, name) or name in {f.name for f in fields(MetricsSnapshot)}, name
    for name in ("before", "after", "changed"):
        assert hasattr(MetricsDelta, name) or name in {f.name for f in fields(MetricsDelta)}, name


def test_the_metrics_behave_as_documented() -> None:
    before = parse_metrics(METRICS.replace("299.0", "0.0").replace("65536.0", "0.0"), source="http://x/metrics")
    after = parse_metrics(METRICS, source="http://x/metrics")
    delta = after - before
    assert isinstance(delta, MetricsDelta)
    assert delta.prompt_tokens_by_source("external_kv_transfer") == 299.0
    assert delta.nixl_bytes_transferred() == 65536.0
    assert after.prefix_cache_hits(model_name="m") == 128.0  # a label narrows the sum
    assert after.block_size() == 128
    assert after.get("vllm:nope_total") is None
    with pytest.raises(MetricNotFoundError, match=r"no vllm:nixl_\* metrics at all|not exposed"):
        parse_metrics("# TYPE vllm:x counter\nvllm:x_total 1.0\n").nixl_transfers()
    with pytest.raises(ValueError, match="not a valid source"):
        after.prompt_tokens_by_source("remote")


def test_the_session_engine_and_the_cluster_notes_are_there() -> None:
    engine = SessionEngine("vllm", "cpu", "0.32.0", "requested")
    assert engine.real_vllm
    assert engine.vllm_for_cpu
    assert pytest_pdserve.session_engine is not None
    assert pytest_pdserve.SessionEngine is SessionEngine
    assert "notes" in {f.name for f in fields(PDCluster)}
    assert "pd_engine" in README


def test_session_engine_outside_a_session_says_where_to_call_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_pdserve.glue import session_engine as module

    monkeypatch.setattr(module, "_CONFIGS", [])
    with pytest.raises(RuntimeError, match="needs a pytest session with the pdserve plugin"):
        module.session_engine()


def test_session_engine_in_skipif_and_the_fixture(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from pytest_pdserve import session_engine

        ENGINE = session_engine()

        @pytest.mark.skipif(ENGINE.platform == "cpu", reason="on cpu")
        def test_skipped_on_cpu():
            pass

        def test_fixture(pd_engine):
            assert pd_engine is ENGINE
            assert (pd_engine.name, pd_engine.platform) == ("sim", "cpu")
            assert pd_engine.vllm_version == "0.31.0"  # the version the simulator is told to report
        """
    )
    result = pytester.runpytest_subprocess("--pd-engine=sim", "--pd-platform=cpu", "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, skipped=1)


@pytest.fixture(autouse=True)
def _sim_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_SIM_VLLM_VERSION", "0.31.0")
