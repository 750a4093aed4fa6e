"""Known failure signatures in server logs map to actionable hints."""

from __future__ import annotations

import pytest

from pytest_pdserve.running.hints import HINTS, hint_for

_BY_KEY = {h.key: h.text for h in HINTS}


@pytest.mark.parametrize(
    ("log", "key"),
    [
        ("OSError: [Errno 98] Address already in use", "port-in-use"),
        ("zmq.error.ZMQError: Address already in use (addr='tcp://localhost:5600')", "port-in-use"),
        ("Error: listen EADDRINUSE: address already in use :::8000", "port-in-use"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB", "oom"),
        ("ValueError: Free memory on device (3.1/79.2 GiB) on startup is less than desired", "oom"),
        ("RuntimeError: HIP out of memory. Tried to allocate 2.00 GiB", "oom"),
        ("RuntimeError: NIXL is not available", "nixl-missing"),
        ("ModuleNotFoundError: No module named 'nixl'", "nixl-missing"),
        ("ValueError: Unknown attention backend: 'FLASH_ATTN_X'", "unknown-attention-backend"),
        (
            "huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name'",
            "model-not-found",
        ),
        (
            "OSError: nope/nope is not a local folder and is not a valid model identifier listed on",
            "model-not-found",
        ),
        ("OSError: m does not appear to have a file named config.json", "model-not-found"),
        ("requests.exceptions.HTTPError: 401 Client Error: Unauthorized for url", "model-not-found"),
        ("RuntimeError: Engine core initialization failed. See root cause above.", "engine-core-failed"),
    ],
)
def test_signature_gives_its_hint(log: str, key: str) -> None:
    text = f"INFO starting\n{log}\nINFO shutting down\n"
    assert hint_for(text) == _BY_KEY[key]


def test_specific_cause_wins_over_the_generic_engine_core_line() -> None:
    # vLLM prints the generic line *after* the real cause.
    log = "torch.OutOfMemoryError: CUDA out of memory\nRuntimeError: Engine core initialization failed.\n"
    assert hint_for(log) == _BY_KEY["oom"]


def test_unknown_log_has_no_hint() -> None:
    assert hint_for("INFO all good\nINFO Application startup complete.\n") is None
    assert hint_for("") is None


def test_every_hint_says_what_to_do() -> None:
    keys = [h.key for h in HINTS]
    assert len(keys) == len(set(keys))
    for h in HINTS:
        assert len(h.text) > 60, h.key
        assert any(w in h.text for w in ("check", "install", "raise", "lower", "download", "look", "pick")), h.key
