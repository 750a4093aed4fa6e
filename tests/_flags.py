"""`vllm serve` flag sets started on the simulator and on vLLM for CPU: does each start, and if not, how it refuses.

The one home of the flag-set differential (issue 26, item 5) for tests/test_start_refusals.py (a fixed sample)
and scripts/differential-flags.py (the generated sweep). A flag set is started on one engine with the tiny Llama;
:func:`outcome` records what a user sees: ``starts`` (``/health`` answers 200) or the exit status and the class of
the refusal (:func:`refusal_class`: which argparse argument, which config class's validation, or which exception).
Both engines must agree on the outcome, except for the differences listed in :data:`ACCEPTED` (docs/differential.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from _children import die_with_parent

NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'

#: The flags the plugin and vLLM's P/D scripts pass, each with values a user may give (valid and not).
#: ``None``: the bare flag.
FLAG_VALUES: dict[str, tuple[str | None, ...]] = {
    "--max-model-len": ("256", "512", "1k", "4096", "0", "x"),
    "--block-size": ("16", "128", "7", "x"),
    "--gpu-memory-utilization": ("0.5", "0.9", "1.5", "0", "x"),
    "--enforce-eager": (None,),
    "--max-num-seqs": ("1", "8", "0", "x"),
    "--max-num-batched-tokens": ("256", "2048", "x"),
    "--enable-prefix-caching": (None,),
    "--no-enable-prefix-caching": (None,),
    "--kv-transfer-config": (NIXL, '{"kv_connector":"NixlConnector","kv_role":"kv_nope"}',
                             '{"kv_connector":"NixlConnector"', '{"kv_connector":"BogusConnector","kv_role":"kv_both"}',
                             "[]"),
    "--attention-backend": ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "BOGUS_ATTN"),
    "--dtype": ("float32", "bfloat16", "half", "int8"),
    "--tensor-parallel-size": ("1", "2", "0"),
}  # fmt: skip

#: Flag sets whose outcome differs on purpose: (flag, value) -> why (docs/differential.md lists them too).
ACCEPTED: dict[tuple[str, str | None], str] = {}


def flags_strategy() -> Any:
    """Hypothesis strategy of flag sets: one to four flags of :data:`FLAG_VALUES`, each with one of its values."""
    from hypothesis import strategies as st

    def argv(chosen: dict[str, str | None]) -> list[str]:
        out: list[str] = []
        for flag, value in chosen.items():
            out += [flag] if value is None else [flag, value]
        return out

    flags = st.sampled_from(sorted(FLAG_VALUES))
    pairs = flags.flatmap(lambda f: st.tuples(st.just(f), st.sampled_from(FLAG_VALUES[f])))
    return st.lists(pairs, min_size=1, max_size=4, unique_by=lambda p: p[0]).map(lambda ps: argv(dict(ps)))


_ARGPARSE = re.compile(r"vllm serve: error: (argument [-\w/]+|unrecognized arguments)")
_VALIDATION = re.compile(r"\d+ validation errors? for (\w+)")
_EXCEPTION = re.compile(r"^(?:\(\w+ pid=\d+\) )?(\w+(?:Error|Exception)): ", re.M)


def refusal_class(output: str) -> str:
    """What kind of refusal ``output`` (a server's stdout + stderr) reports: ``argparse: argument --x``,
    ``validation: ModelConfig``, or the last exception's type (``ValueError``); ``unknown`` when none shows."""
    if match := _ARGPARSE.search(output):
        return f"argparse: {match.group(1)}"
    if match := _VALIDATION.search(output):
        return f"validation: {match.group(1)}"
    found = _EXCEPTION.findall(output)
    return found[-1] if found else "unknown"


def outcome(argv: Sequence[str], env: Mapping[str, str], port: int, timeout: float, log: Path) -> dict[str, Any]:
    """Start ``argv`` (``... serve MODEL --port PORT ...``) and return ``{"starts": True}`` once ``/health`` answers
    200 (the server is then stopped), or ``{"starts": False, "exit": status, "class": refusal_class(...)}`` when it
    exits first. :raises TimeoutError: neither within ``timeout`` seconds."""
    with log.open("wb") as out:
        proc = subprocess.Popen(list(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        with httpx.Client(timeout=2, trust_env=False) as client:  # timing: one probe of the polling loop below
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    text = log.read_text(errors="replace")
                    return {"starts": False, "exit": proc.returncode, "class": refusal_class(text)}
                try:
                    if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        return {"starts": True}
                except httpx.HTTPError:
                    pass
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5)
        raise TimeoutError(f"{' '.join(argv)} neither started nor exited in {timeout:g} s (log: {log})")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def accepted(flags: Sequence[str]) -> str | None:
    """Why a flag set's outcomes may differ (:data:`ACCEPTED`), or None."""
    for i, flag in enumerate(flags):
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
        if (flag, value) in ACCEPTED:
            return ACCEPTED[flag, value]
    return None


#: The flag sets tests/test_start_refusals.py runs on both engines in CI: refusals (cheap: vLLM refuses them while
#: parsing its arguments or building its config, before loading a model), one per kind of refusal. An unknown
#: attention backend is not here: tests/test_contract.py's test_unknown_attention_backend_fails_like_vllm refuses
#: one on both engines already (the same vLLM check, 25 s of a real start on 2 cores each time).
FIXED_SAMPLE: tuple[tuple[str, ...], ...] = (
    ("--dtype", "int8"),
    ("--kv-transfer-config", '{"kv_connector":"NixlConnector"'),
    ("--gpu-memory-utilization", "1.5"),
)
