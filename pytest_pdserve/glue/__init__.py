"""The pytest side: fixtures, markers and skips, per-test log sections, --pd-export-env, start errors in reports, the
session inventory.
"""
