"""kvagent server bundle: vLLM prefill/decode nodes with NIXL KV transfer and the kvagent router."""

__version__ = "0.1.0"
