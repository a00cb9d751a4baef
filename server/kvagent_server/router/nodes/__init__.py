"""The router's I/O with its vLLM nodes: the HTTP client (`client`), the node registry and
health (`registry`), the one ledger of legs in flight (`ledger`), prompt ids from `/tokenize` (`prompt_ids`), the P and D legs (`legs`),
admission by decode KV room (`admission`), tier-aware P placement (`tier_placement`), and
decode retention and releases (`retention`). Imports no stage of `turns`."""
