"""One name per concept: what was asked and what a server really runs have different names.

There were two ``Effective`` classes (the spec merged with the settings, and what a server reported back), two
``EngineInfo`` (which program runs, and the simulator's /version facts), and ``cluster.attention_backend`` meant
"asked" until the start was verified and "observed" after it.
"""

from __future__ import annotations

import collections

from _package_classes import classes

from pytest_pdserve.cluster import PDCluster, ServerHandle
from pytest_pdserve.running.verify import ObservedConfig
from pytest_pdserve.spec import ClusterSpec


def test_no_public_class_name_is_defined_twice_in_the_package() -> None:
    where = collections.defaultdict(list)
    for path, name, _ in classes():
        if not name.startswith("_"):
            where[name].append(path)
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def _cluster(asked: str | None) -> PDCluster:
    return PDCluster(
        spec=ClusterSpec(), engine="sim", model="m", block_size=16, attention_backend_asked=asked,
        prefill=(ServerHandle("prefill", 0, "http://127.0.0.1:9"),),
        decode=(ServerHandle("decode", 0, "http://127.0.0.1:9"),), proxy=ServerHandle("proxy", 0, "http://127.0.0.1:9"),
    )  # fmt: skip


def test_attention_backend_is_what_runs_and_the_asked_one_keeps_its_meaning() -> None:
    cluster = _cluster("auto")
    assert (cluster.attention_backend_asked, cluster.attention_backend) == ("auto", "auto")  # nothing read back yet
    cluster.observed = {
        "prefill-0": ObservedConfig("prefill-0", attention_backend="CPU_ATTN"),
        "decode-0": ObservedConfig("decode-0", attention_backend="CPU_ATTN"),
    }
    assert cluster.attention_backend == "CPU_ATTN"  # what vLLM picked for auto
    assert cluster.attention_backend_asked == "auto"  # still what was asked, after the start was verified
    assert cluster.effective is cluster.observed  # the older name of the read-back values
    cluster.observed = {
        "prefill-0": ObservedConfig("prefill-0", attention_backend="CPU_ATTN"),
        "decode-0": ObservedConfig("decode-0", attention_backend=None),  # not exposed by this engine
    }
    assert cluster.attention_backend == "auto"  # no agreed reading: the asked one
    assert "backend=auto" in _cluster(None).describe()
