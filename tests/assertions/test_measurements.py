"""Measurements that cannot lie (issue 14), seen as users meet them: one real inner pytest session against
real simulator clusters, whose fault switches make each case happen for a real reason.

- tie-aware determinism: FLASH_ATTN made not batch-invariant in the simulator (a fault switch); the warm run changes a
  confident token, with ``PDSERVE_SIM_TIE_FLIP=1`` it flips a near-tie (gap 0.001 nats) to the runner-up.
- per-test cache isolation: two tests send the same prompt to one shared cluster; under the default
  ``--pd-cache-salt=per-test`` the second sees no hit, with ``off`` it does, and an explicit salt shares.
- effective configuration: a server that silently serves another block size
  (``PDSERVE_SIM_OVERRIDE_BLOCK_SIZE``) or starts without its KV connector (``PDSERVE_SIM_KV_CONNECTOR_OFF``)
  fails the cluster's start naming the server and both values; ``auto`` becomes the backend really running.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

#: FLASH_ATTN exists on GPU platforms only (on the CPU platform it is refused before the start, as vLLM for CPU
#: would run CPU_ATTN): the inner session simulates two CUDA GPUs.
GPU_PLATFORM = "--pd-simulate-gpus=cuda:2"

INNER = r"""
import pytest
from pytest_pdserve.assertions import *
from pytest_pdserve.prompts import prompt_with_tokens
from pytest_pdserve.spec import ClusterSpec

#: Batch variance is a simulator fault asked for (vLLM's FLASH_ATTN was deterministic on the H200 for the tiny model).
FLAKY_ENV = (("PDSERVE_SIM_NONDETERMINISTIC_BACKENDS", "FLASH_ATTN"),)
CONFIDENT = ClusterSpec(attention_backend="FLASH_ATTN", env=FLAKY_ENV, name="confident")
TIES = ClusterSpec(attention_backend="FLASH_ATTN", env=(*FLAKY_ENV, ("PDSERVE_SIM_TIE_FLIP", "1")), name="ties")


def request(cluster, seed):
    return {"prompt": prompt_with_tokens(cluster, 200, seed=seed), "max_tokens": 12}


def test_confident_flip_fails(pd_cluster_factory):
    c = pd_cluster_factory(CONFIDENT)
    assert_deterministic(c, request(c, 1))


def test_confident_flip_fails_even_with_a_tolerance(pd_cluster_factory):
    c = pd_cluster_factory(CONFIDENT)
    assert_deterministic(c, request(c, 2), tie_tolerance=0.05)


def test_tie_flip_fails_without_a_tolerance(pd_cluster_factory):
    c = pd_cluster_factory(TIES)
    assert_deterministic(c, request(c, 3))


def test_tie_flip_accepted_with_a_tolerance(pd_cluster_factory):
    c = pd_cluster_factory(TIES)
    result = assert_deterministic(c, request(c, 4), tie_tolerance=0.05)
    assert len(result.tie_flips) == 1, result.tie_flips
    flip = result.tie_flips[0]
    assert flip.verdict == TIE_FLIP and flip.gap < 0.01 and flip.token_a != flip.token_b
    print("ACCEPTED", flip)


def test_server_helpers(pd_cluster, pytestconfig):
    from pytest_pdserve import clients

    decode = pd_cluster.decode[0]
    assert decode.complete("hello world", max_tokens=3)["usage"]["completion_tokens"] == 3
    assert pd_cluster.chat("hi", max_tokens=2)["usage"]["completion_tokens"] == 2
    assert decode.chat([{"role": "user", "content": "hi"}], max_tokens=1)["choices"][0]["message"]["role"]
    assert decode.reset_prefix_cache() is True
    with pytest.raises(AssertionError, match=r"decode-0: POST http://127.0.0.1:\d+/v1/completions -> 400: .*"
                       r"\n  request: POST /v1/completions \{"):
        decode.complete("x", max_tokens=0)
    assert clients.OPTIONS.request_timeout == 123.0  # --pd-request-timeout reached the clients
    assert "came from --pd-request-timeout" in clients.OPTIONS.timeout_remedy
"""

EXPECTED_OUTCOME = "3 failed, 2 passed"

SALT_INNER = """
import os
from pytest_pdserve.assertions import *
from pytest_pdserve.prompts import prompt_with_tokens

PER_TEST = os.environ["SALT_MODE"] == "per-test"


def request(cluster, **extra):
    return {"prompt": prompt_with_tokens(cluster, 300, seed=11), "max_tokens": 2, **extra}


def test_1_warms_decode(pd_cluster, pd_cache_salt):
    assert (pd_cache_salt is not None) == PER_TEST
    complete(pd_cluster.decode[0], request(pd_cluster))
    assert_prefix_cache_hit(pd_cluster.decode[0], request(pd_cluster), min_hit_tokens=256)  # same test: a hit


def test_2_same_prompt_other_test(pd_cluster):
    hits = pd_cluster.decode[0].metrics().prefix_cache_hits()
    complete(pd_cluster.decode[0], request(pd_cluster))
    gained = pd_cluster.decode[0].metrics().prefix_cache_hits() - hits
    print("GAINED", gained)
    assert (gained == 0) == PER_TEST, gained


def test_3_shares_explicitly(pd_cluster):
    complete(pd_cluster.decode[0], request(pd_cluster, cache_salt="team-a"))


def test_4_shares_explicitly(pd_cluster):
    assert_prefix_cache_hit(pd_cluster.decode[0], request(pd_cluster, cache_salt="team-a"), min_hit_tokens=256)


def test_5_pd_round_trip_under_the_salt(pd_cluster):
    assert_kv_transferred(pd_cluster, request(pd_cluster, max_tokens=3))
    assert_prompt_token_sources(pd_cluster, expect="full_hit", request=request(pd_cluster))
"""


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One inner session for the module (as a user runs it); each case reads its part."""
    root = tmp_path_factory.mktemp("inner")
    (root / "test_inner.py").write_text(INNER)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") and k != "ATTENTION_BACKEND"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pd-engine=sim", f"--pd-lease-dir={root / 'leases'}", "-rfE", "-s",
         "--pd-request-timeout=123", GPU_PLATFORM],
        cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module", params=["per-test", "off"])
def salt_session(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    mode = request.param
    root = tmp_path_factory.mktemp(f"salt-{mode}")
    (root / "test_salt.py").write_text(SALT_INNER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") and k != "ATTENTION_BACKEND"}
    env["SALT_MODE"] = mode
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pd-engine=sim", f"--pd-lease-dir={root / 'leases'}", "-rfE", "-s",
         "-p", "no:cacheprovider", f"--pd-cache-salt={mode}"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    return mode, proc.stdout + proc.stderr


def test_cache_salt_isolates_tests_unless_off_or_shared(salt_session: tuple[str, str]) -> None:
    mode, text = salt_session
    assert "5 passed" in text, text[-4000:]
    assert ("GAINED 0.0" in text) == (mode == "per-test"), text[-4000:]


VERIFY_INNER = """
from pytest_pdserve.spec import ClusterSpec


def test_block_size_override_fails_the_start(pd_cluster_factory):
    pd_cluster_factory(ClusterSpec(decode_env={"PDSERVE_SIM_OVERRIDE_BLOCK_SIZE": "64"}, name="bs"))


def test_connector_off_fails_the_start(pd_cluster_factory):
    pd_cluster_factory(ClusterSpec(prefill_env={"PDSERVE_SIM_KV_CONNECTOR_OFF": "1"}, name="nokv"))


def test_no_kv_pull_is_not_pd_ready(pd_cluster_factory):
    pd_cluster_factory(ClusterSpec(kv_load_failure_policy="recompute", decode_env={"PDSERVE_SIM_FAIL_KV_PULL": "1"},
                                   name="nopull"))


def test_effective_values_are_kept(pd_cluster):
    assert pd_cluster.attention_backend == "CPU_ATTN"  # asked auto: what really runs
    effective = pd_cluster.effective["decode-0"]
    assert (effective.block_size, effective.kv_connector_active, effective.kv_role) == (128, True, "kv_consumer")
    print("DESCRIBE", pd_cluster.describe())
"""


@pytest.fixture(scope="module")
def verify_session(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("verify")
    (root / "test_verify.py").write_text(VERIFY_INNER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") and k != "ATTENTION_BACKEND"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pd-engine=sim", f"--pd-lease-dir={root / 'leases'}", "-rfE", "-s",
         "-p", "no:cacheprovider"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    return proc.stdout + proc.stderr


def test_verify_outcome(verify_session: str) -> None:
    assert "3 failed, 1 passed" in verify_session, verify_session[-4000:]


def test_a_silently_different_block_size_fails_the_start_with_both_values(verify_session: str) -> None:
    text = _section(verify_session, "test_block_size_override_fails_the_start")
    assert "decode-0: does not run what was asked:" in text
    assert "decode-0: block_size: asked 128, runs 64 (vllm:cache_config_info)" in text
    assert "prefill-0: block_size" not in text


def test_a_missing_kv_connector_fails_the_start(verify_session: str) -> None:
    text = _section(verify_session, "test_connector_off_fails_the_start")
    assert "prefill-0: kv_connector: asked NixlConnector, runs none active (no vllm:nixl_* metrics)" in text


def test_a_cluster_that_moves_no_kv_is_not_handed_out(verify_session: str) -> None:
    """P/D-ready, not HTTP-ready: the decode server answers, but its KV pulls fail (recompute policy)."""
    text = _section(verify_session, "test_no_kv_pull_is_not_pd_ready")
    assert "proxy: the cluster answers HTTP but is not P/D-ready: a request through the proxy moved no KV" in text
    assert "vllm:nixl_bytes_transferred_sum" in text


def test_the_ready_line_shows_the_round_trip(verify_session: str) -> None:
    assert re.search(r"cluster pd \(sim, 1P x 1D\) ready in [\d.]+s \(P/D round trip [\d.]+s\)", verify_session)


def test_the_ready_line_shows_effective_values(verify_session: str) -> None:
    assert "backend=CPU_ATTN model=pdserve-sim/tiny-llama effective: block=128 backend=CPU_ATTN" in verify_session


def _section(text: str, test: str) -> str:
    start = text.index(f"_ {test} _")
    end = text.find("\n___", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_outcome(session: str) -> None:
    assert EXPECTED_OUTCOME in session, session[-3000:]
    assert "INTERNALERROR" not in session


def test_confident_flip_gets_its_verdict(session: str) -> None:
    text = _section(session, "test_confident_flip_fails")
    assert "outputs differ at token" in text
    gap = re.search(r"verdict: confident flip \(top-1/top-2 logprob gap (\d+\.\d+)", text)
    assert gap is not None, text
    assert float(gap.group(1)) >= 0.06  # the simulator's smallest natural gap (sim/tokenizer.py MIN_GAP)


def test_confident_flip_fails_whatever_the_tolerance(session: str) -> None:
    text = _section(session, "test_confident_flip_fails_even_with_a_tolerance")
    assert "verdict: confident flip" in text
    assert "a tie flip is a gap under 0.05" in text


def test_tie_flip_gets_its_verdict(session: str) -> None:
    text = _section(session, "test_tie_flip_fails_without_a_tolerance")
    assert "verdict: tie flip (top-1/top-2 logprob gap 0.0010" in text


def test_tie_flip_is_accepted_with_a_tolerance(session: str) -> None:
    assert "ACCEPTED FlipVerdict(" in session


@pytest.mark.parametrize(
    ("log", "backend"),
    [
        # vLLM 0.26.0 on an H200, tiny NemotronH (hybrid), --attention-backend FLASH_ATTN (issue 24's GPU run):
        ("Using AttentionBackendEnum.FLASH_ATTN backend.\nDetected attention backend(s) ['MAMBA2_ATTN', 'FLASH_ATTN']",
         "FLASH_ATTN"),
        ("Detected attention backend(s) ['MAMBA2_ATTN', 'TRITON_ATTN']", "TRITON_ATTN"),
        ("Detected attention backend(s) ['CPU_ATTN']", "CPU_ATTN"),
        ("Detected attention backend(s) ['GDN_ATTN']\nUsing FLASHINFER attention backend", "FLASHINFER"),
        ("Detected attention backend(s) ['MAMBA2_ATTN']", None),
    ],
)  # fmt: skip
def test_a_hybrid_models_state_space_backend_is_not_its_attention_backend(log: str, backend: str | None) -> None:
    from pytest_pdserve.running.verify import _backend_from_log

    assert _backend_from_log(log) == backend
