"""What vLLM accepts at start, one module per rule, consulted by both doors: the plugin before it starts a server
(`config/acceptance.py`) and the simulator at its start (`sim/server.py`). [stdlib]

Each rule names the vLLM source lines it follows, per version (tables keyed by release: `versions.py`):

* `connectors.py`: ``--kv-transfer-config``, nested MultiConnector children included (registered names, fields,
  ``kv_role``, NixlConnector's ``transfer_mode``, NIXL's KV buffer device per platform, the OffloadingConnector's
  CPU tier per platform);
* `kv_layout.py`: ``VLLM_KV_CACHE_LAYOUT`` (choices and aliases per version, the layouts each backend takes);
* `conv_state.py`: ``VLLM_SSM_CONV_STATE_LAYOUT`` (a hybrid model under NixlConnector needs ``DS``);
* `block_size.py`: the block size run without ``--block-size``, per version and backend;
* `mamba.py`: ``--mamba-cache-mode`` (choices and the mode run, per version) and vLLM for CPU's Mamba prefill limit;
* `start.py`: all of them for one server (`check_server`), in vLLM's order.

And what the simulator follows under requests, per version: `length.py` (``max_tokens`` against
``max_model_len``), `nixl_params.py` (what a prefill's ``kv_transfer_params`` carry); `versions.py` names the
newest release read (:data:`~pytest_pdserve.rules.versions.DEFAULT_VLLM_VERSION`, the one the simulator reports).

A refusal (`verdict.Refusal`) carries vLLM's words and when vLLM says them (argparse, config, engine, request); a
replacement (`verdict.Replacement`) says what vLLM runs instead of what was asked. The standard library and the
CPU platform's constants (`engines/cpu.py`) only: the simulator imports this before anything heavy.
"""
