"""Error texts as vLLM sends them: sanitized (vLLM 0.32 entrypoints/serve/exception_handling/utils.py)."""

from __future__ import annotations

import pytest

from pytest_pdserve.sim.app import sanitize_message


@pytest.mark.parametrize(
    ("raw", "sent"),
    [
        # The trailing period is part of the path match, as in vLLM (the differential test caught this in CI).
        ("The model `nope` does not exist. Valid aliases: /tmp/ci/.cache/models/llama-1a2b.",
         "The model `nope` does not exist. Valid aliases: <path>"),
        ("failed at /home/u/x.py", "failed at <path>"),
        ("bad <object at 0xdeadbeef>", "bad <object>"),
        ("kept: /work/main/.cache/x.", "kept: /work/main/.cache/x."),
        ("file /a/b/c.json missing", "file <path> missing"),
    ],
)  # fmt: skip
def test_error_messages_are_sanitized_like_vllm(raw: str, sent: str) -> None:
    assert sanitize_message(raw) == sent
