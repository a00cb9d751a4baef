"""One turn against the nodes: node registry, upstream client, prompt ids, legs, relay, orchestration."""
