"""Settings and cluster description: the setting table and its parsers, the frozen settings object, flags pdserve owns,
the spec + session merge, each server's argv/env, vLLM's script presets.
"""
