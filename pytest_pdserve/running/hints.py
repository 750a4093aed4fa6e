"""Known failure signatures in a server log, mapped to a hint that says what to do.

:func:`hint_for` is used by :mod:`pytest_pdserve.running.process` when a server exits early or times out,
so the error a user sees starts with the likely cause instead of 50 lines of traceback.

Signatures are checked in order and the first match wins. Specific causes (port, OOM, NIXL, model)
come before the generic "engine core failed to start", because vLLM prints that generic line
*after* the real cause.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["AUTH_HINT", "HINTS", "Hint", "hint_for", "lead_with_root_cause", "root_cause"]

#: For a 401/403 during readiness (process.py); names the setting as the settings table derives it
#: (tests/running/test_hints.py checks it against `settings.remedy("api_key")`).
AUTH_HINT = (
    "the server wants an API key that pdserve did not send, or a different one: set it with "
    "--pd-api-key / PDSERVE_API_KEY / pdserve_api_key (servers get it as VLLM_API_KEY); not with --api-key in "
    "the extra args, nor VLLM_API_KEY in ClusterSpec.env"
)


@dataclass(frozen=True)
class Hint:
    """One known failure signature.

    :param key: short stable id (``port-in-use``, ``oom``...), for tests and logs.
    :param pattern: regex searched in the log text (case-sensitive, multiline).
    :param text: the advice shown to the user.
    """

    key: str
    pattern: re.Pattern[str]
    text: str


def _h(key: str, pattern: str, text: str) -> Hint:
    return Hint(key, re.compile(pattern, re.MULTILINE), text)


#: Checked in this order; the first match wins.
HINTS: tuple[Hint, ...] = (
    _h(
        "sigill",
        r"died unexpectedly \(exit code: -4\)|Illegal instruction",
        "a vLLM process died of SIGILL: it ran a CPU instruction this machine does not allow. On CPU hosts with "
        "AMX, vLLM's bfloat16 attention does so without asking Linux for AMX first; pytest-pdserve serves CPU "
        "clusters in float32 (pytest_pdserve/engines/cpu.py) and its vllm-nixl-cpu-tweaks plugin asks for AMX: check "
        "that the plugin is installed in vLLM's environment and that no --dtype bfloat16 is in the extra args",
    ),
    _h(
        "kv-lease-expired",
        r"Releasing expired KV blocks for request .* before lease expired",
        "a prefill server freed a request's KV blocks before decode pulled them (kv_lease_duration in "
        "kv_connector_extra_config, 30 s by default, ran out), so decode failed the request with HTTP 500 "
        "(kv_load_failure_policy=fail). On a CPU host, check that vllm-nixl-cpu-tweaks is installed in vLLM's "
        "environment and VLLM_NIXL_CPU_PIN_KV_CORE is not 1 (vLLM's NIXL worker otherwise pins every server to one "
        "core, docs/vllm-cpu.md); on a loaded host raise kv_lease_duration with --pd-kv-connector-config",
    ),
    _h(
        "port-in-use",
        r"Address already in use|EADDRINUSE|\[Errno 98\]",
        "a port the server needs is taken (HTTP port, VLLM_PORT window or NIXL side channel): a previous "
        "server may still be running (check `ss -ltnp`), or another service holds the port. pdserve leases "
        "its ports; if you pinned ports yourself, pick free ones",
    ),
    _h(
        "oom",
        r"CUDA out of memory|HIP out of memory|OutOfMemoryError|Free memory on device",
        "the GPU ran out of memory: another process may still hold GPU memory (check `nvidia-smi` / "
        "`amd-smi`), or lower --pd-gpu-memory-utilization / --pd-max-model-len, or use a smaller model",
    ),
    _h(
        "nixl-missing",
        r"NIXL is not available|No module named '?nixl",
        "NIXL is not installed in the Python environment that runs `vllm serve`: install it (e.g. "
        "`pip install nixl`, matching your CUDA version; see vLLM's requirements/kv_connectors.txt), or "
        "point --pd-vllm-executable at an environment that has it",
    ),
    _h(
        "unknown-attention-backend",
        r"Unknown attention backend|Invalid attention backend|not a valid AttentionBackendEnum",
        "the attention backend name is not known to this vLLM version: check --attention-backend / "
        "$ATTENTION_BACKEND (names are upper case, e.g. FLASH_ATTN, TRITON_ATTN, FLASHINFER) and that "
        "prefill and decode use the same backend",
    ),
    _h(
        "model-not-found",
        r"Repo id must be|does not appear to have a file named|is not a local folder and is not a valid "
        r"model identifier|RepositoryNotFoundError|GatedRepoError|401 Client Error|404 Client Error|"
        r"Repository Not Found|Cannot access gated repo",
        "the model could not be loaded: check --pd-model / $PDSERVE_MODEL is a valid Hugging Face repo id "
        "or a local directory with config.json and weights; for gated repos set HF_TOKEN; offline runs need "
        "the model in the HF cache (HF_HUB_OFFLINE=1 only works with a pre-downloaded model)",
    ),
    _h(
        "hf-offline",
        r"We couldn't connect to 'https://huggingface.co'|LocalEntryNotFoundError|offline mode is enabled",
        "the model is not in the local Hugging Face cache and the hub cannot be reached: download it once "
        "(`huggingface-cli download MODEL`) or point --pd-model at a local directory",
    ),
    _h(
        "engine-core-failed",
        r"Engine core initialization failed|EngineCore failed to start|Engine process failed to start",
        "vLLM's engine core died during startup; the real cause is usually a few lines above this message in "
        "the log (look for the first Traceback). Common causes: GPU memory, an unsupported model or "
        "attention backend, or a missing KV connector dependency",
    ),
)


def hint_for(log_text: str) -> str | None:
    """Return the advice for the first known failure signature found in ``log_text``, or None.

    :param log_text: server log text (typically the tail, but any amount works).
    """
    for hint in HINTS:
        if hint.pattern.search(log_text):
            return hint.text
    return None


#: One exception line as vLLM's processes print it: bare, or behind a process tag (``(Worker pid=7)``) and a log
#: prefix (``ERROR 12-06 03:28:56 [multiproc_executor.py:1063]``). The name ends in Error or Exception.
_EXCEPTION_LINE = re.compile(
    r"^(?:\(\w+ pid=\d+\) )?(?:(?:ERROR|CRITICAL|WARNING|INFO|DEBUG) \S+ \S+ \[[^\]]*\] )?"
    r"(?P<line>(?:[A-Za-z_][\w]*\.)*(?P<name>\w*(?:Error|Exception)): .*\S)\s*$"
)
_FRAME_LINE = re.compile(r'File "(?P<path>[^"]+)", line (?P<lineno>\d+), in (?P<fn>\S+)')
#: How many distinct exception lines the root cause shows (vLLM chains three or four: the worker's, the engine
#: core's, the API server's).
ROOT_CAUSE_LINES = 4


def _short_path(path: str) -> str:
    """``vllm/v1/kv_offload/cpu/spec.py`` for a path inside site-packages; the path itself otherwise."""
    head, sep, tail = path.rpartition("site-packages/")
    return tail if sep else path


def root_cause(log_text: str) -> str:
    """vLLM's root cause in a log: its last distinct exception lines (at most :data:`ROOT_CAUSE_LINES`, first to last,
    without their process tags and log prefixes), the first with the last traceback frame above it; "" when the
    log holds none. Warnings (a dying vLLM prints leak warnings last) are not exceptions."""
    lines = log_text.splitlines()
    firsts: dict[str, int] = {}
    for i, raw in enumerate(lines):
        match = _EXCEPTION_LINE.match(raw)
        if match is None or match.group("name") == "KeyboardInterrupt":
            continue
        text = match.group("line")
        if match.group("name") == "ValidationError":  # pydantic words the error on the lines below
            body = [s.strip() for s in lines[i + 1 : i + 3] if s.startswith("  ") and not s.lstrip().startswith("File")]
            text = " / ".join([text, *body])
        firsts.pop(text, None)  # ordered by last occurrence: the last failure's lines come last
        firsts[text] = i
    if not firsts:
        return ""
    chosen = list(firsts.items())[-ROOT_CAUSE_LINES:]
    chosen.sort(key=lambda item: item[1])
    out = ["vLLM's root cause (its last errors, first to last):"]
    for n, (text, index) in enumerate(chosen):
        out.append(f"  {text}")
        if n == 0:
            frame = next((m for m in map(_FRAME_LINE.search, reversed(lines[max(0, index - 40) : index])) if m), None)
            if frame is not None:
                out.append(f"    (at {_short_path(frame['path'])}:{frame['lineno']}, in {frame['fn']})")
    return "\n".join(out)


def lead_with_root_cause(log_text: str, tail: str) -> str:
    """``tail`` (the log's last lines) led by the log's :func:`root_cause`, when it has one."""
    cause = root_cause(log_text)
    if not cause:
        return tail
    return f"{cause}\n--- the log's last lines ---\n{tail}"
