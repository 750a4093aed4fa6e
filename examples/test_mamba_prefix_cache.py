"""Port of vLLM's test_mamba_prefix_cache.py (hybrid SSM model, P/D with prefix caching) onto the plugin.

vLLM's run_mamba_prefix_cache_test.sh sets VLLM_SSM_CONV_STATE_LAYOUT=DS and VLLM_KV_CACHE_LAYOUT=HND on both
servers, --block-size 128, --trust-remote-code and --enable-prefix-caching: `ClusterSpec.hybrid_ssm()` is that
setup. Its checks were: request 1 moves KV, the identical request 2 moves less (the decode-side prefix cache hit),
and both outputs are equal; it only printed the cache counters. Here each check is one assertion.

On GPUs run it as CI does:  pytest examples/test_mamba_prefix_cache.py --pd-engine=vllm --pd-model=<hybrid model>
"""

from __future__ import annotations

import pytest

from pytest_pdserve import session_engine
from pytest_pdserve.assertions import (
    assert_deterministic,
    assert_kv_faithful,
    assert_kv_transferred,
    assert_transfer_shrinks,
)
from pytest_pdserve.prompts import prompt_with_tokens
from pytest_pdserve.spec import ClusterSpec

pytestmark = pytest.mark.gpus(2)

#: vLLM's CPU Mamba kernel (ops/cpu/mamba_ssm.py) returns one final state per sequence and ignores the
#: intermediate states a prefix-cache checkpoint needs, so on CPU a prefill of more than one block kills the engine
#: (IndexError in mamba_mixer2.py); the simulator on the CPU platform follows it (pytest_pdserve/rules/mamba.py).
#: GPU kernels have no such limit.
CPU_MAMBA_LIMIT = (
    "vLLM's CPU Mamba kernel cannot prefix-cache a prompt of more than one block (mamba_ssm.py ignores "
    "return_intermediate_states; the engine dies with IndexError), and the simulator on the CPU platform follows "
    "it: run this on a GPU (or the simulator's, --pd-simulate-gpus=cuda:2)"
)


@pytest.fixture(scope="module")
def hybrid_cluster(pd_cluster_factory):
    return pd_cluster_factory(ClusterSpec.hybrid_ssm())


@pytest.mark.skipif(session_engine().platform == "cpu", reason=CPU_MAMBA_LIMIT)
def test_long_prompt_prefix_cache(hybrid_cluster):
    request = {"prompt": prompt_with_tokens(hybrid_cluster, 1200, seed=30), "max_tokens": 10, "seed": 42}
    assert_transfer_shrinks(hybrid_cluster, request)  # request 1 > 0 bytes, request 2 fewer
    assert_deterministic(hybrid_cluster, request)


def test_short_prompt_transfers_and_repeats(hybrid_cluster):
    # Shorter than one block (128 tokens), so it also runs on vLLM's CPU backend.
    request = {"prompt": prompt_with_tokens(hybrid_cluster, 40, seed=31), "max_tokens": 10, "seed": 42}
    assert_kv_transferred(hybrid_cluster, request)
    assert_deterministic(hybrid_cluster, request)


def test_decode_computed_with_the_right_kv_and_state(hybrid_cluster):
    # Prefill stops one token short and sends the KV and the Mamba state after it; decode computes the last token.
    # The first token must match a direct serve on decode. On the CPU platform the prompt stays within one block
    # (see above: both engines' CPU Mamba kernel dies on a longer prefill).
    tokens = 40 if hybrid_cluster.platform == "cpu" else 300
    request = {"prompt": prompt_with_tokens(hybrid_cluster, tokens, seed=32), "max_tokens": 8}
    assert_kv_faithful(hybrid_cluster, request)
