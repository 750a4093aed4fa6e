"""The KV block size vLLM runs when ``--block-size`` is not given, per version and attention backend. [stdlib]

Read in vLLM's source:

* **The default**: ``CacheConfig.DEFAULT_BLOCK_SIZE`` (``config/cache.py``), set by
  ``CacheConfig._apply_block_size_default`` when no size is given: 16 up to 0.33, 64 from 0.34.
* **The backend's preference** (0.34): ``Platform.update_block_size_for_backend`` (``platforms/interface.py``,
  through ``_preferred_block_size_for_backends``) asks the backend's ``get_preferred_block_size``; every backend
  keeps the default but ``ROCM_ATTN``, which prefers 16 (``v1/attention/backends/rocm_attn.py``
  ``RocmAttentionBackend.get_preferred_block_size``). A given ``--block-size`` is kept.

The plugin always passes ``--block-size`` (one setting per cluster); the simulator runs this default for a server
started without one, and the rules size a Mamba block with it.
"""

from __future__ import annotations

from collections.abc import Mapping

from pytest_pdserve.rules.versions import VersionTable

__all__ = ["DEFAULT", "PREFERRED", "default_block_size"]

#: ``CacheConfig.DEFAULT_BLOCK_SIZE`` by release (16 in every release before 0.34 that was read).
DEFAULT: VersionTable[int] = VersionTable.of([("0.0", 16), ("0.34", 64)])
#: ``get_preferred_block_size`` of the backends that do not keep the default (0.34).
PREFERRED: VersionTable[Mapping[str, int]] = VersionTable.of([("0.0", {}), ("0.34", {"ROCM_ATTN": 16})])


def default_block_size(version: object, backend: str | None) -> int:
    """The block size vLLM ``version`` runs without ``--block-size``, with attention ``backend`` (None: not known)."""
    default = DEFAULT.at(version) or 16
    return (PREFERRED.at(version) or {}).get((backend or "").upper(), default)
