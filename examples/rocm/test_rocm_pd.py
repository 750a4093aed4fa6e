"""P/D on AMD GPUs, gated like vLLM's ROCm jobs. Run it as AMD CI does:

    ATTENTION_BACKEND=TRITON_ATTN pytest examples/rocm --pd-engine=vllm

(vLLM PR #44809 moved every ROCm NIXL job to TRITON_ATTN.) Elsewhere the `rocm` marker skips it with a reason.
"""

from __future__ import annotations

import pytest

from pytest_pdserve.assertions import assert_deterministic, assert_kv_transferred, assert_pd_matches_single

pytestmark = [pytest.mark.rocm, pytest.mark.distributed(num_gpus=2)]

PROMPT = "Red Hat is the best company in the world to work for because it works on open source software, " * 8


def test_rocm_pd_matches_single(pd_cluster):
    assert_pd_matches_single(pd_cluster, {"prompt": PROMPT, "max_tokens": 20})


def test_rocm_kv_transfer_and_determinism(pd_cluster):
    assert_kv_transferred(pd_cluster, {"prompt": PROMPT, "max_tokens": 8})
    assert_deterministic(pd_cluster, {"prompt": PROMPT, "max_tokens": 8})
