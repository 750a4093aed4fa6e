"""The deliberate batch variance: warm-cache outputs differ on "non-batch-invariant" backends only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._simproc import SimServer, sim_processes, words

#: GPU backends exist on a GPU platform only: on the simulated CPU platform every one runs CPU_ATTN (vLLM's rule).
CUDA = {"PDSERVE_SIM_PLATFORM": "cuda"}
#: Batch variance is a fault asked for: by default no backend varies (vLLM 0.26's FLASH_ATTN did not, on an H200).
FLAKY_FLASH = {**CUDA, "PDSERVE_SIM_NONDETERMINISTIC_BACKENDS": "FLASH_ATTN"}
#: FLASHINFER takes heads of 64, 128, 256 or 512 (vLLM refuses it for the tiny Llama's 32: sim/attention.py).
HEADS_OF_128 = "Qwen/Qwen3-0.6B"
SHORT = ("--max-model-len", "2048")  # its 40,960 tokens would not fit the default 1 GiB KV cache


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimServer]]:
    with sim_processes(tmp_path_factory.mktemp("nd")) as start:
        started = {
            "flash_attn": start("--attention-backend", "FLASH_ATTN", env=FLAKY_FLASH),
            "flash_attn_default": start("--attention-backend", "FLASH_ATTN", env=CUDA),
            "flashinfer": start("--attention-backend", "FLASHINFER", *SHORT, env=CUDA, model=HEADS_OF_128),
            "triton": start("--attention-backend", "triton_attn", env=CUDA),
            "flash_attn_rate0": start(
                "--attention-backend", "FLASH_ATTN", env={**FLAKY_FLASH, "PDSERVE_SIM_NONDETERMINISM_RATE": "0"}
            ),
            "flashinfer_listed": start(
                "--attention-backend",
                "FLASHINFER",
                *SHORT,
                env={**CUDA, "PDSERVE_SIM_NONDETERMINISTIC_BACKENDS": "FLASHINFER,ROCM_ATTN"},
                model=HEADS_OF_128,
            ),
        }
        yield {name: server.wait_ready() for name, server in started.items()}


def _cold_and_warm(server: SimServer, prompt: str) -> tuple[list[int], list[int]]:
    cold = server.complete(prompt, max_tokens=12, return_token_ids=True).json()
    warm = server.complete(prompt, max_tokens=12, return_token_ids=True).json()
    assert warm["usage"]["prompt_tokens"] == 41
    return cold["choices"][0]["token_ids"], warm["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    ("name", "differs"),
    [
        ("flash_attn", True),
        ("flash_attn_default", False),
        ("flashinfer", False),
        ("triton", False),
        ("flash_attn_rate0", False),
        ("flashinfer_listed", True),
    ],
)
def test_warm_cache_output(servers: dict[str, SimServer], name: str, differs: bool) -> None:
    cold, warm = _cold_and_warm(servers[name], words(40, tag="nd"))  # 41 tokens: 2 blocks of 16 hit
    changed = [i for i, (a, b) in enumerate(zip(cold, warm, strict=True)) if a != b]
    if differs:
        assert len(changed) == 1
        assert changed[0] >= 1
    else:
        assert changed == []


def test_variance_is_reproducible_and_needs_a_hit(servers: dict[str, SimServer]) -> None:
    server = servers["flash_attn"]
    prompt = words(40, tag="repro")
    cold, warm = _cold_and_warm(server, prompt)
    again = server.complete(prompt, max_tokens=12, return_token_ids=True).json()["choices"][0]["token_ids"]
    assert again == warm != cold
    short = "tiny prompt"  # shorter than a block: never a hit, never a change
    outs = {
        tuple(server.complete(short, max_tokens=12, return_token_ids=True).json()["choices"][0]["token_ids"])
        for _ in range(2)
    }
    assert len(outs) == 1
