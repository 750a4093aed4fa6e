"""Running clusters: one server process, readiness, launching a cluster, sharing clusters, the watchdog and guard,
process trees, health, verification, attach mode, failure hints.
"""
