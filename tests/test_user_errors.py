"""An error raised on the user's behalf shows its message and the user's line, not the plugin's source (issue 45):
a bad ``ClusterSpec`` in a test, in a fixture (through the factory) or at module level, and a configuration vLLM
would refuse (``VllmRefuses``), raised before anything starts. Code that catches them by type still can."""

from __future__ import annotations

import pytest

MODULE = """
import pytest
from pytest_pdserve.spec import ClusterSpec
from pytest_pdserve.errors import ClusterSpecError, VllmRefuses


def test_a_bad_field():
    ClusterSpec(block_size=0)


@pytest.fixture
def multi(pd_cluster_factory):
    return pd_cluster_factory(ClusterSpec(kv_connector="MultiConnector",
                                          kv_connector_extra_config={"connectors": [{"kv_connector": "X"}]}))


def test_through_a_fixture(multi):
    pass


def test_refused_by_vllms_rule(pd_cluster_factory):
    pd_cluster_factory(ClusterSpec(name="nhd", env={"VLLM_KV_CACHE_LAYOUT": "NHD"}))


def test_caught_by_type(pd_cluster_factory):
    with pytest.raises(VllmRefuses):
        pd_cluster_factory(ClusterSpec(name="nhd2", env={"VLLM_KV_CACHE_LAYOUT": "NHD"}))
    with pytest.raises(ClusterSpecError):
        ClusterSpec(num_decode=0)
"""

PLUGIN_FRAMES = ("pytest_pdserve/spec.py", "pytest_pdserve/glue/", "pytest_pdserve/running/", "_check_int", "<string>")


def test_user_errors_show_the_message_and_the_users_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=MODULE)
    result = pytester.runpytest_subprocess("--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}",
                                           "-p", "no:cacheprovider")  # fmt: skip
    result.assert_outcomes(passed=1, failed=2, errors=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        "ClusterSpecError: ClusterSpec.block_size must be a whole number from 1 to 8192 or None, got 0",
        "(raised at *test_user.py:7, in test_a_bad_field: ClusterSpec(block_size=0))",
    ])  # fmt: skip
    result.stdout.fnmatch_lines([
        "ClusterSpecError: ClusterSpec.kv_connector_extra_config.connectors[[]0[]]: vLLM refuses it at start (Please "
        "specify kv_role when kv_connector is set*",
        "(raised at *test_user.py:12, in multi: return pd_cluster_factory(ClusterSpec(*",
    ])  # fmt: skip
    result.stdout.fnmatch_lines([
        "VllmRefuses: cluster 'nhd': prefill-0 would not run on the simulator, which follows vLLM 0.3* (cpu platform): "
        "vLLM would load the model, then its engine core dies with ValueError: VLLM_KV_CACHE_LAYOUT=NHD does not "
        "satisfy every supported set; valid layouts: [[]'LBHNC'[]]. Nothing was started.*",
        "(raised at *test_user.py:21, in test_refused_by_vllms_rule: *",
    ])  # fmt: skip
    for frame in PLUGIN_FRAMES:
        assert frame not in out, frame
    assert "pdserve: cluster nhd" not in out  # nothing started: no ready line


def test_a_bad_spec_at_module_level_is_one_collection_error_with_its_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mod="from pytest_pdserve.spec import ClusterSpec\nSPEC = ClusterSpec(prefill_tp='two')\n")
    result = pytester.runpytest_subprocess("--pd-engine=sim", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines([
        "ClusterSpecError: ClusterSpec.prefill_tp must be a whole number from 1 to 64, got 'two'",
        "(raised at test_mod.py:2: SPEC = ClusterSpec(prefill_tp='two'), while importing the module)",
    ])  # fmt: skip
    assert "pytest_pdserve/spec.py" not in result.stdout.str()
