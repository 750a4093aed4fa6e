"""Presets: the server configuration of each of vLLM's nixl_integration scripts, as a `ClusterSpec`.

Read from the scripts of vLLM 0.32.0/0.33.0/0.34.0 (``tests/v1/kv_connector/nixl_integration/run_*.sh``; 0.34.0's are
byte-identical to 0.33.0's): flags, env,
connector config, block size, lengths and memory. Each preset honours the environment variables its script
honours (``MAX_MODEL_LEN``, ``BLOCK_SIZE``, ``KV_CACHE_MEMORY_BYTES``, ``MODEL_NAMES``, ...); the ones that are
also pdserve session settings (``GPU_MEMORY_UTILIZATION``, ``ATTENTION_BACKEND``, ``VLLM_SERVE_EXTRA_ARGS``,
``PREFILL_GPU_ID``/``DECODE_GPU_ID``) are read by the settings layer, and an explicit session setting beats the
preset (see `session_spec.session_spec`). Where the engine cannot take the script's value (vLLM's CPU backend
takes only block sizes that are multiples of 32) the preset picks the nearest value that keeps the module's
preconditions and says so in a note, which the report header prints.

pytest-free: `resolve(name, spec_type=..., environ=..., engine=..., platform=...)` is a pure function of its
inputs. The spec class comes in as ``spec_type`` (`ClusterSpec`, or the class ``ClusterSpec.preset`` is called on),
so this module does not import spec.py, which calls it (no import cycle: tests/project/test_imports.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from pytest_pdserve.common.digits import parse_int
from pytest_pdserve.engines.cpu import fit_cpu_block_size
from pytest_pdserve.errors import ClusterSpecError
from pytest_pdserve.rules import connectors

if TYPE_CHECKING:  # the spec class is passed in (spec_type): spec.py's ClusterSpec.preset calls resolve()
    from pytest_pdserve.spec import ClusterSpec

__all__ = ["PRESETS", "Preset", "PresetResult", "preset_names", "resolve"]

#: The port vLLM's test_accuracy.py / test_spec_decode_acceptance.py hard-code for the proxy.
TOY_PROXY_PORT = 8192
#: The block size run_edge_case_test.sh ran at up to vLLM 0.33: it passes no ``--block-size`` and vLLM's default was 16
#: (``CacheConfig.DEFAULT_BLOCK_SIZE``). 0.34 made the default 64, at which test_edge_cases.py's PROMPT (fewer than 64
#: tokens) fills no block, so its "full prefix cache hit on the D worker" hits nothing and passes vacuously: the
#: preset keeps 16 on every version (docs/migrating.md).
VLLM_DEFAULT_BLOCK_SIZE = 16
#: max_position_embeddings of the tiny models tiny_model.py builds for real vLLM.
TINY_MODEL_MAX_LEN = 2048


@dataclass(frozen=True)
class PresetResult:
    """A resolved preset: the spec, the extra variables its module reads, and what was adapted (and why)."""

    spec: ClusterSpec
    #: Variables the module reads besides the ones every cluster exports (e.g. ``BLOCK_SIZE``, ``TEST_MODEL``).
    exports: Mapping[str, str] = field(default_factory=dict)
    #: One line per adaptation to this engine/platform, or per script knob not applied; for the report header.
    notes: tuple[str, ...] = ()
    #: Proxy port the module hard-codes (None: any leased port).
    proxy_port: int | None = None
    name: str = ""


@dataclass(frozen=True)
class Preset:
    name: str
    script: str
    module: str
    build: Callable[[type[ClusterSpec], Mapping[str, str], str, str], PresetResult]


def _int_env(environ: Mapping[str, str], var: str, default: int) -> int:
    raw = environ.get(var, "").strip()
    if not raw:
        return default
    try:
        value = parse_int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ClusterSpecError(
            f"${var}={raw!r} is not a whole number > 0 in digits 0-9 (read by the preset, as its script does)"
        )
    return value


#: ``MODEL_NAMES``' default in vLLM's scripts (vllm.md: run_multi_connector_edge_case_test.sh and others).
SCRIPT_MODEL = "Qwen/Qwen3-0.6B"


def _model(environ: Mapping[str, str], *vars_: str) -> str | None:
    """The model the script's env names (a single model string; the scripts loop over one model)."""
    for var in vars_:
        value = environ.get(var, "").strip()
        if value:
            return value
    return None  # the engine's test model (the tiny model on real vLLM, the simulator's names on sim)


def _block_size(wanted: int, engine: str, platform: str, source: str, notes: list[str]) -> int:
    if engine == "vllm" and platform == "cpu":
        fitted = fit_cpu_block_size(wanted)
        if fitted != wanted:
            notes.append(
                f"block size {fitted} instead of {source} {wanted}: vLLM's CPU backend takes only multiples of 32"
            )
        return fitted
    return wanted


def _env(values: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(values.items()))


def _buffer_device(engine: str, platform: str) -> dict[str, str]:
    # The scripts pass kv_buffer_device only when it is not "cuda"; on vLLM CPU NIXL takes only "cpu".
    return {"kv_buffer_device": "cpu"} if engine == "vllm" and platform == "cpu" else {}


def _edge_case(spec_type: type[ClusterSpec], environ: Mapping[str, str], engine: str, platform: str) -> PresetResult:
    notes: list[str] = []
    block = _block_size(VLLM_DEFAULT_BLOCK_SIZE, engine, platform, "vLLM's default", notes)
    spec = spec_type(
        name="vllm-edge-case", block_size=block, max_model_len=8192,
        gpu_memory_utilization=None if platform == "cpu" else 0.2,
    )  # fmt: skip
    return PresetResult(spec, {"BLOCK_SIZE": str(block)}, tuple(notes))


def _mamba(spec_type: type[ClusterSpec], environ: Mapping[str, str], engine: str, platform: str) -> PresetResult:
    notes: list[str] = []
    block = _block_size(128, engine, platform, "the script's", notes)
    backend = None
    if platform == "cuda" and not environ.get("ATTENTION_BACKEND", "").strip():
        backend = "FLASHINFER"  # the script's default; elsewhere FLASHINFER does not exist
    elif platform != "cuda":
        notes.append(f"attention backend: the script's default FLASHINFER is CUDA-only, not used on {platform}")
    # No --mamba-cache-mode: every version's own default is its script's mode (0.26: ``all`` for a hybrid with
    # prefix caching, as its script passes; 0.32: ``align``; 0.33 on: the flag is ignored) (rules/mamba.py).
    spec = spec_type.hybrid_ssm(
        name="vllm-mamba-prefix-cache", model=_model(environ, "MODEL"), block_size=block, max_model_len=16384,
        gpu_memory_utilization=None if platform == "cpu" else 0.8, attention_backend=backend,
    )  # fmt: skip
    return PresetResult(spec, {"BLOCK_SIZE": str(block)}, tuple(notes))


#: Why the MultiConnector presets cannot run on the CPU platform, on either engine (rules/connectors.py: vLLM for
#: CPU's engine fails at start, and the simulator follows it).
CPU_NO_OFFLOAD = (
    "vLLM's CPU platform has no OffloadingConnector CPU tier: the engine fails at start with "
    f"'{connectors.OFFLOAD_CPU_MESSAGE}' ({connectors.SOURCES['offload-cpu-platform']}), and the simulator on the "
    "CPU platform follows it"
)


def _check_offload(name: str, engine: str, platform: str) -> None:
    del engine  # the rule is the platform's, on both engines
    if platform == "cpu":
        raise ClusterSpecError(
            f"{name}: {CPU_NO_OFFLOAD}; run it on a GPU, or on the simulator's GPU platform (--pd-simulate-gpus=cuda:2)"
        )


def multi_connector_config(offload_bytes: int, nixl_extra: Mapping[str, str]) -> dict[str, Any]:
    """``kv_connector_extra_config`` of the scripts' MultiConnector: NixlConnector, then OffloadingConnector."""
    return {
        "connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", **nixl_extra},
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": offload_bytes},
            },
        ]
    }


#: run_multi_connector_edge_case_test.sh's ``KV_CACHE_MEMORY_BYTES`` default, sized for its model.
SCRIPT_KV_CACHE_BYTES = 268435456
#: KV bytes per token of the script's model (Qwen3-0.6B: 28 layers x 8 KV heads x 128 x K,V x bf16), so the
#: script's 256 MiB holds ~2,340 tokens and the module's 100 eviction prompts (~20,000 tokens) evict.
SCRIPT_MODEL_KV_BYTES_PER_TOKEN = 114688
#: The tiny Llama's KV bytes per token at float32 (2 layers x 2 KV heads x 32 x K,V x 4 bytes); at bfloat16,
#: which vLLM on a GPU picks for a float32 checkpoint, half that, so the same bytes hold twice the tokens.
TINY_MODEL_KV_BYTES_PER_TOKEN = 1024


def _tiny_kv_cache_bytes(block: int) -> int:
    """The tiny model's KV bytes for the tokens the script's 256 MiB give its own model, in whole blocks."""
    tokens = SCRIPT_KV_CACHE_BYTES // SCRIPT_MODEL_KV_BYTES_PER_TOKEN
    return -(-tokens // block) * block * TINY_MODEL_KV_BYTES_PER_TOKEN


def _multi_edge(spec_type: type[ClusterSpec], environ: Mapping[str, str], engine: str, platform: str) -> PresetResult:
    notes: list[str] = []
    block = _block_size(_int_env(environ, "BLOCK_SIZE", 128), engine, platform, "BLOCK_SIZE", notes)
    memory = _int_env(environ, "KV_CACHE_MEMORY_BYTES", SCRIPT_KV_CACHE_BYTES)
    if (
        engine == "vllm"
        and _model(environ, "MODEL_NAMES") is None
        and not environ.get("KV_CACHE_MEMORY_BYTES", "").strip()
    ):
        # On the tiny model the script's 256 MiB hold ~500,000 tokens: nothing would ever be evicted and
        # test_prefill_cpu_offload_after_gpu_eviction could not pass. Keep the script's token capacity instead.
        memory = _tiny_kv_cache_bytes(block)
        notes.append(
            f"KV cache {memory} bytes instead of the script's {SCRIPT_KV_CACHE_BYTES}: the tiny model's "
            f"{TINY_MODEL_KV_BYTES_PER_TOKEN} bytes per token (float32; half at bfloat16) hold the "
            f"{SCRIPT_KV_CACHE_BYTES // SCRIPT_MODEL_KV_BYTES_PER_TOKEN} tokens the script's model gets, so its "
            "eviction test evicts"
        )
    spec = spec_type(
        name="vllm-multi-connector-edge-case", block_size=block,
        # On the simulator, the script's own model: its KV bytes per token (114,688 for Qwen3-0.6B) make the
        # script's 256 MiB hold ~2,300 tokens, so the module's eviction tests evict (the tiny model never would).
        model=_model(environ, "MODEL_NAMES") or (SCRIPT_MODEL if engine == "sim" else None),
        max_model_len=_int_env(environ, "MAX_MODEL_LEN", 2048), kv_connector="MultiConnector",
        kv_connector_extra_config=json.dumps(multi_connector_config(2147483648, _buffer_device(engine, platform))),
        extra_args=("--kv-cache-memory-bytes", str(memory)),
        env=_env({"VLLM_KV_CACHE_LAYOUT": _layout(environ, notes), "UCX_NET_DEVICES": "all"}),
    )  # fmt: skip
    _check_offload("vllm-multi-connector-edge-case", engine, platform)  # after the env is read: its errors first
    return PresetResult(spec, {"BLOCK_SIZE": str(block)}, tuple(notes))


def _layout(environ: Mapping[str, str], notes: list[str]) -> str:
    """The MultiConnector scripts' ``VLLM_KV_CACHE_LAYOUT`` (LBHNC in vLLM 0.32/0.33's), or the caller's.

    vLLM 0.26.0 knows only NHD and HND (its engine refuses LBHNC at start: "Invalid value 'LBHNC' for
    VLLM_KV_CACHE_LAYOUT. Valid options: ['NHD', 'HND']", measured on an H200) and its own script sets HND, so
    an older vLLM's CI sets ``VLLM_KV_CACHE_LAYOUT=HND`` as it would for the script. Which release between 0.26
    and 0.32 first accepts LBHNC was not checked.
    """
    given = environ.get("VLLM_KV_CACHE_LAYOUT", "").strip()
    if given:
        notes.append(f"KV cache layout {given} from $VLLM_KV_CACHE_LAYOUT instead of the script's LBHNC")
    return given or "LBHNC"


def _multi_accuracy(
    spec_type: type[ClusterSpec], environ: Mapping[str, str], engine: str, platform: str
) -> PresetResult:
    notes: list[str] = []
    block = _block_size(_int_env(environ, "BLOCK_SIZE", 128), engine, platform, "BLOCK_SIZE", notes)
    device = environ.get("KV_BUFFER_DEVICE", "").strip() or "cuda"
    nixl_extra = _buffer_device(engine, platform) or ({} if device == "cuda" else {"kv_buffer_device": device})
    layout = environ.get("VLLM_KV_CACHE_LAYOUT", "").strip() or "LBHNC"  # the accuracy script reads it too
    model = _model(environ, "MODEL_NAMES")
    spec = spec_type(
        name="vllm-multi-connector-accuracy", model=model, block_size=block,
        max_model_len=_int_env(environ, "MAX_MODEL_LEN", 8192),
        gpu_memory_utilization=None if platform == "cpu" else 0.6, kv_connector="MultiConnector",
        kv_connector_extra_config=json.dumps(multi_connector_config(1000000000, nixl_extra)),
        env=_env({"VLLM_KV_CACHE_LAYOUT": layout, "UCX_NET_DEVICES": "all"}),
    )  # fmt: skip
    notes.append("one pass (layout " + layout + "); the script's second, cross-layer BLHNC pass is "
                 "VLLM_KV_CACHE_LAYOUT=BLHNC with the same preset")  # fmt: skip
    _check_offload("vllm-multi-connector-accuracy", engine, platform)  # after the env is read: its errors first
    return PresetResult(spec, {}, tuple(notes), proxy_port=TOY_PROXY_PORT)


def _accuracy(spec_type: type[ClusterSpec], environ: Mapping[str, str], engine: str, platform: str) -> PresetResult:
    notes: list[str] = []
    p_block = _int_env(environ, "PREFILL_BLOCK_SIZE", 128)
    d_block = _int_env(environ, "DECODE_BLOCK_SIZE", 128)
    if p_block != d_block:
        raise ClusterSpecError(
            f"$PREFILL_BLOCK_SIZE={p_block} and $DECODE_BLOCK_SIZE={d_block} differ: pdserve runs one block size "
            "for prefill and decode"
        )
    block = _block_size(p_block, engine, platform, "PREFILL_BLOCK_SIZE", notes)
    for var in ("DP_EP", "KV_CONNECTOR"):
        value = environ.get(var, "").strip()
        if value and not (var == "KV_CONNECTOR" and value == "NixlConnector"):
            raise ClusterSpecError(f"${var}={value!r}: the vllm-accuracy preset does not support it yet")
    if _int_env(environ, "PREFILLER_PP_SIZE", 1) > 1:
        raise ClusterSpecError("$PREFILLER_PP_SIZE > 1 needs NixlPushConnector, which pdserve does not start")
    layouts: dict[str, dict[str, str]] = {}
    for role, var in (("prefill", "PREFILLER_KV_LAYOUT"), ("decode", "DECODER_KV_LAYOUT")):
        # ``${VAR-HND}`` in the script: unset -> HND, set to empty -> no layout variable at all.
        value = environ.get(var, "HND").strip()
        if value == "NHD":
            raise ClusterSpecError(f"${var}=NHD (enable_permute_local_kv) is not supported by the preset yet")
        layouts[role] = {"VLLM_KV_CACHE_LAYOUT": value} if value else {}
    extra: tuple[str, ...] = ()
    exports: dict[str, str] = {}
    if environ.get("SLEEP_WAKE", "0").strip() == "1":
        extra = ("--enable-sleep-mode",)
        exports["SLEEP_WAKE"] = "1"
    spec = spec_type(
        name="vllm-accuracy", model=_model(environ, "MODEL_NAMES"), block_size=block,
        num_prefill=_int_env(environ, "NUM_PREFILL_INSTANCES", 1),
        num_decode=_int_env(environ, "NUM_DECODE_INSTANCES", 1),
        prefill_tp=_int_env(environ, "PREFILLER_TP_SIZE", 1), decode_tp=_int_env(environ, "DECODER_TP_SIZE", 1),
        gpu_memory_utilization=None if platform == "cpu" else 0.2, extra_args=extra,
        prefill_env=_env({**layouts["prefill"], "UCX_NET_DEVICES": "all"}),
        decode_env=_env({**layouts["decode"], "UCX_NET_DEVICES": "all"}),
    )  # fmt: skip
    if environ.get("ENFORCE_EAGER", "1").strip() == "0":
        notes.append("ENFORCE_EAGER=0: use --no-pd-enforce-eager (a session setting)")
    return PresetResult(spec, exports, tuple(notes), proxy_port=TOY_PROXY_PORT)


def _xpu_disagg(spec_type: type[ClusterSpec], environ: Mapping[str, str], engine: str, platform: str) -> PresetResult:
    notes: list[str] = []
    block = _block_size(_int_env(environ, "BLOCK_SIZE", 64), engine, platform, "BLOCK_SIZE", notes)
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "200"}  # fmt: skip
    if platform == "cpu" and engine == "vllm":
        # The script spawns because XPU needs it; on CPU pdserve forks EngineCore and the worker (cpu.py), which
        # starts a server in 19 s instead of 50 s on 2 cores and serves alike (docs/vllm-cpu.md, "The start method").
        del env["VLLM_WORKER_MULTIPROC_METHOD"]
        notes.append("start method fork (pdserve's CPU start) instead of the script's spawn, which XPU needs")
    # float16 as the script asks, except on the CPU backend, where pdserve runs float32 (cpu.cpu_server_args).
    extra = ("--dtype", "float16") if platform != "cpu" else ()
    if platform == "cpu" and engine == "vllm":
        notes.append("dtype float32 (pdserve's CPU dtype) instead of the script's float16")
    spec = spec_type(
        name="vllm-xpu-disagg", model=_model(environ, "MODEL_NAME"), block_size=block,
        max_model_len=_int_env(environ, "MAX_MODEL_LEN", 1024),
        prefill_tp=_int_env(environ, "PREFILLER_TP_SIZE", 1), decode_tp=_int_env(environ, "DECODER_TP_SIZE", 1),
        gpu_memory_utilization=None if platform == "cpu" else 0.8, extra_args=extra, env=_env(env),
        kv_buffer_device="xpu" if platform == "xpu" else None,
    )  # fmt: skip
    return PresetResult(spec, {}, tuple(notes))


PRESETS: Mapping[str, Preset] = {
    p.name: p
    for p in (
        Preset("vllm-edge-case", "run_edge_case_test.sh", "test_edge_cases.py", _edge_case),
        Preset("vllm-mamba-prefix-cache", "run_mamba_prefix_cache_test.sh", "test_mamba_prefix_cache.py", _mamba),
        Preset("vllm-multi-connector-edge-case", "run_multi_connector_edge_case_test.sh",
               "test_multi_connector_edge_cases.py", _multi_edge),
        Preset("vllm-multi-connector-accuracy", "run_multi_connector_accuracy_test.sh", "test_accuracy.py",
               _multi_accuracy),
        Preset("vllm-accuracy", "run_accuracy_test.sh", "test_accuracy.py", _accuracy),
        Preset("vllm-xpu-disagg", "run_xpu_disagg_accuracy_test.sh", "test_disagg_accuracy.py", _xpu_disagg),
    )
}  # fmt: skip


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def resolve(
    name: str,
    *,
    spec_type: type[ClusterSpec],
    environ: Mapping[str, str] | None = None,
    engine: str = "sim",
    platform: str = "cpu",
    **overrides: Any,
) -> PresetResult:
    """The preset ``name`` for ``engine`` ("vllm"/"sim") on ``platform``, with ``overrides`` applied to its spec.

    :raises ClusterSpecError: unknown name, or an env value the preset reads is invalid.
    """
    preset = PRESETS.get(name)
    if preset is None:
        raise ClusterSpecError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    result = preset.build(spec_type, os.environ if environ is None else environ, engine, platform)
    if overrides:
        result = replace(result, spec=result.spec.with_(**overrides))
    spec = result.spec
    if spec.model is None and (spec.max_model_len or 0) > TINY_MODEL_MAX_LEN:
        # The scripts' lengths are for real models; pdserve's tiny model declares 2048 positions, and vLLM (and the
        # simulator, which refuses what vLLM refuses) refuses a longer --max-model-len unless told (the tiny
        # model's rotary embedding has no real limit).
        env = {**dict(spec.env), "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
        result = PresetResult(
            spec.with_(env=env), result.exports,
            (*result.notes, f"max model len {spec.max_model_len} on the tiny model (declares {TINY_MODEL_MAX_LEN}): "
             "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"),
            result.proxy_port,
        )  # fmt: skip
    return replace(result, name=name)


#: ``--pd-preset auto``: the preset of the script that runs each module (test_accuracy.py: run_accuracy_test.sh,
#: the general harness; its MultiConnector variant is vllm-multi-connector-accuracy, named explicitly).
AUTO = {
    "test_edge_cases.py": "vllm-edge-case",
    "test_mamba_prefix_cache.py": "vllm-mamba-prefix-cache",
    "test_multi_connector_edge_cases.py": "vllm-multi-connector-edge-case",
    "test_accuracy.py": "vllm-accuracy",
    "test_disagg_accuracy.py": "vllm-xpu-disagg",
}


#: A directory given to ``--pd-preset auto`` is searched this many entries deep at most (a vLLM checkout has ~5,000).
AUTO_SCAN_LIMIT = 50_000
_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "build", "dist", "site-packages"})


def _modules_under(directory: Path) -> list[str]:
    """The names of :data:`AUTO`'s modules under *directory* (what pytest would collect there; hidden and
    build directories skipped, at most :data:`AUTO_SCAN_LIMIT` entries looked at)."""
    found: list[str] = []
    seen = 0
    for _top, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
        found += [f for f in files if f in AUTO]
        seen += len(dirs) + len(files)
        if seen > AUTO_SCAN_LIMIT:
            break
    return found


def auto_preset(paths: Sequence[str], base: Path | None = None) -> str | None:
    """The one preset the given test paths' modules need (``--pd-preset auto``); None when none is known.

    A path that is a directory (relative ones under *base*, when given) stands for the modules in it, as
    for pytest: ``pytest --pd-preset auto`` inside vLLM's nixl_integration directory finds its modules.

    :raises ClusterSpecError: the modules need different presets (one session has one cluster).
    """
    wanted = {}
    for path in paths:
        given = path.split("::", 1)[0]
        names = [PurePath(given).name]
        if base is not None and (directory := base / given).is_dir():
            names = _modules_under(directory)
        for name in names:
            if name in AUTO:
                wanted[AUTO[name]] = name
    if len(wanted) > 1:
        raise ClusterSpecError(
            "--pd-preset auto: the modules need different presets ("
            + ", ".join(f"{m}: {p}" for p, m in sorted(wanted.items()))
            + "); run one pytest command per module"
        )
    return next(iter(wanted), None)


def describe_config(spec: ClusterSpec) -> str:
    """The connector part of a spec, for the header (``MultiConnector[NixlConnector, OffloadingConnector]``)."""
    extra = spec.extra_config() or {}
    children = extra.get("connectors") if spec.kv_connector == "MultiConnector" else None
    if isinstance(children, list):
        return f"{spec.kv_connector}[{', '.join(str(c.get('kv_connector')) for c in children)}]"
    return spec.kv_connector if not extra else f"{spec.kv_connector} {json.dumps(extra, sort_keys=True)}"
