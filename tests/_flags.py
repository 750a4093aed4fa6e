"""`vllm serve` start sets run on the simulator and on vLLM for CPU: does each start, and if not, how it refuses.

The one home of the start differential (issue 26, item 5; issue 45) for tests/rules/test_start_refusals.py (a fixed
sample), tests/rules/test_start_outcomes.py (vLLM's recorded outcomes against the simulator) and
scripts/differential-flags.py (the generated sweep). A start set is flags, an environment (``VLLM_KV_CACHE_LAYOUT``)
and a tiny model kind (the hybrid NemotronH for ``--mamba-cache-mode``), with connector JSON shapes nested
MultiConnector children included (:data:`CONNECTOR_SHAPES`). It is started on one engine;
:func:`outcome` records what a user sees: ``starts`` (``/health`` answers 200) or the exit status and the class of
the refusal (:func:`refusal_class`: which argparse argument, which config class's validation, or which exception).
Both engines must agree on the outcome, except for the differences listed in :data:`ACCEPTED` (docs/differential.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _children import die_with_parent

NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


def _kv(config: dict[str, Any]) -> str:
    return json.dumps(config, separators=(",", ":"))


_NIXL_CPU = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
_OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 100000000}}  # fmt: skip


def _multi(*children: dict[str, Any]) -> str:
    return _kv({"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {"connectors": list(children)}})  # fmt: skip


#: ``--kv-transfer-config`` shapes, nested MultiConnector children included: what pytest_pdserve/rules/connectors.py
#: decides (a child's kv_role and fields, NIXL's buffer device on the platform, the OffloadingConnector's CPU tier).
CONNECTOR_SHAPES: dict[str, str] = {
    "nixl": NIXL,
    "nixl-buffer-cuda": _kv({"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cuda"}),
    "multi-child-no-role": _multi({"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}),
    "multi-child-buffer-default": _multi({"kv_connector": "NixlConnector", "kv_role": "kv_both"}),
    "multi-child-unknown-key": _multi({**_NIXL_CPU, "bogus_key": 1}),
    "multi-child-bad-role": _multi({**_NIXL_CPU, "kv_role": "kv_nope"}),
    "multi-offload": _multi(_NIXL_CPU, _OFFLOAD),
    "multi-unknown-child": _multi(_NIXL_CPU, {"kv_connector": "BogusConnector", "kv_role": "kv_both"}),
}

#: The flags the plugin and vLLM's P/D scripts pass, each with values a user may give (valid and not).
#: ``None``: the bare flag. ``--mamba-cache-mode`` makes a set run the hybrid model (:func:`model_kind`).
FLAG_VALUES: dict[str, tuple[str | None, ...]] = {
    "--max-model-len": ("256", "512", "1k", "4096", "0", "x"),
    "--block-size": ("16", "128", "7", "x"),
    "--gpu-memory-utilization": ("0.5", "0.9", "1.5", "0", "x"),
    "--enforce-eager": (None,),
    "--max-num-seqs": ("1", "8", "0", "x"),
    "--max-num-batched-tokens": ("256", "2048", "x"),
    "--enable-prefix-caching": (None,),
    "--no-enable-prefix-caching": (None,),
    "--kv-transfer-config": (*CONNECTOR_SHAPES.values(), '{"kv_connector":"NixlConnector","kv_role":"kv_nope"}',
                             '{"kv_connector":"NixlConnector"', '{"kv_connector":"BogusConnector","kv_role":"kv_both"}',
                             "[]"),
    "--attention-backend": ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "BOGUS_ATTN"),
    "--dtype": ("float32", "bfloat16", "half", "int8"),
    "--tensor-parallel-size": ("1", "2", "0"),
    "--mamba-cache-mode": ("all", "align", "none"),
}  # fmt: skip

#: Environment variables a set may carry, with values (rules/kv_layout.py: choices, aliases, the CPU backend's one).
ENV_VALUES: dict[str, tuple[str, ...]] = {
    "VLLM_KV_CACHE_LAYOUT": ("NHD", "HND", "LBHNC", "BLHNC", "LBNHC", "XYZ", ""),
}


@dataclass(frozen=True)
class StartSet:
    """One start of the differential: flags, environment and the tiny model kind (``llama`` or ``nemotronh``)."""

    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    model: str = "llama"

    def describe(self) -> dict[str, Any]:
        return {"flags": list(self.flags), "env": dict(self.env), "model": self.model}


def model_kind(flags: Sequence[str], wanted: str = "llama") -> str:
    """The hybrid model for a set that gives ``--mamba-cache-mode``; else ``wanted``."""
    return "nemotronh" if "--mamba-cache-mode" in flags else wanted


#: Start sets whose outcome differs on purpose: a connector shape, an environment pair or a (flag, value) -> why
#: (docs/differential.md lists them too). The plugin refuses each before a start, on both engines.
ACCEPTED: dict[tuple[str, str | None], str] = {
    ("--kv-transfer-config", CONNECTOR_SHAPES["nixl-buffer-cuda"]): (
        "vLLM for CPU's API server hangs after its worker refuses the buffer device (measured: no exit in 600 s); "
        "the simulator exits 1 with the same root cause; the plugin refuses it before a start on both engines"
    ),
}


def flags_strategy() -> Any:
    """Hypothesis strategy of start sets: one to four flags of :data:`FLAG_VALUES`, each with one of its values, an
    optional environment pair of :data:`ENV_VALUES`, and the model kind (the hybrid one for ``--mamba-cache-mode``,
    else either)."""
    from hypothesis import strategies as st

    def argv(chosen: dict[str, str | None]) -> tuple[str, ...]:
        out: list[str] = []
        for flag, value in chosen.items():
            out += [flag] if value is None else [flag, value]
        return tuple(out)

    flags = st.sampled_from(sorted(FLAG_VALUES))
    pairs = flags.flatmap(lambda f: st.tuples(st.just(f), st.sampled_from(FLAG_VALUES[f])))
    flag_sets = st.lists(pairs, min_size=1, max_size=4, unique_by=lambda p: p[0]).map(lambda ps: argv(dict(ps)))
    envs = st.one_of(
        st.just(()),
        st.sampled_from(sorted(ENV_VALUES)).flatmap(lambda k: st.sampled_from(ENV_VALUES[k]).map(lambda v: ((k, v),))),
    )
    kinds = st.sampled_from(("llama", "nemotronh"))
    return st.builds(lambda f, e, k: StartSet(f, e, model_kind(f, k)), flag_sets, envs, kinds)


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


def accepted(start: StartSet | Sequence[str]) -> str | None:
    """Why a start set's outcomes may differ (:data:`ACCEPTED`: a flag and its value, or an environment pair), or
    None."""
    flags = start.flags if isinstance(start, StartSet) else tuple(start)
    env = start.env if isinstance(start, StartSet) else ()
    for i, flag in enumerate(flags):
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
        if (flag, value) in ACCEPTED:
            return ACCEPTED[flag, value]
    for pair in env:
        if pair in ACCEPTED:
            return ACCEPTED[pair]
    return None


#: What vLLM for CPU 0.32 did with start sets of the rules (scripts/differential-flags.py --cases; each entry: the
#: set and vLLM's outcome). tests/rules/test_start_outcomes.py starts each on the simulator and compares.
RECORDED = Path(__file__).resolve().parent / "data" / "vllm-cpu" / "start-outcomes.json"


def recorded(path: Path = RECORDED) -> list[tuple[StartSet, dict[str, Any]]]:
    """The recorded start sets and vLLM's outcome for each."""
    out = []
    for entry in json.loads(path.read_text())["sets"]:
        start = StartSet(tuple(entry["flags"]), tuple(sorted(entry["env"].items())), entry["model"])
        out.append((start, entry["vllm"]))
    return out


#: The flag sets tests/rules/test_start_refusals.py runs on both engines in CI: refusals (cheap: vLLM refuses them while
#: parsing its arguments or building its config, before loading a model), one per kind of refusal. An unknown
#: attention backend is not here: tests/sim/test_contract.py's test_unknown_attention_backend_fails_like_vllm refuses
#: one on both engines already (the same vLLM check, 25 s of a real start on 2 cores each time).
FIXED_SAMPLE: tuple[tuple[str, ...], ...] = (
    ("--dtype", "int8"),
    ("--kv-transfer-config", '{"kv_connector":"NixlConnector"'),
    ("--gpu-memory-utilization", "1.5"),
)
