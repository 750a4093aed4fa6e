"""The simulated engine: block-granular prefix cache, P/D leases and pulls, generation, metrics.

Arithmetic mirrored from vLLM (measured on vLLM 0.32 CPU, see the reference notes):

* block hashes are chained: ``h_i = H(h_{i-1}, tokens of block i)``; only full blocks are cached;
* at most ``P - 1`` prompt tokens can hit, so a fully cached prompt hits ``((P - 1) // B) * B`` tokens;
* every request adds ``P`` to ``prefix_cache_queries`` and the local hit to ``prefix_cache_hits``; with
  a KV connector it also adds ``P`` to ``external_prefix_cache_queries`` and the externally loaded
  tokens (``P - local_hit`` for a transferred request) to ``external_prefix_cache_hits``;
* a transferred request pulls ``ceil(P / B_remote) - local_hit / B_remote`` blocks of
  ``B * bytes_per_token`` bytes (``bytes_per_token`` = 2 layers x K,V x 2 heads x 32 x dtype size =
  1024 for float32), and computes nothing locally.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from pytest_pdserve.rules import kv_layout, mamba, nixl_params
from pytest_pdserve.rules.length import TooLong, fit_max_tokens
from pytest_pdserve.rules.versions import DEFAULT_VLLM_VERSION
from pytest_pdserve.sim import faults, kvcontent, kvtransfer, model, offload, tokenizer
from pytest_pdserve.sim.cli import ServeArgs
from pytest_pdserve.sim.faults import SimEnv
from pytest_pdserve.sim.metrics import SimMetrics
from pytest_pdserve.sim.model import ModelShape
from pytest_pdserve.sim.tokenizer import generate_ids, ids_bytes, perturb, top_alternatives

logger = logging.getLogger("pytest_pdserve.sim")

VLLM_VERSION = DEFAULT_VLLM_VERSION
"""The vLLM version the simulator answers as by default (``PDSERVE_SIM_VLLM_VERSION`` changes it)."""

DEFAULT_KV_CACHE_BYTES = 1 << 30
"""KV cache size at vLLM's default ``--gpu-memory-utilization`` 0.9 when ``--kv-cache-memory-bytes`` is not
given (VLLM_CPU_KVCACHE_SPACE=1 in the reference); other utilizations scale it linearly."""
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
OFFLOAD_BYTES_PER_S = 20e9
"""Simulated CPU<->GPU copy bandwidth (PCIe 4 x16 order), for the ``vllm:kv_offload_*_time`` counters."""


def kv_cache_bytes(args: ServeArgs) -> int:
    """vLLM's KV budget: ``--kv-cache-memory-bytes``, else the simulated device's share for the utilization."""
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes
    return int(DEFAULT_KV_CACHE_BYTES * args.gpu_memory_utilization / DEFAULT_GPU_MEMORY_UTILIZATION)


class EngineDeadError(RuntimeError):
    """The engine has died (``PDSERVE_SIM_CRASH_AFTER_REQUESTS``); like vLLM's EngineDeadError."""


class RequestError(ValueError):
    """A request vLLM would reject with HTTP 400 (``param``: the body's ``param`` field, as vLLM fills it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class KVLoadError(RuntimeError):
    """A remote KV load failed under ``kv_load_failure_policy=fail`` (HTTP 500)."""


def chain_hashes(root: bytes, tokens: Sequence[int], block_size: int, include_partial: bool) -> list[bytes]:
    """Chained block hashes of ``tokens`` (full blocks; plus the trailing partial one if asked)."""
    out: list[bytes] = []
    parent = root
    for start in range(0, len(tokens), block_size):
        block = tokens[start : start + block_size]
        if len(block) < block_size and not include_partial:
            break
        parent = hashlib.blake2b(parent + ids_bytes(block), digest_size=16).digest()
        out.append(parent)
    return out


class CacheFullError(RuntimeError):
    """No free or evictable block is left."""


class BlockPool:
    """Fixed pool of KV blocks with a hash -> block prefix cache and vLLM's eviction order.

    As in vLLM's ``BlockPool``/``FreeKVCacheBlockQueue``: every unreferenced block, cached or not, sits in one
    free queue in the order it was freed; allocation takes the queue's head and drops the hash of a cached block
    it takes (that is the eviction: least recently freed first). A request's blocks are freed last block first,
    so the tail of a prompt is evicted before its (more shareable) head. A cache hit on a free block takes it
    out of the queue. Block ids start at 1 (vLLM reserves block 0 as the null block).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks + 1))
        self._ref: dict[int, int] = {}
        self._cached: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        #: What each block holds (kvcontent: one digest per token); a freed or evicted block keeps its bytes
        #: until it is written again, as device memory does.
        self._content: dict[int, bytes] = {}
        self.evictions = 0

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``."""
        hit: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (a free one leaves the free queue)."""
        for block in blocks:
            self._ref[block] = self._ref.get(block, 0) + 1
            self._free.pop(block, None)

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks with one reference each, evicting from the head of the free queue."""
        if count > len(self._free):
            raise CacheFullError(
                f"KV cache is full: {count} blocks needed, {len(self._free)} free of {self.num_blocks} in total"
            )
        out: list[int] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(block, None)
            if h is not None:
                del self._cached[h]
                self.evictions += 1
            self._ref[block] = 1
            out.append(block)
        return out

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a computed full block under its hash (first writer wins, like vLLM)."""
        if block_hash in self._cached or block in self._hash_of:
            return
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash

    def write(self, block: int, content: bytes) -> None:
        """Store what a request computed (or received) into one of its blocks."""
        self._content[block] = content

    def read(self, block: int) -> bytes:
        """What a block holds now (empty for a block nothing was ever written to).

        :raises KeyError: not a block of this pool.
        """
        if not 1 <= block <= self.num_blocks:
            raise KeyError(f"block id {block} is not in the KV cache (1..{self.num_blocks})")
        return self._content.get(block, b"")

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether a block with this hash is in the prefix cache."""
        return block_hash in self._cached

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block, last block first; unreferenced blocks join the free queue's tail."""
        for block in reversed(blocks):
            ref = self._ref.get(block, 0) - 1
            if ref > 0:
                self._ref[block] = ref
                continue
            self._ref.pop(block, None)
            self._free[block] = None

    def usage(self) -> float:
        """Share of blocks referenced by requests or leases (cached-but-idle blocks count as free)."""
        return len(self._ref) / self.num_blocks if self.num_blocks else 0.0

    def reset(self) -> bool:
        """Drop every cached block; False (and no change) if any block is in use, like vLLM."""
        if self._ref:
            return False
        self._cached.clear()
        self._hash_of.clear()
        return True


@dataclass(frozen=True)
class SamplingParams:
    """The request parameters the engine needs."""

    max_tokens: int | None
    """As requested; ``None``: as many as fit (chat without max_tokens). Fitted by :func:`fit_max_tokens`."""
    temperature: float = 0.0
    seed: int | None = None
    #: vLLM's ``cache_salt``: joins the first block's hash, so every block hash of the request chains from it.
    cache_salt: str | None = None
    max_tokens_param: str = "max_tokens"
    text_prompt: bool = True


@dataclass
class Generation:
    """The engine's answer to one request."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    local_hit_tokens: int
    external_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    #: What the output was computed from (``kvcontent.context_digest``); the logprobs are drawn from it too.
    context: bytes = b""


@dataclass
class _Lease:
    block_ids: list[int]
    hashes: list[bytes]
    expires_at: float
    #: A hybrid model's Mamba state after the request's tokens (kvcontent), sent with its blocks.
    state: bytes | None = None


@dataclass
class EngineFacts:
    """Static facts about the engine, shown in ``/version``."""

    engine_id: str
    attention_backend: str
    block_size: int
    num_blocks: int
    bytes_per_block: int
    side_channel: tuple[str, int] | None
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    """One simulated vLLM engine (DP rank 0).

    :param on_dead: called once when the engine dies (the server schedules the process exit).
    """

    def __init__(
        self,
        args: ServeArgs,
        env: SimEnv,
        attention_backend: str,
        on_dead: Callable[[], None] | None = None,
        shape: ModelShape | None = None,
        tok: tokenizer.Tokenizer | None = None,
    ) -> None:
        self.args = args
        self.shape = shape if shape is not None else model.resolve(args.model)
        self.tok = tok if tok is not None else tokenizer.load(args.tokenizer, self.shape.directory)
        self.max_model_len = (
            args.max_model_len if args.max_model_len is not None else self.shape.max_position_embeddings
        )
        self.env = env
        self.attention_backend = attention_backend
        # Fault switches (faults.py): a server that silently runs something other than it was asked.
        self.block_size = env.override_block_size or args.block_size
        kv = None if env.kv_connector_off else args.kv_transfer_config
        if env.kv_connector_off and args.kv_transfer_config is not None:
            logger.warning(
                "Disabling KVTransfer: %s is not active (PDSERVE_SIM_KV_CONNECTOR_OFF)",
                args.kv_transfer_config.kv_connector,
            )
        self.kv_config = kv
        self.nixl = kv is not None and kv.is_nixl
        self.connector = kv is not None
        self.engine_id = kv.engine_id if kv is not None and kv.engine_id else str(uuid.uuid4())
        self.bytes_per_token = self.shape.kv_bytes_per_token(args.dtype, args.kv_cache_dtype)
        self.bytes_per_block = self.block_size * self.bytes_per_token
        self.pool = BlockPool(max(1, kv_cache_bytes(args) // self.bytes_per_block))
        self.model_key = args.model.encode()
        #: The weights this server computes with (kvcontent): the model and the --hf-overrides that change it.
        self.weights = kvcontent.weights_key(args.model, args.hf_overrides, model.raw_config(self.shape.directory))
        #: The layout registered with NIXL (the start refused a layout vLLM refuses; 0.26 and older: as set).
        self.kv_cache_layout = (
            kv_layout.running(env.kv_cache_layout, version=env.vllm_version, backend=attention_backend, nixl=True)
            or "LBHNC"
        )
        self.root_hash = hashlib.blake2b(b"pdserve-sim-root|" + self.model_key, digest_size=16).digest()
        self.compat_hash = kvtransfer.compatibility_hash(
            {
                "vllm_version": env.vllm_version,
                "model": args.model,
                "dtype": args.dtype,
                "num_kv_heads": self.shape.num_kv_heads,
                "head_size": self.shape.head_dim,
                "num_layers": self.shape.num_attention_layers,
                "attention_backend": attention_backend,
                "kv_cache_dtype": args.kv_cache_dtype,
                "transfer_mode": "pull",
            }
        )
        self.side_channel_port = env.side_channel_port + 0  # + data-parallel index (the simulator is DP rank 0)
        offload_extra = kv.offloading_extra_config if kv is not None else None
        self.cpu_tier = (
            offload.CpuTier(offload.cpu_bytes_to_use(offload_extra), self.bytes_per_block)
            if offload_extra is not None
            else None
        )
        self.metrics = SimMetrics(
            args.served_name,
            self.nixl,
            {
                "block_size": self.block_size,
                "cache_dtype": args.kv_cache_dtype,
                "enable_prefix_caching": args.enable_prefix_caching,
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "num_gpu_blocks": self.pool.num_blocks,
                "kv_cache_memory_bytes": self.pool.num_blocks * self.bytes_per_block,
                "mamba_cache_mode": args.mamba_cache_mode or "none",
            },
            offloading=self.cpu_tier is not None,
        )
        self._leases: dict[str, _Lease] = {}
        self._asleep_tags: set[str] = set()
        self._paused = False
        self._awake = asyncio.Event()  # set while the scheduler runs: not paused, not asleep
        self._awake.set()
        self._weight_version = "default"  # vLLM's EngineCore starts every server at this version
        self._mamba_checkpoints: OrderedDict[bytes, bytes] = OrderedDict()
        self.mamba_state_bytes = self.shape.mamba_state_bytes(args.dtype)
        self._expired: deque[str] = deque(maxlen=4096)
        self._rng = random.Random(args.seed)
        self._served = 0
        self.dead = False
        self._on_dead = on_dead
        #: Completion requests that reached the engine (PDSERVE_SIM_ENGINE_DIES_ON_REQUEST counts these).
        self._begun = 0

    def token_text(self, token_id: int) -> str:
        """Text of one generated id as a stream chunk / logprobs entry shows it ("" for special tokens)."""
        return self.tok.token_text(token_id)

    # ------------------------------------------------------------------ info
    def info(self) -> EngineFacts:
        """Static facts for ``/version``."""
        side = (self.env.side_channel_host, self.side_channel_port) if self.nixl else None
        return EngineFacts(
            self.engine_id,
            self.attention_backend,
            self.block_size,
            self.pool.num_blocks,
            self.bytes_per_block,
            side,
        )

    def handshake_meta(self) -> kvtransfer.HandshakeMeta:
        """What the side channel tells peers."""
        return kvtransfer.HandshakeMeta(
            self.engine_id, self.compat_hash, self.block_size, self.bytes_per_block, self.kv_cache_layout
        )

    # ------------------------------------------------------------------ leases (prefill side)
    def expire_leases(self) -> None:
        """Free the blocks of requests whose lease ran out (``vllm:nixl_num_kv_expired_reqs``)."""
        now = time.monotonic()
        for rid in [r for r, lease in self._leases.items() if lease.expires_at <= now]:
            lease = self._leases.pop(rid)
            self.pool.release(lease.block_ids)
            self._expired.append(rid)
            if self.nixl:
                self.metrics.nixl_num_kv_expired_reqs.labels(**self.metrics.labels).inc()
            # vLLM's wording (nixl/base_worker.py), so hints.py reads both engines' logs alike.
            logger.warning(
                "Releasing expired KV blocks for request %s which were retrieved by %d remote worker(s) "
                "before lease expired.",
                rid,
                0,
            )
        self._update_usage()

    def read_blocks(self, request_id: str, block_ids: Sequence[int]) -> tuple[list[bytes], bytes | None]:
        """What the given blocks hold now, and the request's Mamba state, for the side channel.

        Like a NIXL read of the prefill's KV memory, the block ids are not checked against the request: a decode that
        names another request's blocks reads their bytes.

        :raises KeyError: unknown or expired request, or a block id outside the KV cache.
        """
        self.expire_leases()
        lease = self._leases.get(request_id)
        if lease is None:
            raise KeyError(f"request {request_id} is unknown or its KV lease expired")
        return [self.pool.read(b) for b in block_ids], lease.state

    def notify_done(self, request_id: str) -> None:
        """The decode side finished reading: free the request's blocks."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            if request_id in self._expired and self.nixl:
                self.metrics.nixl_num_notifications_after_expiry.labels(**self.metrics.labels).inc()
            return
        self.pool.release(lease.block_ids)
        self._update_usage()

    def _lease_duration(self) -> float:
        return self.kv_config.kv_lease_duration if self.kv_config is not None else 30.0

    # ------------------------------------------------------------ pause and sleep (dev mode's /pause, /sleep, ...)
    # vLLM 0.32 keeps two states (measured on vLLM for CPU): the scheduler's pause (``EngineCore.pause_scheduler``:
    # new requests wait, nothing else changes) and the executor's sleeping tags. ``/sleep`` pauses the scheduler
    # and, at level >= 1, puts the executor to sleep and resets the prefix cache; ``/wake_up`` resumes the
    # scheduler once no tag sleeps. ``/is_sleeping`` is true while *either* holds (``EngineCore.is_sleeping``).
    # Neither needs ``--enable-sleep-mode`` on CPU, whose worker ignores sleep: measured, both answer 200.
    SLEEP_TAGS = ("weights", "kv_cache")
    PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's PauseMode

    @property
    def is_sleeping(self) -> bool:
        """``GET /is_sleeping``."""
        return self._paused or bool(self._asleep_tags)

    @property
    def is_paused(self) -> bool:
        """``GET /is_paused``."""
        return self._paused

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """``POST /pause``: new requests wait until ``/resume`` (or a full ``/wake_up``); ``clear_cache`` resets the
        prefix cache, in every mode (``EngineCore._finish_pause``). In-flight requests run to their end here: the
        simulator computes a request in one step, so there is nothing left to abort or keep."""
        self._paused = True
        self._awake.clear()
        if clear_cache:
            self.pool.reset()

    def resume(self) -> None:
        """``POST /resume``: the scheduler runs again (even while the executor sleeps, as in vLLM)."""
        self._paused = False
        self._awake.set()

    def sleep(self, level: int, mode: str = "abort") -> None:
        """``POST /sleep?level=N&mode=M``: pause the scheduler; level >= 1 also drops the prefix cache (the KV cache
        memory is released) and puts the weights and KV cache to sleep, as vLLM's ``EngineCore.sleep`` does."""
        del mode  # see pause: nothing in flight to treat
        self.pause(clear_cache=level >= 1)
        if level >= 1:
            self._asleep_tags = set(self.SLEEP_TAGS)
        self.metrics.record_sleep_state(1, level)
        logger.info("It took 0.000 seconds to fall asleep (level %d).", level)

    def wake_up(self, tags: Sequence[str] | None) -> bool:
        """``POST /wake_up[?tags=...]``; True when fully awake (then the scheduler resumes). The tag
        ``scheduling`` wakes a level-0 sleep; an unknown tag changes nothing (vLLM's executor warns and returns)."""
        if tags is not None:
            tags = [t for t in tags if t != "scheduling"]
        if (tags is None or tags) and self._asleep_tags and not set(tags or ()) - self._asleep_tags:
            self._asleep_tags -= set(tags) if tags else set(self._asleep_tags)
        if self._asleep_tags:
            return False
        self.resume()
        self.metrics.record_sleep_state(0, 0)
        return True

    # ------------------------------------------------------------------ weight version (dev mode's /weight_info)
    @property
    def weight_version(self) -> str:
        """``GET /weight_info``: ``default`` from the start, until ``POST /update_weight_version`` sets another."""
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        self._weight_version = version

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """``POST /reset_prefix_cache[?reset_external=true]``: the local prefix cache, and with ``reset_external``
        the connector's too (the OffloadingConnector's CPU tier; NixlConnector keeps none), as vLLM's
        ``Scheduler.reset_prefix_cache`` does: the connector is reset even when the local reset fails."""
        ok = self.pool.reset()
        if reset_external and self.cpu_tier is not None:
            self.cpu_tier.reset()
        return ok

    # ------------------------------------------------------------------ requests
    def _update_usage(self) -> None:
        self.metrics.kv_cache_usage_perc.labels(**self.metrics.labels).set(self.pool.usage())

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        kv_params: Mapping[str, Any] | None,
        request_id: str,
    ) -> Generation:
        """Run one request to completion.

        :raises EngineDeadError: the engine is dead.
        :raises RequestError: invalid request (HTTP 400).
        :raises KVLoadError: remote KV load failed with policy ``fail`` (HTTP 500).
        """
        if self.dead:
            raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        await self._awake.wait()  # a paused (or sleeping) scheduler: requests wait for /resume or /wake_up
        self._begun += 1
        if self._begun == self.env.engine_dies_on_request:
            self._die_mid_request()
        started = time.monotonic()
        m = self.metrics
        labels = m.labels
        n_prompt = len(prompt_ids)
        max_len = self.max_model_len
        if n_prompt == 0:
            raise RequestError("The prompt cannot be empty.")
        fitted = fit_max_tokens(
            self.env.vllm_version_tuple,
            prompt_len=n_prompt,
            max_tokens=params.max_tokens,
            max_model_len=max_len,
            text_prompt=params.text_prompt,
            max_tokens_param=params.max_tokens_param,
        )
        if isinstance(fitted, TooLong):
            raise RequestError(fitted.message, fitted.param)
        max_tokens = fitted
        kv = kv_params or {}
        remote_decode = self.nixl and bool(kv.get("do_remote_decode"))
        remote_prefill = self.nixl and bool(kv.get("do_remote_prefill"))
        self.expire_leases()

        # Hybrid (Mamba) models under NIXL: the prefiller stops one token short and the decoder recomputes it
        # (vLLM's NixlConnector scheduler ``_prefill_backoff``: Mamba needs h(N-1) to derive h(N) itself).
        backoff = 1 if self.shape.is_hybrid and self.nixl and n_prompt > 1 else 0
        work = prompt_ids[:-backoff] if remote_decode and backoff else prompt_ids
        n_work = len(work)
        bs = self.block_size
        root = self._salted_root(params.cache_salt)
        hashes = chain_hashes(root, work, bs, include_partial=True)
        hit_blocks = self.pool.lookup(hashes[: (n_work - 1) // bs]) if self.args.enable_prefix_caching else []
        hit_blocks = hit_blocks[: self._mamba_hit_blocks(hashes, len(hit_blocks))]
        self.pool.acquire(hit_blocks)
        try:
            new_blocks = self.pool.allocate(len(hashes) - len(hit_blocks))
        except CacheFullError as exc:
            self.pool.release(hit_blocks)
            raise RequestError(str(exc)) from None
        block_ids = hit_blocks + new_blocks
        local_hit = len(hit_blocks) * bs
        self._update_usage()

        external = 0
        from_host = 0
        requery = 0
        # What the request computes with (kvcontent): each position's KV as it ends up in its blocks, and a hybrid
        # model's Mamba state before its last token.
        chain = kvcontent.prefix_chain(work)
        slots: list[bytes | None] = [None] * n_work
        for i, block in enumerate(hit_blocks):
            slots[i * bs : (i + 1) * bs] = kvcontent.split(self.pool.read(block))
        state: tuple[int, bytes] | None = self._mamba_checkpoint_of(hashes, len(hit_blocks))
        if remote_prefill:
            n_transfer = n_prompt - backoff
            try:
                pulled = await self._pull(prompt_ids[:n_transfer], kv, local_hit, request_id)
            except KVLoadError:
                self.pool.release(block_ids)
                self._update_usage()
                raise
            if pulled is None:  # recomputed (kv_load_failure_policy=recompute): the connector promised the tokens
                requery = n_transfer - local_hit
            else:
                external = n_transfer - local_hit
                slots[local_hit:n_transfer] = pulled.digests
                if pulled.remote_block_size != bs and self.env.platform == "cpu":
                    self._misplace_sub_blocks(slots, local_hit, n_transfer, pulled.remote_block_size)
                if self.env.kv_drop_blocks and pulled.num_blocks:
                    self._drop_blocks(slots, pulled, local_hit, n_transfer, block_ids)
                if pulled.state is not None:
                    state = (n_transfer - 1, pulled.state)
        elif self.cpu_tier is not None and self.args.enable_prefix_caching:
            from_host = self._load_from_cpu(hashes, len(hit_blocks), (n_work - 1) // bs, slots)
            external = from_host

        # vLLM for CPU's Mamba kernel cannot save the checkpoint a long hybrid prefill makes (rules/mamba.py).
        if mamba.cpu_prefill_dies(
            version=self.env.vllm_version, platform=self.env.platform, hybrid=self.shape.is_hybrid,
            mode=self.args.mamba_cache_mode or "none", query_start=local_hit + external, query_end=n_work,
            block_size=bs,
        ):  # fmt: skip
            self.pool.release(block_ids)
            self._die_mid_request(f"IndexError: {mamba.cpu_prefill_error(local_hit + external, n_work, 64)}")
        # Everything from here to the end is synchronous: no other request interleaves.
        own = [i for i, d in enumerate(slots) if d is None]
        if remote_prefill and not backoff and n_work:
            own.append(n_work - 1)  # vLLM recomputes the last prompt token of a fully transferred prompt
        for i in own:
            slots[i] = kvcontent.kv_digests(self.weights, chain, i, i + 1)[0]
        digests: list[bytes] = [d if d is not None else kvcontent.EMPTY for d in slots]
        for i, block in enumerate(block_ids):
            if i >= len(hit_blocks):
                self.pool.write(block, b"".join(digests[i * bs : (i + 1) * bs]))
        if self.args.enable_prefix_caching:
            for i in range(len(hit_blocks), n_work // bs):
                self.pool.cache(block_ids[i], hashes[i])
            self._save_mamba_checkpoint(hashes, n_work // bs, chain, state)
        computed = n_work - local_hit - external
        self._record_prompt(n_work, local_hit, external, computed, from_host, requery)
        if self.cpu_tier is not None:
            self._store_to_cpu(hashes[: n_work // bs], [self.pool.read(b) for b in block_ids[: n_work // bs]])
        n_out = 1 if remote_decode else max_tokens
        before_last = self._state_after(chain, n_work - 2, state) if self.shape.is_hybrid and n_work > 1 else None
        context = kvcontent.context_digest(self.weights, digests, before_last)
        if self.env.context_blind:  # PDSERVE_SIM_CONTEXT_BLIND: the KV before the last 8 tokens is never read
            context = kvcontent.context_digest(self.weights, [ids_bytes(prompt_ids[-8:])], None)
        output = self._sample(context, prompt_ids, params, n_out)
        output = self._maybe_perturb(prompt_ids, output, local_hit, request_id, context)
        transfer_params: dict[str, Any] | None = None
        if remote_decode:
            # The blocks stay referenced by the lease until the decode side notifies or it expires.
            final = self._state_after(chain, n_work - 1, state) if self.shape.is_hybrid and n_work else None
            transfer_params = self._lease(request_id, block_ids, hashes, n_work, local_hit, final)
        else:
            self.pool.release(block_ids)
        self._update_usage()

        m.generation_tokens.labels(**labels).inc(len(output))
        m.request_success.labels(**labels, finished_reason="length").inc()
        m.request_prompt_tokens.labels(**labels).observe(n_work)
        m.request_generation_tokens.labels(**labels).observe(len(output))
        m.e2e_request_latency.labels(**labels).observe(time.monotonic() - started)
        if not self.args.disable_log_requests:
            logger.info(
                "Finished request %s: prompt_tokens=%d local_cache_hit=%d external_kv_transfer=%d "
                "local_compute=%d generated=%d",
                request_id,
                n_work,
                local_hit,
                external,
                computed,
                len(output),
            )
        self._count_served()
        return Generation(request_id, prompt_ids, output, "length", local_hit, external, transfer_params, context)

    def _mamba_hit_blocks(self, hashes: Sequence[bytes], hit: int) -> int:
        """A hybrid model's prefix hit also needs the Mamba state at its end: vLLM's ``mamba_cache_mode``
        ``align`` (the default with prefix caching) saves it only at the last full block a request computed."""
        if not self.shape.is_hybrid:
            return hit
        while hit and hashes[hit - 1] not in self._mamba_checkpoints:
            hit -= 1
        return hit

    def _mamba_checkpoint_of(self, hashes: Sequence[bytes], hit_blocks: int) -> tuple[int, bytes] | None:
        """The Mamba state a prefix hit of ``hit_blocks`` blocks starts from: (its last position, its digest)."""
        if not self.shape.is_hybrid or hit_blocks == 0:
            return None
        return hit_blocks * self.block_size - 1, self._mamba_checkpoints[hashes[hit_blocks - 1]]

    def _state_after(self, chain: Sequence[bytes], last: int, start: tuple[int, bytes] | None) -> bytes:
        """The Mamba state after position ``last`` of a request that began from ``start`` (a checkpoint or a received
        state; None: computed from the first token)."""
        if start is not None and start[1] == kvcontent.state_digest(self.weights, chain, start[0]):
            start = None  # the state these weights compute there anyway
        return kvcontent.state_digest(self.weights, chain, last, None if start is None else start[1])

    def _save_mamba_checkpoint(
        self, hashes: Sequence[bytes], full_blocks: int, chain: Sequence[bytes], start: tuple[int, bytes] | None
    ) -> None:
        if not self.shape.is_hybrid or full_blocks == 0:
            return
        at = full_blocks * self.block_size - 1
        self._mamba_checkpoints[hashes[full_blocks - 1]] = self._state_after(chain, at, start)
        while len(self._mamba_checkpoints) > self.pool.num_blocks:  # bounded: at most one per cached block
            self._mamba_checkpoints.popitem(last=False)

    def _load_from_cpu(self, hashes: Sequence[bytes], first: int, limit: int, slots: list[bytes | None]) -> int:
        """CPU->GPU: blocks ``first..`` of the prompt found in the CPU tier (their KV into ``slots``); returns their
        token count."""
        assert self.cpu_tier is not None
        blocks = self.cpu_tier.lookup(hashes[first:limit]) if limit > first else 0
        bs = self.block_size
        for i in range(first, first + blocks):
            slots[i * bs : (i + 1) * bs] = kvcontent.split(self.cpu_tier.content(hashes[i]), bs)
        if blocks:
            num_bytes = blocks * self.bytes_per_block
            self.metrics.offload_transfer("CPU_to_GPU", num_bytes, num_bytes / OFFLOAD_BYTES_PER_S)
        return blocks * self.block_size

    def _store_to_cpu(self, full_hashes: Sequence[bytes], contents: Sequence[bytes]) -> None:
        """GPU->CPU: the request's full blocks that the CPU tier lacks, when the request finishes."""
        assert self.cpu_tier is not None
        written = self.cpu_tier.store(full_hashes, contents)
        if written:
            num_bytes = written * self.bytes_per_block
            self.metrics.offload_transfer("GPU_to_CPU", num_bytes, num_bytes / OFFLOAD_BYTES_PER_S)

    def _record_prompt(
        self, n_prompt: int, local_hit: int, external: int, computed: int, from_host: int = 0, requery: int = 0
    ) -> None:
        """``requery``: the tokens a failed pull had promised before policy ``recompute`` computed them. vLLM counts
        them as external hits and then asks the connector about the prompt again (measured on vLLM for CPU: a
        300-token request adds 600 queries and 300 hits, a hybrid 40-token one 80 and 39), while
        ``prompt_tokens_by_source`` says ``local_compute``: the truth."""
        m, labels = self.metrics, self.metrics.labels
        m.prefix_cache_queries.labels(**labels).inc(n_prompt)
        m.prefix_cache_hits.labels(**labels).inc(local_hit)
        if self.connector:
            # vLLM asks the connector only about the tokens after the local hit (measured on vllm-cpu 0.32).
            asked = (n_prompt - local_hit) * (2 if requery else 1)
            m.external_prefix_cache_queries.labels(**labels).inc(asked)
            m.external_prefix_cache_hits.labels(**labels).inc(external + requery)
        m.prompt_tokens.labels(**labels).inc(n_prompt)
        m.prompt_tokens_by_source.labels(**labels, source="local_compute").inc(computed)
        m.prompt_tokens_by_source.labels(**labels, source="local_cache_hit").inc(local_hit)
        m.prompt_tokens_by_source.labels(**labels, source="external_kv_transfer").inc(external)
        m.prompt_tokens_cached.labels(**labels).inc(local_hit + external)
        m.prompt_tokens_cached_by_source.labels(**labels, source="device").inc(local_hit)
        m.prompt_tokens_cached_by_source.labels(**labels, source="p2p").inc(external - from_host)
        m.prompt_tokens_cached_by_source.labels(**labels, source="host").inc(from_host)

    async def _pull(
        self, prompt_ids: list[int], kv: Mapping[str, Any], local_hit: int, request_id: str
    ) -> kvtransfer.PullResult | None:
        """Pull the remote blocks; returns what arrived, or None after a failed pull that policy ``recompute``
        turns into a local computation."""
        m, labels = self.metrics, self.metrics.labels
        n_prompt = len(prompt_ids)
        m.num_requests_waiting.labels(**labels).inc()
        try:
            remote_ids = kv.get("remote_block_ids") or [[]]
            group = remote_ids[0] if remote_ids and isinstance(remote_ids[0], list) else remote_ids
            result = await kvtransfer.pull_blocks(
                str(kv.get("remote_host")),
                int(kv.get("remote_port") or 0),
                remote_request_id=str(kv.get("remote_request_id")),
                remote_block_ids=[int(b) for b in group],
                compat_hash=self.compat_hash,
                first_token=local_hit,
                num_tokens=n_prompt,
                local_block_size=self.block_size,
                kv_cache_layout=self.kv_cache_layout,
                fail_reads=self.env.fail_kv_pull,
                on_notify_failure=lambda: m.nixl_num_failed_notifications.labels(**labels).inc(),
                state_bytes=self.mamba_state_bytes,
            )
        except kvtransfer.RemoteBlocksShort as exc:
            self._die_mid_request(f"AssertionError in _apply_prefix_caching: {exc}")
        except (kvtransfer.KVTransferError, ValueError, TypeError) as exc:
            m.nixl_num_failed_transfers.labels(**labels).inc()
            affected = n_prompt - local_hit
            policy = self.kv_config.kv_load_failure_policy if self.kv_config is not None else "fail"
            logger.error("KV transfer for request %s failed: %s", request_id, exc)
            if policy == "fail":
                logger.error(
                    "Failing 1 request(s) due to KV load failure (failure_policy=fail, %d tokens affected)",
                    affected,
                )
                m.request_success.labels(**labels, finished_reason="error").inc()
                self._count_served()
                raise KVLoadError(str(exc)) from None
            logger.warning(
                "Recomputing %d tokens of request %s locally (failure_policy=recompute)", affected, request_id
            )
            return None
        finally:
            m.num_requests_waiting.labels(**labels).dec()
        m.nixl_bytes_transferred.labels(**labels).observe(result.bytes_transferred)
        # K and V per attention layer and block, plus conv and SSM state per Mamba layer.
        descriptors = result.num_blocks * self.shape.num_attention_layers * 2 + 2 * self.shape.num_mamba_layers
        m.nixl_num_descriptors.labels(**labels).observe(descriptors)
        m.nixl_xfer_time.labels(**labels).observe(result.xfer_time_s)
        m.nixl_post_time.labels(**labels).observe(result.post_time_s)
        return result

    def _misplace_sub_blocks(self, slots: list[bytes | None], first: int, end: int, remote_block_size: int) -> None:
        """Decode's blocks are a multiple of prefill's: vLLM for CPU 0.32 reports the transfer whole, and its first
        token then differs entirely from a direct serve's (measured: the top-20 logprobs of the two share no token,
        prefill block 64, decode block 128): the remote sub-blocks do not land where the CPU backend's head-major
        blocks read them. Modelled as each local block's tokens read in the transposed order."""
        bs = self.block_size
        ratio = bs // remote_block_size
        for start in range(first - first % bs, end, bs):
            block = slots[start : start + bs]
            if len(block) < bs:
                break
            moved = [block[(i % ratio) * remote_block_size + i // ratio] for i in range(bs)]
            for pos in range(max(start, first), min(start + bs, end)):
                slots[pos] = moved[pos - start]

    def _drop_blocks(
        self,
        slots: list[bytes | None],
        pulled: kvtransfer.PullResult,
        first: int,
        end: int,
        block_ids: Sequence[int],
    ) -> None:
        """``PDSERVE_SIM_KV_DROP_BLOCKS``: the last N blocks of the pull never arrived; their tokens keep what this
        server's blocks held before (stale KV of an earlier request, or nothing)."""
        rbs, bs = pulled.remote_block_size, self.block_size
        lost_from = max(first, ((first // rbs) + pulled.num_blocks - self.env.kv_drop_blocks) * rbs)
        for pos in range(lost_from, end):
            slots[pos] = kvcontent.split(self.pool.read(block_ids[pos // bs]), bs)[pos % bs]
        logger.debug("PDSERVE_SIM_KV_DROP_BLOCKS: tokens %d..%d of the pull never arrived", lost_from, end - 1)

    def _salted_root(self, salt: str | None) -> bytes:
        """The hash chain's root for a request: salted like vLLM's first-block extra key, else the model's."""
        if salt is None:
            return self.root_hash
        return hashlib.blake2b(self.root_hash + b"|cache_salt|" + salt.encode(), digest_size=16).digest()

    def _sample(self, context: bytes, prompt_ids: list[int], params: SamplingParams, count: int) -> list[int]:
        """Output ids computed from the request's context (kvcontent.context_digest: the KV it really used, which
        covers the prompt)."""
        del prompt_ids
        if params.temperature == 0:
            return generate_ids(context, (), count)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        key = f"seed={seed};t={params.temperature!r}".encode()
        return generate_ids(context, (), count, sample_key=key)

    def _maybe_perturb(
        self, prompt_ids: list[int], output: list[int], local_hit: int, request_id: str, context: bytes
    ) -> list[int]:
        """Simulated batch variance: a non-batch-invariant backend may change a token on a warm cache."""
        if local_hit == 0 or len(output) < 2 or self.attention_backend not in self.env.nondeterministic_backends:
            return output
        digest = hashlib.blake2b(
            b"nondeterminism|" + ids_bytes(prompt_ids) + local_hit.to_bytes(4, "little"), digest_size=8
        ).digest()
        draw = int.from_bytes(digest[:4], "little") / 2**32
        if draw >= self.env.nondeterminism_rate:
            return output
        index = 1 + int.from_bytes(digest[4:], "little") % (len(output) - 1)
        changed = list(output)
        changed[index] = perturb(changed[index], digest)
        tie = faults.tie_position(ids_bytes(prompt_ids), len(output)) if self.env.tie_flip else None
        if tie is not None:  # PDSERVE_SIM_TIE_FLIP: a near-tie flips to the runner-up instead
            index, changed = tie, list(output)
            changed[tie] = top_alternatives(output[tie], tie, 2, salt=context)[1]
        logger.debug(
            "request %s: %s is not batch-invariant; token %d differs on the warm cache",
            request_id,
            self.attention_backend,
            index,
        )
        return changed

    def _lease(
        self,
        request_id: str,
        block_ids: list[int],
        hashes: list[bytes],
        n_prompt: int,
        local_hit: int,
        state: bytes | None = None,
    ) -> dict[str, Any]:
        duration = self._lease_duration()
        self._leases[request_id] = _Lease(block_ids, hashes, time.monotonic() + duration, state)
        args = self.args
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(block_ids)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.env.side_channel_host,
            "remote_port": self.side_channel_port,
            "tp_size": args.tensor_parallel_size,
            "dcp_size": 1,
            "pp_size": args.pipeline_parallel_size,
            "remote_num_tokens": n_prompt,
            "remote_blocks_expiry_time": time.time() + duration,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": local_hit,
        }
        if nixl_params.REGISTRATION_GENERATION.at(self.env.vllm_version):
            params["remote_registration_generation"] = 0  # the KV cache is registered once, at start
        return params

    def _die_mid_request(self, cause: str | None = None) -> NoReturn:
        """A worker crash under a request, as vLLM logs it: the request gets HTTP 500, then the server exits.

        :param cause: the exception the engine core died of (its last line, as vLLM prints it); None: a worker
            process died (``PDSERVE_SIM_ENGINE_DIES_ON_REQUEST``).
        """
        self.dead = True
        if cause is None:
            logger.error(
                "Worker proc VllmWorker-0 died unexpectedly (exit code: -4), shutting down executor. "
                "(PDSERVE_SIM_ENGINE_DIES_ON_REQUEST=%d)", self._begun,
            )  # fmt: skip
        else:
            logger.error("WorkerProc hit an exception.")
            logger.error("EngineCore encountered a fatal error.\nTraceback (most recent call last):\n%s", cause)
        logger.error("EngineCore encountered a fatal error.")
        message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
        logger.error("vllm.v1.engine.exceptions.EngineDeadError: %s", message)
        if self._on_dead is not None:
            self._on_dead()
        raise EngineDeadError(message)

    def _count_served(self) -> None:
        self._served += 1
        limit = self.env.crash_after_requests
        if limit is not None and self._served >= limit and not self.dead:
            self.dead = True
            logger.error("EngineCore encountered a fatal error (PDSERVE_SIM_CRASH_AFTER_REQUESTS=%d).", limit)
            logger.error(
                "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
                "See stack trace (above) for the root cause."
            )
            if self._on_dead is not None:
                self._on_dead()

    async def run_lease_reaper(self, interval_s: float = 0.5) -> None:
        """Background task: expire leases even when no request arrives."""
        while True:
            await asyncio.sleep(interval_s)
            self.expire_leases()
