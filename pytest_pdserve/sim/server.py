"""Process lifecycle of ``pdserve-sim serve``: startup faults, socket binding, engine, uvicorn, shutdown.

The order mirrors vLLM's: validate the config (an unknown attention backend fails here), bind the
API socket early (so "address already in use" fails fast), "load the model" (startup delay, GPU
tensor), start the engine and its NIXL side channel, then serve HTTP. Heavy modules (starlette,
uvicorn, prometheus_client; torch only in GPU mode) are imported by this module, which ``__main__``
imports only after the arguments parsed, so argparse errors stay instant.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

import pydantic
import uvicorn

from pytest_pdserve.common.rlimits import raise_nofile_limit
from pytest_pdserve.engines import cpu
from pytest_pdserve.rules import kv_layout, mamba
from pytest_pdserve.rules.block_size import default_block_size
from pytest_pdserve.rules.start import ServerFacts, Verdict, check_server
from pytest_pdserve.sim import attention, faults, kvtransfer, model, offload, start_rules, tokenizer
from pytest_pdserve.sim.app import AppState, build_app
from pytest_pdserve.sim.cli import PROG, SIMULATED_CONNECTORS, ServeArgs, resolve_attention_backend
from pytest_pdserve.sim.engine import Engine, kv_cache_bytes
from pytest_pdserve.sim.faults import SimEnv

logger = logging.getLogger("pytest_pdserve.sim")

GPU_TENSOR_MIB = 16

GRACEFUL_SHUTDOWN_S = 5
"""uvicorn's ``timeout_graceful_shutdown``: open connections (streams) get this long after SIGTERM."""

HARD_EXIT_AFTER_S = GRACEFUL_SHUTDOWN_S + 1.0
"""After SIGTERM the process exits by this deadline even if the event loop is stuck (the guard of issue 16):
below the plugin's SIGTERM-to-SIGKILL grace of ``min(shutdown_timeout, 10)`` s."""


def configure_logging() -> None:
    """vLLM-like log lines on stdout: ``INFO 11-29 10:00:00 [server.py:42] message``."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", datefmt="%m-%d %H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG if os.environ.get("VLLM_LOGGING_LEVEL") == "DEBUG" else logging.INFO)
    logger.propagate = False


def _startup_error(exc: BaseException) -> int:
    """Print an exception the way a dying vLLM does (traceback on stderr, after its cause's) and return exit
    status 1."""
    if exc.__cause__ is not None:
        print("Traceback (most recent call last):", file=sys.stderr)
        print("".join(traceback.format_exception_only(type(exc.__cause__), exc.__cause__)).rstrip(), file=sys.stderr)
        print("\nThe above exception was the direct cause of the following exception:\n", file=sys.stderr)
    print("Traceback (most recent call last):", file=sys.stderr)
    print("".join(traceback.format_exception_only(type(exc), exc)).rstrip(), file=sys.stderr, flush=True)
    return 1


def _verdict(args: ServeArgs, env: SimEnv, backend: str | None, hybrid: bool | None = None) -> Verdict:
    """vLLM's start rules (pytest_pdserve/rules/) on this server, as the plugin asks them before a start."""
    kv = args.kv_transfer_config
    return check_server(ServerFacts(
        version=env.vllm_version, platform=env.platform, kv_transfer_config=kv.raw if kv is not None else None,
        environ=os.environ, attention_backend=backend, hybrid=hybrid, mamba_cache_mode=args.mamba_cache_mode,
        prefix_caching=args.enable_prefix_caching, block_size=args.block_size,
    ))  # fmt: skip


def _refusal(verdict: Verdict, stages: tuple[str, ...]) -> int | None:
    """Exit as vLLM exits for the verdict's first refusal when it falls in ``stages``; None: no such refusal."""
    first = verdict.first
    if first is None or first.stage not in stages:
        return None
    if first.stage == "argparse":
        print(f"usage: {PROG} [model_tag] [options]", file=sys.stderr)
        print(first.describe(), file=sys.stderr, flush=True)
        return first.exit_status
    if first.validates is not None:  # raised while vLLM builds its VllmConfig: pydantic words it
        try:
            start_rules.refuse_in_config(first.message)
        except pydantic.ValidationError as exc:
            exc.__cause__ = ValueError(first.message)
            return _startup_error(exc)
    if first.stage == "engine":
        # The engine core prints its root cause; the API server then fails with vLLM's generic line.
        logger.error("EngineCore failed to start.")
        print(f"(EngineCore pid={os.getpid()}) {first.describe()}", file=sys.stderr)
        return _startup_error(RuntimeError("Engine core initialization failed. See root cause above. "
                                           "Failed core proc(s): {'EngineCore': 1}"))  # fmt: skip
    return _startup_error(ValueError(first.message))


def _bind(host: str | None, port: int) -> socket.socket:
    bind_host = "0.0.0.0" if host is None or host == "" else host
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when the listening socket says
    # it is TCP; without it a keep-alive JSON response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def _load_gpu() -> tuple[dict[str, Any], Any]:
    """GPU mode: hold a small tensor on cuda:0 and describe the device. :raises RuntimeError: no CUDA."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        raise RuntimeError(f"PDSERVE_SIM_GPU=1 needs torch with CUDA, but importing torch failed: {exc}") from None
    if not torch.cuda.is_available():
        raise RuntimeError(
            "PDSERVE_SIM_GPU=1 but torch.cuda.is_available() is False "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    tensor = torch.ones(GPU_TENSOR_MIB * 1024 * 256, dtype=torch.float32, device="cuda:0")
    props = torch.cuda.get_device_properties(0)
    uuid = str(props.uuid)
    info = {
        "uuid": uuid if uuid.startswith("GPU-") else f"GPU-{uuid}",
        "name": props.name,
        "total_memory": int(props.total_memory),
        "allocated_bytes": int(tensor.numel() * tensor.element_size()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch_version": str(torch.__version__),
    }
    return info, tensor


def serve(args: ServeArgs, env: SimEnv) -> int:
    """Run the simulator until shutdown; returns the process exit status."""
    configure_logging()
    raise_nofile_limit()  # as vLLM's set_ulimit does at start
    faults.install_default_signal_behaviour(env.ignore_sigterm)
    logger.info("vLLM API server version %s (pdserve-sim)", env.vllm_version)
    logger.info("non-default args: %s", dict(args.non_default))

    if env.crash_at_startup is not None:
        print(env.crash_at_startup, file=sys.stderr, flush=True)
        return env.crash_exit_code
    try:
        backend = resolve_attention_backend(args.attention_backend)
    except ValueError as exc:
        return _startup_error(exc)
    kv = args.kv_transfer_config
    # vLLM's start rules (pytest_pdserve/rules/), the ones the plugin checks before a start: argparse and config
    # refusals here, as vLLM says them; the engine's once the model is read (_serve_async).
    refused = _refusal(_verdict(args, env, backend), ("argparse", "config"))
    if refused is not None:
        return refused
    if kv is not None and kv.unsimulated():
        return _startup_error(
            ValueError(
                f"pdserve-sim does not simulate {', '.join(kv.unsimulated())} (in --kv-transfer-config); it simulates "
                f"{', '.join(sorted(SIMULATED_CONNECTORS))}, alone or inside a MultiConnector. Use real vLLM "
                "(--pd-engine vllm) for other connectors."
            )
        )
    if kv is not None and kv.offloading_extra_config is not None:
        try:
            offload.cpu_bytes_to_use(kv.offloading_extra_config)
        except offload.OffloadConfigError as exc:
            return _startup_error(exc)
    if kv is not None and kv.is_nixl and kv.kv_role == "kv_both":
        logger.warning(
            "Using kv_role='kv_both' with NixlConnector is deprecated. Please set "
            "kv_role='kv_producer' for prefill instances and kv_role='kv_consumer' for decode instances."
        )
    if args.mamba_cache_mode is not None and mamba.flag_ignored(env.vllm_version):
        logger.warning("%s", mamba.deprecation_warning(env.vllm_version))

    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        logger.error("%s", exc)
        return _startup_error(exc)

    if env.hang:
        logger.info("PDSERVE_SIM_HANG=1: listening on port %d without ever answering", args.port)
        faults.hang_forever(sock)
        return 0

    if env.startup_delay > 0:
        logger.info("Loading model weights (PDSERVE_SIM_STARTUP_DELAY=%.2f s)", env.startup_delay)
        time.sleep(env.startup_delay)

    gpu_info: dict[str, Any] | None = None
    gpu_tensor: Any = None
    if env.gpu:
        try:
            gpu_info, gpu_tensor = _load_gpu()
        except RuntimeError as exc:
            sock.close()
            return _startup_error(exc)
        logger.info(
            "GPU mode: holding %d bytes on %s (%s)",
            gpu_info["allocated_bytes"],
            gpu_info["uuid"],
            gpu_info["name"],
        )
    if env.platform == "cpu":
        running = cpu.running_attention_backend(backend)
        if backend is not None and backend != running:
            logger.info("Cannot use AttentionBackendEnum.%s backend on CPU.", backend)  # vLLM's words
        backend = running
        logger.info("Using %s attention backend.", backend)
    # On a simulated GPU the backend depends on the model's shape: chosen once the model is read (_serve_async).

    workers = faults.spawn_workers(env.spawn_workers)
    for proc, name in zip(workers, faults.worker_names(env.spawn_workers), strict=True):
        logger.info("Started %s process pid=%d (detached session)", name, proc.pid)
    try:
        return asyncio.run(_serve_async(args, env, backend, sock, gpu_info, [p.pid for p in workers]))
    finally:
        faults.stop_workers(workers)
        del gpu_tensor


async def _serve_async(
    args: ServeArgs,
    env: SimEnv,
    backend: str | None,
    sock: socket.socket,
    gpu_info: dict[str, Any] | None,
    worker_pids: list[int],
) -> int:
    exit_code = 0
    server: _SimServer | None = None

    def on_dead() -> None:
        nonlocal exit_code
        exit_code = 1

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        asyncio.get_running_loop().call_later(env.dead_exit_delay, stop)

    try:
        shape = model.resolve(args.model)
        long_len_warning = start_rules.check_max_model_len(args.max_model_len, shape, os.environ)
        start_rules.check_engine_config(args)
        tok = tokenizer.load(args.tokenizer, shape.directory)
    except (
        model.ModelConfigError,
        tokenizer.TokenizerError,
        start_rules.StartRefused,
        pydantic.ValidationError,
    ) as exc:
        sock.close()
        return _startup_error(exc)
    if long_len_warning is not None:
        logger.warning("%s", long_len_warning)
    if env.platform != "cpu":
        try:
            backend = attention.select(
                env.platform, backend, dtype=shape.serving_dtype(args.dtype), head_size=shape.head_dim,
                block_size=args.block_size if "block_size" in args.non_default else None,
                kv_connector=args.kv_transfer_config is not None,
            )  # fmt: skip
        except start_rules.StartRefused as exc:
            sock.close()
            return _startup_error(ValueError(str(exc)))  # vLLM's engine core raises a ValueError
        logger.info("Using %s attention backend.", backend)
    assert backend is not None  # the CPU platform's was set in serve()
    if "block_size" not in args.non_default:  # vLLM's default for its version and the backend it runs
        args = dataclasses.replace(args, block_size=default_block_size(env.vllm_version, backend))
    verdict = _verdict(args, env, backend, hybrid=shape.is_hybrid)
    refused = _refusal(verdict, ("engine",))
    if refused is not None:
        sock.close()
        return refused
    for replaced in verdict.replacements:
        logger.warning("%s", replaced.describe())
    layout = kv_layout.running(
        os.environ.get(kv_layout.VAR),
        version=env.vllm_version,
        backend=backend,
        nixl=args.kv_transfer_config is not None and args.kv_transfer_config.is_nixl,
    )
    if layout is not None:
        logger.info("Using %s KV cache layout.", layout)  # vLLM's resolve_kv_cache_layout says so
    if shape.is_hybrid:  # the mode vLLM runs (cache_config_info shows it), whatever the deprecated flag said
        mode = mamba.running_mode(
            args.mamba_cache_mode, prefix_caching=args.enable_prefix_caching, version=env.vllm_version
        )
        args = dataclasses.replace(args, mamba_cache_mode=mode)
    engine = Engine(args, env, backend, on_dead=on_dead, shape=shape, tok=tok)
    try:
        start_rules.check_kv_cache_fits(
            engine.max_model_len, engine.block_size, engine.bytes_per_block, engine.mamba_state_bytes,
            kv_cache_bytes(args),
        )  # fmt: skip
    except start_rules.StartRefused as exc:
        sock.close()
        return _startup_error(exc)
    logger.info("Model shape from %s; tokenizer: %s", shape.source, tok.name)
    logger.info(
        "KV cache: %d blocks of %d tokens (%d bytes per block, %d bytes per token)",
        engine.pool.num_blocks,
        engine.block_size,
        engine.bytes_per_block,
        engine.bytes_per_token,
    )
    side_channel = None
    if engine.nixl:
        try:
            side_channel = await kvtransfer.start_side_channel(
                env.side_channel_host,
                engine.side_channel_port,
                engine.handshake_meta,
                engine.read_blocks,
                engine.notify_done,
            )
        except OSError as exc:
            logger.error(
                "NIXL side channel could not bind %s:%d: %s",
                env.side_channel_host,
                engine.side_channel_port,
                exc,
            )
            sock.close()
            return _startup_error(exc)
        logger.info(
            "NIXL side channel listening on %s:%d (engine_id %s)",
            env.side_channel_host,
            engine.side_channel_port,
            engine.engine_id,
        )
    reaper = asyncio.create_task(engine.run_lease_reaper())

    extra: dict[str, Any] = {
        "pid": os.getpid(),
        "worker_pids": worker_pids,
        "gpu_mode": env.gpu,
        "device": gpu_info,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    app = build_app(AppState(engine=engine, extra_version_info=extra))
    config = uvicorn.Config(
        app,
        host=args.host if args.host else "0.0.0.0",
        port=sock.getsockname()[1],
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_log_requests,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        # As vLLM's API server (entrypoints/launchers/api_server/entry.py): idle connections close after so long.
        timeout_keep_alive=env.http_keepalive,
        lifespan="on",
    )
    server = _SimServer(config, ignore_sigterm=env.ignore_sigterm)
    logger.info("Starting vLLM API server 0 on http://%s:%d", config.host, config.port)
    announcer = asyncio.create_task(_announce(server, config))
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()
        reaper.cancel()
        if side_channel is not None:
            side_channel.close()
    if exit_code:
        logger.error("Engine died; the API server is exiting with status %d", exit_code)
    return exit_code


async def _announce(server: uvicorn.Server, config: uvicorn.Config) -> None:
    """uvicorn logs "Uvicorn running on ..." only for sockets it binds itself; we pass a pre-bound one."""
    for _ in range(6000):  # bounded: 60 s
        if server.started or server.should_exit:
            break
        await asyncio.sleep(0.01)
    if server.started:
        logging.getLogger("uvicorn.error").info(
            "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", config.host, config.port
        )


def _hard_exit(sig: int) -> None:
    logger.error("Graceful shutdown did not finish within %.0f s of signal %d; exiting now", HARD_EXIT_AFTER_S, sig)
    for handler in logger.handlers:
        handler.flush()
    os._exit(128 + sig)


class _SimServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM honours ``PDSERVE_SIM_IGNORE_SIGTERM`` and a signal ends the
    process normally (cleanup, then status 0) instead of being re-raised after shutdown."""

    def __init__(self, config: uvicorn.Config, ignore_sigterm: bool) -> None:
        super().__init__(config)
        self._ignore_sigterm = ignore_sigterm
        self._hard_exit: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self._ignore_sigterm:
            logger.warning("Received SIGTERM; ignoring it (PDSERVE_SIM_IGNORE_SIGTERM=1)")
            return
        if self._hard_exit is None:
            # Python runs this handler between bytecodes even while the event loop is busy, and a daemon
            # timer thread gets the GIL from a busy Python loop, so this deadline holds whatever a request does.
            self._hard_exit = threading.Timer(HARD_EXIT_AFTER_S, _hard_exit, args=(sig,))
            self._hard_exit.daemon = True
            self._hard_exit.start()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
