"""Machine resources shared between runs and users: GPU and port leases, lock files, the GPU plan and probes, the
inventory, the lease/log directory rule.
"""
