"""What the bundle knows about the vLLM engine outside vLLM's process: installing it
(`install`) and its KV tiers below GPU memory, as config and as vLLM flags (`tiers`).

The code that runs inside vLLM is `vllm_plugin`.
"""
