"""What serves: engine discovery (real vLLM or the simulator), vLLM version rules, the CPU platform, the tiny models,
running inside a vLLM checkout.
"""
