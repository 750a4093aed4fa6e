"""``--pd-reuse``: keep clusters between runs (see docs/reuse.md and docs/architecture.md).

Empty on purpose: the keeper (`keeper.py`) runs under ``python -I -S`` and imports this package first, so nothing
here may import more than the standard library.
"""

#: The name the main plugin registers the reuse plugin under (`reuse.plugin.ReusePlugin`), when --pd-reuse is given.
PLUGIN_NAME = "pdserve-reuse"
