"""Simulated NIXL pull transfer between two simulator processes, over a real TCP side channel.

The prefill engine listens on ``VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT + dp_index``.
A decode engine that receives ``do_remote_prefill`` connects there and, like vLLM's NixlPullConnector:

1. handshakes (``get_meta``): checks the compatibility hash (vLLM version, model, dtype, KV shape,
   attention backend, KV-cache dtype, transfer mode; *not* block size, nor the weights: a prefill started with
   other ``--hf-overrides`` passes), then the KV cache layout (vLLM's ``_validate_remote_agent_handshake``) and
   the block sizes (decode's must be a multiple of prefill's, ``TransferTopology.block_size_ratio``);
2. reads the blocks it does not hold locally (``read``): whatever those block ids of the prefill's KV cache hold
   now (:mod:`pytest_pdserve.sim.kvcontent`), unchecked, as NIXL reads memory; a remote list shorter than the
   blocks decode must fill kills decode's engine, as vLLM's assertion does;
3. notifies the prefill side (``notify``), which frees the request's blocks.

Framing: each message is a 4-byte big-endian length plus a JSON header; a ``read`` reply is followed
by ``payload_len`` raw bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_pdserve.sim import kvcontent

HANDSHAKE_TIMEOUT_S = 5.0
"""vLLM's handshake socket uses RCVTIMEO 5000 ms."""

NIXL_CONNECTOR_VERSION = 2
_MAX_HEADER = 1 << 20


class KVTransferError(RuntimeError):
    """A pull from a remote prefill engine failed (handshake or read)."""


class RemoteBlocksShort(RuntimeError):
    """The remote block list is shorter than the blocks decode must fill: vLLM's worker asserts (``assert
    num_decode_blocks <= len(prefill_group)`` in ``_apply_prefix_caching``) and its engine dies."""


def compatibility_hash(fields: Mapping[str, object]) -> str:
    """``compute_nixl_compatibility_hash``: a digest over the fields that must match between P and D."""
    blob = json.dumps({"nixl_connector_version": NIXL_CONNECTOR_VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


async def _send(writer: asyncio.StreamWriter, header: Mapping[str, Any], payload: bytes = b"") -> None:
    data = json.dumps(header).encode()
    writer.write(struct.pack(">I", len(data)) + data + payload)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> dict[str, Any]:
    (length,) = struct.unpack(">I", await reader.readexactly(4))
    if length > _MAX_HEADER:
        raise KVTransferError(f"side-channel header of {length} bytes is too large")
    header = json.loads(await reader.readexactly(length))
    if not isinstance(header, dict):
        raise KVTransferError("side-channel header is not a JSON object")
    return header


@dataclass(frozen=True)
class HandshakeMeta:
    """What the prefill side tells a peer about itself."""

    engine_id: str
    compat_hash: str
    block_size: int
    bytes_per_block: int
    kv_cache_layout: str = "LBHNC"


async def start_side_channel(
    host: str,
    port: int,
    meta: Callable[[], HandshakeMeta],
    read_blocks: Callable[[str, Sequence[int]], tuple[list[bytes], bytes | None]],
    notify: Callable[[str], None],
) -> asyncio.Server:
    """Bind and serve the side channel. ``OSError`` (port in use) propagates to the caller."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    msg = await _recv(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                op = msg.get("op")
                if op == "get_meta":
                    m = meta()
                    await _send(
                        writer,
                        {
                            "ok": True,
                            "engine_id": m.engine_id,
                            "compat_hash": m.compat_hash,
                            "block_size": m.block_size,
                            "bytes_per_block": m.bytes_per_block,
                            "kv_cache_layout": m.kv_cache_layout,
                            "perf_counter": time.perf_counter(),
                        },
                    )
                elif op == "read":
                    try:
                        contents, state = read_blocks(str(msg["request_id"]), [int(b) for b in msg["block_ids"]])
                    except KeyError as exc:
                        await _send(writer, {"ok": False, "error": str(exc.args[0] if exc.args else exc)})
                        continue
                    m = meta()
                    payload = kvcontent.pack(contents, m.block_size, m.bytes_per_block // m.block_size)
                    state_bytes = int(msg.get("state_bytes") or 0)
                    if state_bytes and contents:
                        payload += kvcontent.pack_state(state or kvcontent.EMPTY, state_bytes)
                    await _send(writer, {"ok": True, "payload_len": len(payload)}, payload)
                elif op == "notify":
                    notify(str(msg["request_id"]))
                    await _send(writer, {"ok": True})
                else:
                    await _send(writer, {"ok": False, "error": f"unknown op {op!r}"})
        finally:
            writer.close()

    return await asyncio.start_server(handle, host=host, port=port)


@dataclass(frozen=True)
class PullResult:
    """Outcome of one successful pull."""

    bytes_transferred: int
    num_blocks: int
    xfer_time_s: float
    post_time_s: float
    remote_block_size: int
    #: The KV that arrived for prompt positions ``first_token .. num_tokens - 1`` (kvcontent digests).
    digests: tuple[bytes, ...] = ()
    #: A hybrid model's Mamba state after ``num_tokens`` tokens, as it arrived (None without Mamba layers).
    state: bytes | None = None


async def pull_blocks(
    host: str,
    port: int,
    *,
    remote_request_id: str,
    remote_block_ids: Sequence[int],
    compat_hash: str,
    first_token: int,
    num_tokens: int,
    local_block_size: int,
    kv_cache_layout: str = "LBHNC",
    fail_reads: bool = False,
    on_notify_failure: Callable[[], None] | None = None,
    state_bytes: int = 0,
) -> PullResult:
    """Pull the blocks that cover prompt tokens ``[first_token, num_tokens)`` from a prefill engine.

    :raises KVTransferError: on any failure (connection, compatibility, layout, unknown request).
    :raises RemoteBlocksShort: the remote block list cannot cover the tokens (vLLM's engine dies).
    """
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), HANDSHAKE_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        raise KVTransferError(f"handshake with {host}:{port} failed: {exc!r}") from None
    try:
        return await _pull(
            reader,
            writer,
            remote_request_id,
            remote_block_ids,
            compat_hash,
            first_token,
            num_tokens,
            local_block_size,
            kv_cache_layout,
            fail_reads,
            on_notify_failure,
            state_bytes,
        )
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as exc:
        raise KVTransferError(f"side channel {host}:{port} broke: {exc!r}") from None
    finally:
        writer.close()


async def _request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, header: Mapping[str, Any]
) -> dict[str, Any]:
    async def roundtrip() -> dict[str, Any]:
        await _send(writer, header)
        return await _recv(reader)

    waited: Awaitable[dict[str, Any]] = asyncio.wait_for(roundtrip(), HANDSHAKE_TIMEOUT_S)
    return await waited


async def _pull(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    remote_request_id: str,
    remote_block_ids: Sequence[int],
    compat_hash: str,
    first_token: int,
    num_tokens: int,
    local_block_size: int,
    kv_cache_layout: str,
    fail_reads: bool,
    on_notify_failure: Callable[[], None] | None,
    state_bytes: int,
) -> PullResult:
    meta = await _request(reader, writer, {"op": "get_meta"})
    if meta.get("compat_hash") != compat_hash:
        raise KVTransferError(
            f"NIXL compatibility hash mismatch. Local: {compat_hash}, Remote: {meta.get('compat_hash')}. "
            "Prefill and decode instances have incompatible configurations (model, dtype, attention "
            "backend, KV-cache dtype). Set 'enforce_handshake_compat': false in kv_connector_extra_config "
            "to bypass this check."
        )
    remote_layout = str(meta.get("kv_cache_layout") or "LBHNC")
    if remote_layout != kv_cache_layout:
        raise KVTransferError(
            f"Heterogeneous TP expects same kv_cache_layout (local {kv_cache_layout}, remote {remote_layout}). Or "
            "enable experimental feature to receive LBHNC into a local LBNHC cache by setting "
            "'enable_permute_local_kv'=True in --kv-transfer-config."
        )
    remote_bs = int(meta["block_size"])
    if local_block_size % remote_bs:
        # vLLM's TransferTopology.block_size_ratio: decode's blocks must be whole multiples of prefill's.
        raise KVTransferError(
            f"Local block size {local_block_size} is not divisible by remote block size {remote_bs} or vice versa."
        )
    bytes_per_block = int(meta["bytes_per_block"])
    start = first_token // remote_bs
    needed = -(-num_tokens // remote_bs) - start
    if needed > len(remote_block_ids):
        raise RemoteBlocksShort(
            f"remote request {remote_request_id} lists {len(remote_block_ids)} blocks; decode must fill {needed} "
            f"(assert num_decode_blocks <= len(prefill_group))"
        )
    wanted = list(remote_block_ids[len(remote_block_ids) - needed :]) if needed > 0 else []
    post_started = time.perf_counter()
    if fail_reads:
        raise KVTransferError("NIXL transfer failed: PDSERVE_SIM_FAIL_KV_PULL=1")
    writer_header = {"op": "read", "request_id": remote_request_id, "block_ids": wanted, "state_bytes": state_bytes}
    await _send(writer, writer_header)
    post_time = time.perf_counter() - post_started
    reply = await asyncio.wait_for(_recv(reader), HANDSHAKE_TIMEOUT_S)
    if not reply.get("ok"):
        raise KVTransferError(f"remote read of {remote_request_id} failed: {reply.get('error')}")
    payload = await asyncio.wait_for(reader.readexactly(int(reply["payload_len"])), HANDSHAKE_TIMEOUT_S)
    xfer_time = time.perf_counter() - post_started
    kv_bytes = len(wanted) * bytes_per_block
    slots = kvcontent.unpack(payload[:kv_bytes], len(wanted), remote_bs, bytes_per_block // remote_bs)
    digests = tuple(slots[first_token - start * remote_bs : num_tokens - start * remote_bs])
    state = kvcontent.unpack_state(payload[kv_bytes:]) if state_bytes and wanted else None
    try:
        ack = await _request(reader, writer, {"op": "notify", "request_id": remote_request_id})
        if not ack.get("ok") and on_notify_failure is not None:
            on_notify_failure()
    except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
        if on_notify_failure is not None:
            on_notify_failure()
    return PullResult(
        bytes_transferred=len(payload),
        num_blocks=len(wanted),
        xfer_time_s=xfer_time,
        post_time_s=post_time,
        remote_block_size=remote_bs,
        digests=digests,
        state=state,
    )
