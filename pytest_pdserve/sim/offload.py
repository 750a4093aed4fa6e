"""The CPU tier of ``OffloadingConnector`` (alone or inside a ``MultiConnector``), as vLLM's CPU offloading does it.

Checked against vLLM's ``v1/kv_offload/cpu/spec.py``, ``offloading_connector.py`` and ``offloading/metrics.py``:

* capacity: ``kv_connector_extra_config.cpu_bytes_to_use`` (required; vLLM raises "cpu_bytes_to_use must be
  specified in kv_connector_extra_config") divided by the bytes of one offloaded block (the GPU block size);
  LRU eviction (vLLM's default ``eviction_policy``);
* store (GPU->CPU): every full block a request computed is written to the CPU tier when the request finishes,
  unless the tier already holds it;
* load (CPU->GPU): a request whose prefix continues past the GPU prefix-cache hit in the CPU tier loads those
  blocks; they count as connector ("external") hits with ``source="host"``. Inside a MultiConnector the NIXL
  connector comes first: a request with ``do_remote_prefill`` is served by NIXL and the CPU tier is not asked;
* metrics: ``vllm:kv_offload_total_bytes`` / ``_total_time`` / ``_size`` with ``transfer_type`` ``CPU_to_GPU`` or
  ``GPU_to_CPU`` (vLLM keeps these "deprecated" names for the CPU spec) and the flat
  ``vllm:kv_offload_load_bytes`` / ``_store_bytes`` / ``_load_time`` / ``_store_time`` / ``_load_size`` /
  ``_store_size``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_pdserve.rules.connectors import OFFLOAD_BYTES_MESSAGE


class OffloadConfigError(ValueError):
    """The OffloadingConnector's ``kv_connector_extra_config`` cannot be simulated."""


def cpu_bytes_to_use(extra: Mapping[str, Any]) -> int:
    """``cpu_bytes_to_use`` of an OffloadingConnector's extra config. :raises OffloadConfigError: missing/bad."""
    value = extra.get("cpu_bytes_to_use")
    if not value:  # vLLM's rule (rules/connectors.py), met here first: the simulator reads the config at its start
        raise OffloadConfigError(OFFLOAD_BYTES_MESSAGE)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise OffloadConfigError(f"cpu_bytes_to_use={value!r} in kv_connector_extra_config is not a byte count")
    unsupported = sorted(set(extra) - {"cpu_bytes_to_use", "eviction_policy", "spec_name", "block_size"})
    if unsupported:
        raise OffloadConfigError(
            f"pdserve-sim's OffloadingConnector does not simulate kv_connector_extra_config keys {unsupported}"
        )
    if extra.get("eviction_policy", "lru") != "lru":
        raise OffloadConfigError(f"pdserve-sim simulates eviction_policy 'lru' only, not {extra['eviction_policy']!r}")
    return int(value)


class CpuTier:
    """LRU store of the blocks that have a CPU copy: block hash -> the copy's KV (sim/kvcontent.py)."""

    def __init__(self, capacity_bytes: int, bytes_per_block: int) -> None:
        self.num_blocks = capacity_bytes // bytes_per_block
        self.bytes_per_block = bytes_per_block
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, have a CPU copy (marks them recently used)."""
        hit = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hit += 1
        return hit

    def reset(self) -> None:
        """Drop every CPU copy (vLLM's ``OffloadingConnector.reset_cache``)."""
        self._blocks.clear()

    def content(self, block_hash: bytes) -> bytes:
        """The KV the CPU copy of a block holds (empty when it has none)."""
        return self._blocks.get(block_hash, b"")

    def store(self, hashes: Sequence[bytes], contents: Sequence[bytes] | None = None) -> int:
        """Write the blocks the tier lacks (evicting LRU ones); returns how many were written."""
        written = 0
        for i, h in enumerate(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            if self.num_blocks == 0:
                break
            while len(self._blocks) >= self.num_blocks:
                self._blocks.popitem(last=False)
            self._blocks[h] = contents[i] if contents is not None else b""
            written += 1
        return written
