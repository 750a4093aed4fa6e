"""What a NIXL prefill's ``kv_transfer_params`` carry, per version. [stdlib]

* **``remote_registration_generation``**: from 0.33 (``NIXL_CONNECTOR_VERSION`` 15, "Add
  remote_registration_generation to kv_transfer_params", ``distributed/kv_transfer/kv_connector/v1/nixl/metadata.py``;
  set by ``NixlPullScheduler`` in ``nixl/pull_scheduler.py``), 0 until the KV cache is registered again (the
  simulator never does).
"""

from __future__ import annotations

from pytest_pdserve.rules.versions import VersionTable

__all__ = ["REGISTRATION_GENERATION"]

#: Whether a prefill's ``kv_transfer_params`` carry ``remote_registration_generation``.
REGISTRATION_GENERATION: VersionTable[bool] = VersionTable.of([("0.0", False), ("0.33", True)])
