"""Prometheus metrics of the simulator, with vLLM 0.34's exact family names and labels (the same as 0.33's).

Everything lives in a private :class:`prometheus_client.CollectorRegistry` (one per engine), so
counters expose ``<name>_total`` and ``<name>_created`` exactly as vLLM's do. Every label set the
plugin may read is created at startup so a scrape shows zeros instead of a missing series.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHED_TOKEN_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
FINISHED_REASONS = ("stop", "length", "abort", "error")

OFFLOAD_TRANSFER_TYPES = ("CPU_to_GPU", "GPU_to_CPU")
OFFLOAD_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
"""vLLM's ``TRANSFER_SIZE_BUCKETS`` (offloading/metrics.py)."""

_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 34, 2))
_DESCRIPTOR_BUCKETS = (1.0, 10.0, 100.0, 1000.0, 10000.0, 100000.0)
_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)


class SimMetrics:
    """The metric families of one simulated engine (``engine="0"``).

    :param model_name: the served model name (the ``model_name`` label).
    :param nixl: whether a NixlConnector is configured (adds the ``vllm:nixl_*`` families).
    :param cache_config: labels of ``vllm:cache_config_info`` (values are stringified).
    """

    def __init__(
        self, model_name: str, nixl: bool, cache_config: Mapping[str, object], offloading: bool = False
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        base = ("model_name", "engine")
        self._base = {"model_name": model_name, "engine": "0"}
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            c = Counter(name, doc, base, registry=r)
            c.labels(**self._base)
            return c

        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries", "External (KV connector) prefix cache queries, in tokens."
        )
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits", "External (KV connector) prefix cache hits, in tokens."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens_by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            (*base, "source"),
            registry=r,
        )
        for source in PROMPT_TOKEN_SOURCES:
            self.prompt_tokens_by_source.labels(**self._base, source=source)
        self.prompt_tokens_cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Number of cached prompt tokens by source.",
            (*base, "source"),
            registry=r,
        )
        for source in CACHED_TOKEN_SOURCES:
            self.prompt_tokens_cached_by_source.labels(**self._base, source=source)
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*base, "finished_reason"),
            registry=r,
        )
        for reason in FINISHED_REASONS:
            self.request_success.labels(**self._base, finished_reason=reason)
        self.num_requests_running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", base, registry=r
        )
        self.num_requests_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", base, registry=r
        )
        self.kv_cache_usage_perc = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", base, registry=r
        )
        self.engine_sleep_state = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping.",
            (*base, "sleep_state"),
            registry=r,
        )
        for gauge in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc):
            gauge.labels(**self._base).set(0)
        self.engine_sleep_state.labels(**self._base, sleep_state="awake").set(1)
        self.engine_sleep_state.labels(**self._base, sleep_state="weights_offloaded").set(0)
        self.engine_sleep_state.labels(**self._base, sleep_state="discard_all").set(0)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            base,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            base,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            base,
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        info_labels = {k: str(v) for k, v in cache_config.items()}
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("engine", *info_labels),
            registry=r,
        )
        info.labels(engine="0", **info_labels).set(1)

        self.nixl = nixl
        if nixl:
            self.nixl_xfer_time = Histogram(
                "vllm:nixl_xfer_time_seconds",
                "Histogram of transfer duration for NIXL KV Cache transfers.",
                base,
                buckets=_TIME_BUCKETS,
                registry=r,
            )
            self.nixl_post_time = Histogram(
                "vllm:nixl_post_time_seconds",
                "Histogram of transfer post time for NIXL KV Cache transfers.",
                base,
                buckets=_TIME_BUCKETS,
                registry=r,
            )
            self.nixl_bytes_transferred = Histogram(
                "vllm:nixl_bytes_transferred",
                "Histogram of bytes transferred per NIXL KV Cache transfers.",
                base,
                buckets=_BYTES_BUCKETS,
                registry=r,
            )
            self.nixl_num_descriptors = Histogram(
                "vllm:nixl_num_descriptors",
                "Histogram of number of descriptors per NIXL KV Cache transfers.",
                base,
                buckets=_DESCRIPTOR_BUCKETS,
                registry=r,
            )
            self.nixl_num_failed_transfers = counter(
                "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers."
            )
            self.nixl_num_failed_notifications = counter(
                "vllm:nixl_num_failed_notifications", "Number of failed NIXL KV Cache notifications."
            )
            self.nixl_num_kv_expired_reqs = counter(
                "vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire."
            )
            self.nixl_num_notifications_after_expiry = counter(
                "vllm:nixl_num_notifications_after_expiry",
                "Number of notifications received after the request's KV lease expired.",
            )
            for hist in (
                self.nixl_xfer_time,
                self.nixl_post_time,
                self.nixl_bytes_transferred,
                self.nixl_num_descriptors,
            ):
                hist.labels(**self._base)

        self.offloading = offloading
        if offloading:
            self._offload_families(base)

    def _offload_families(self, base: tuple[str, ...]) -> None:
        """``vllm:kv_offload_*`` of vLLM's OffloadPromMetrics (CPU spec: the transfer_type names too)."""
        r = self.registry
        typed = (*base, "transfer_type")
        self.kv_offload_total_bytes = Counter(
            "vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector", typed, registry=r
        )
        self.kv_offload_total_time = Counter(
            "vllm:kv_offload_total_time", "Total time measured by all KV offloading operations", typed, registry=r
        )
        self.kv_offload_size = Histogram(
            "vllm:kv_offload_size",
            "Histogram of KV offload transfer size, in bytes.",
            typed,
            buckets=OFFLOAD_SIZE_BUCKETS,
            registry=r,
        )
        for transfer_type in OFFLOAD_TRANSFER_TYPES:
            for family in (self.kv_offload_total_bytes, self.kv_offload_total_time, self.kv_offload_size):
                family.labels(**self._base, transfer_type=transfer_type)

        def flat_counter(name: str, doc: str) -> Counter:
            c = Counter(name, doc, base, registry=r)
            c.labels(**self._base)
            return c

        def flat_histogram(name: str, doc: str) -> Histogram:
            h = Histogram(name, doc, base, buckets=OFFLOAD_SIZE_BUCKETS, registry=r)
            h.labels(**self._base)
            return h

        self.kv_offload_load_bytes = flat_counter(
            "vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU."
        )
        self.kv_offload_load_time = flat_counter(
            "vllm:kv_offload_load_time", "Total load time from offload storage to GPU, in seconds."
        )
        self.kv_offload_load_size = flat_histogram(
            "vllm:kv_offload_load_size", "Histogram of KV offload load operation size, in bytes."
        )
        self.kv_offload_store_bytes = flat_counter(
            "vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage."
        )
        self.kv_offload_store_time = flat_counter(
            "vllm:kv_offload_store_time", "Total store time from GPU to offload storage, in seconds."
        )
        self.kv_offload_store_size = flat_histogram(
            "vllm:kv_offload_store_size", "Histogram of KV offload store operation size, in bytes."
        )

    def offload_transfer(self, transfer_type: str, num_bytes: int, seconds: float) -> None:
        """Record one CPU<->GPU transfer of ``num_bytes`` under both of vLLM's naming schemes."""
        labels = self._base
        self.kv_offload_total_bytes.labels(**labels, transfer_type=transfer_type).inc(num_bytes)
        self.kv_offload_total_time.labels(**labels, transfer_type=transfer_type).inc(seconds)
        self.kv_offload_size.labels(**labels, transfer_type=transfer_type).observe(num_bytes)
        load = transfer_type == "CPU_to_GPU"
        (self.kv_offload_load_bytes if load else self.kv_offload_store_bytes).labels(**labels).inc(num_bytes)
        (self.kv_offload_load_time if load else self.kv_offload_store_time).labels(**labels).inc(seconds)
        (self.kv_offload_load_size if load else self.kv_offload_store_size).labels(**labels).observe(num_bytes)

    def record_sleep_state(self, sleep: int, level: int) -> None:
        """vLLM's ``PrometheusStatLogger.record_sleep_state``: awake / weights_offloaded (level 1) / discard_all (2)."""
        values = {"awake": 0 if sleep else 1, "weights_offloaded": int(sleep == 1 and level == 1)}
        values["discard_all"] = int(sleep == 1 and level == 2)
        for state, value in values.items():
            self.engine_sleep_state.labels(**self._base, sleep_state=state).set(value)

    @property
    def labels(self) -> dict[str, str]:
        """The common ``model_name``/``engine`` labels."""
        return dict(self._base)

    def render(self) -> bytes:
        """The Prometheus text exposition of every family."""
        return generate_latest(self.registry)
