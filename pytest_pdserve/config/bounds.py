"""Bounds a setting and a `ClusterSpec` field share, in a module with no imports of ours. [pytest-free]

The settings table needs them when the plugin loads; `spec.py` (which imports the owned-flags and presets tables)
is loaded only when a cluster is described, so the shared values live here and spec.py re-exports them.
"""

from __future__ import annotations

import re

#: Upper bounds shared by the session settings and `ClusterSpec`: beyond them a value only costs memory or time.
MAX_BLOCK_SIZE = 8192
MAX_MODEL_LEN = 1 << 24
#: What vLLM attention backend names look like (``FLASH_ATTN``, ``TRITON_ATTN``, ``auto``).
ATTENTION_BACKEND_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
