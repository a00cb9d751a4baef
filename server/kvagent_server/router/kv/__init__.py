"""Where KV blocks live: vLLM block hashes, the per-node block index fed by KV events, tier
scoring, and each decode node's free blocks."""
