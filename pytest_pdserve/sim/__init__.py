"""pdserve-sim: a vLLM 0.34 stand-in for machines without GPUs or vLLM, and a fault injector.

Run it exactly like ``vllm serve``::

    pdserve-sim serve MODEL --port 8100 --kv-transfer-config '{"kv_connector":"NixlConnector",...}'
    python -m pytest_pdserve.sim serve MODEL ...

It speaks vLLM's HTTP interface (``/health``, ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, ``/tokenize``, ``/detokenize``, ``/metrics``, ``/version``, and in dev mode
``/reset_prefix_cache``, ``/reset_mm_cache``, ``/reset_encoder_cache``, ``/sleep``, ``/wake_up``,
``/is_sleeping``, ``/pause``, ``/resume``, ``/is_paused``, ``/weight_info``, ``/update_weight_version``), keeps a
block-granular prefix cache with vLLM's arithmetic, exports vLLM's metric names, and performs real
P/D (NixlConnector pull mode) KV transfers between two processes over a TCP side channel. Its answers are computed
from the KV a request really used (``kvcontent``): a decode that received KV computed with other weights
(``--hf-overrides``), or blocks of another prompt, answers differently, as vLLM does.

Modules: ``cli`` (argv, stdlib only), ``faults`` (environment knobs, orphan workers, hang),
``tokenizer`` (synthetic tokenizer and model), ``kvcontent`` (what the KV cache holds),
``engine`` (prefix cache, leases, pulls, generation),
``kvtransfer`` (side channel), ``metrics`` (Prometheus families), ``app`` (starlette routes),
``server`` (process lifecycle).

Environment knobs (read once at startup; a bad value exits with status 2 and names the variable):

=====================================  ==========  =========================================================
variable                               default     effect
=====================================  ==========  =========================================================
VLLM_NIXL_SIDE_CHANNEL_HOST            localhost   side-channel bind host, advertised as ``remote_host``
VLLM_NIXL_SIDE_CHANNEL_PORT            5600        side-channel port (+ DP index 0), ``remote_port``
VLLM_SERVER_DEV_MODE                   0           1: ``/reset_prefix_cache``, the sleep, pause and weight-version
                                                   routes exist (else 404)
VLLM_HTTP_TIMEOUT_KEEP_ALIVE           5           seconds an idle HTTP connection is kept open (as vLLM)
VLLM_ALLOW_RUNTIME_LORA_UPDATING       0           1/true: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
                                                   exist; a loaded adapter is listed by ``/v1/models`` and
                                                   served under its name (as the base model: no weights)
PDSERVE_SIM_STARTUP_DELAY              0           seconds of "model loading" before the API serves
PDSERVE_SIM_CRASH_AT_STARTUP           unset       print this text to stderr and exit at startup
PDSERVE_SIM_CRASH_EXIT_CODE            1           exit status for PDSERVE_SIM_CRASH_AT_STARTUP (1..255)
PDSERVE_SIM_CRASH_AFTER_REQUESTS       unset       N: after N completion requests the engine dies
                                                   (EngineDeadError in the log, /health 503, exit 1)
PDSERVE_SIM_ENGINE_DIES_ON_REQUEST     unset       N: the engine dies DURING the Nth completion request, as
                                                   a vLLM worker crash does (``Worker proc VllmWorker-0 died
                                                   unexpectedly (exit code: -4)``, HTTP 500, /health 503,
                                                   exit 1)
PDSERVE_SIM_DEAD_EXIT_DELAY            1           seconds a dead engine's server keeps answering (/health 503,
                                                   requests 500) before it exits, as vLLM's shuts down
PDSERVE_SIM_HANG                       0           1: bind + listen on --port, never accept or answer
PDSERVE_SIM_IGNORE_SIGTERM             0           1: SIGTERM is ignored (only SIGKILL stops it)
PDSERVE_SIM_SPAWN_WORKERS              0           N: start N detached (setsid) sleepers named
                                                   ``VLLM::EngineCore`` / ``VLLM::Worker`` (prctl);
                                                   killed on a graceful exit, orphaned when the server
                                                   is SIGKILLed
PDSERVE_SIM_FAIL_KV_PULL               0           1: this (decode) server's KV pulls fail after the handshake
PDSERVE_SIM_KV_DROP_BLOCKS             0           N: the last N blocks of each of this (decode) server's pulls
                                                   never arrive while the transfer reports success; their KV
                                                   is what those blocks held before (a partial delivery)
PDSERVE_SIM_CONTEXT_BLIND              0           1: answers depend on the prompt's last 8 tokens only, like a tiny
                                                   model at Hugging Face's default init: a changed beginning or
                                                   a wrong KV moves nothing (assert_kv_faithful's precondition)
PDSERVE_SIM_NONDETERMINISTIC_BACKENDS  (none)      comma list of backends that are not batch-invariant
PDSERVE_SIM_NONDETERMINISM_RATE        1.0         share of warm-prefix-cache requests (decided per prompt)
                                                   whose output differs from the cold output on those backends
PDSERVE_SIM_TIE_FLIP                   0           1: that difference is a tie flip (top-1/top-2 gap 0.001
                                                   nats, the runner-up chosen) instead of a confident flip
PDSERVE_SIM_OVERRIDE_BLOCK_SIZE        unset       N: serve block size N whatever --block-size says (silently,
                                                   like a misconfigured server)
PDSERVE_SIM_KV_CONNECTOR_OFF           0           1: ignore --kv-transfer-config (log "Disabling KVTransfer")
PDSERVE_SIM_GPU                        0           1: import torch, hold a 16 MiB tensor on cuda:0, report the
                                                   device UUID/name in ``/version`` (platform cuda)
PDSERVE_SIM_PLATFORM                   cpu         cpu, cuda or rocm: the simulated platform (cuda with
                                                   PDSERVE_SIM_GPU=1); pytest passes the session's. On cpu
                                                   any --attention-backend runs CPU_ATTN, as on vLLM for CPU
VLLM_KV_CACHE_LAYOUT                   LBHNC       the KV cache layout registered with NIXL (NHD, HND: vLLM's
                                                   aliases of LBNHC, LBHNC); a P/D pair whose layouts differ
                                                   fails the handshake, as in vLLM
VLLM_ALLOW_LONG_MAX_MODEL_LEN          0           1/true: --max-model-len may exceed the model's
                                                   max_position_embeddings (else refused at start, as vLLM does)
PDSERVE_SIM_VLLM_VERSION               0.34.0      the vLLM version reported and followed (``rules/``:
                                                   >= 0.32 lowers max_tokens to fit, older reserves it; default
                                                   --block-size 64 from 0.34, 16 before; ...)
=====================================  ==========  =========================================================

The model: MODEL as a local checkpoint directory (its ``config.json`` sizes the KV cache; its ``tokenizer.json``, or
``--tokenizer DIR``, is the tokenizer, through the optional ``tokenizers`` package: without it such a server refuses
to start, ``pip install tokenizers``), a known name such as ``Qwen/Qwen3-0.6B``, or anything else (the tiny Llama's
shape and the built-in tokenizer, which splits digits like Llama 3 / Qwen). Connectors: NixlConnector (pull),
OffloadingConnector (CPU tier, on a simulated GPU platform) and a MultiConnector of those; any other connector is
refused at startup.

On the simulated CPU platform the backend is ``CPU_ATTN`` whatever ``--attention-backend`` says (vLLM's CPU
rule), which is deterministic. On cuda (an H200) and rocm (an MI300 with AITER) the backend follows vLLM's
selection for the model's head size and serving dtype (``sim/attention.py``): an asked backend that is not valid
(``FLASH_ATTN`` or ``FLASHINFER`` in float32, ``FLASHINFER`` with heads of 32, ``ROCM_ATTN`` with a KV connector)
exits 1 with vLLM's "Selected backend ... is not valid for this configuration"; ``auto`` runs the platform's first
valid one (cuda: ``FLASH_ATTN``, else ``FLASHINFER``, ``TRITON_ATTN``; rocm: ``ROCM_ATTN``, or
``ROCM_AITER_UNIFIED_ATTN`` with a KV connector, else ``TRITON_ATTN``). vLLM's start
refusals are the simulator's too: a ``--max-model-len`` above the model's and a KV cache too small for one
request of ``--max-model-len`` tokens exit 1 with vLLM's message, and so do values vLLM's config classes refuse
(``--gpu-memory-utilization`` outside (0, 1], ``--block-size 0``, parallel sizes or ``--max-num-seqs`` below 1:
pydantic's ``ValidationError`` for ``CacheConfig``, ``ParallelConfig``, ``SchedulerConfig``) and an unknown KV
connector (``VllmConfig``) (``sim/start_rules.py``). The start rules the plugin also checks before a start
(``pytest_pdserve/rules/``) apply for the version it reports and its platform: a MultiConnector child without
``kv_role``, NIXL's buffer device, the OffloadingConnector and ``VLLM_KV_CACHE_LAYOUT`` on the CPU platform
(``HND`` runs as ``LBHNC``), ``--mamba-cache-mode`` by version; and on the CPU platform a hybrid prefill of more
than one block with prefix caching kills the engine under the request, as vLLM for CPU's Mamba kernel does.
"""

from __future__ import annotations


def environment_table() -> str:
    """The environment-variable table above, as plain text (``serve --help`` prints it)."""
    lines = (__doc__ or "").splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith("=====")]
    return "\n".join(line.replace("``", "") for line in lines[marks[0] : marks[-1] + 1]) if len(marks) >= 3 else ""
