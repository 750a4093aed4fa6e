"""pytest fixtures for vLLM prefill/decode disaggregated clusters."""

__version__ = "0.1.0.dev0"
