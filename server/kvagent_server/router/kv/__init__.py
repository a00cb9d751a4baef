"""Where KV blocks live: vLLM block hashes, the per-node block index fed by KV events, tier
and scoring (a decode node's free blocks are the legs' ledger's: `nodes.ledger`)."""
